"""Training with CUDA graphs and several micro-batches a step: each micro-batch replays the compiled layers' graphs
(and,
in the step scope as the trainer enters it, the sparse op's forward graphs), and the accumulated gradients equal those
of the same compiled layers run without graphs."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.model.llama import ModelConfig, build_model, compile_layers
from sparse_llm.training.trainer import hold_gradients

SMALL = ModelConfig(hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4, max_position_embeddings=128)
VOCAB = 301
MICRO_BATCHES = 3
STEPS = 3  # the first runs the compiled layers eagerly, the graphs are recorded then replayed


def accumulated_gradients(kernel: str, graphs: bool) -> list[list[torch.Tensor]]:
    """Each step's summed gradients (mean loss over MICRO_BATCHES different micro-batches); fp32 weights under bf16
    autocast in the trainer's step scope (with graphs: the sparse op's forward graphs too); no update, so every step
    sees the same weights."""
    torch.manual_seed(0)
    model = build_model(SMALL, vocab_size=VOCAB, kernel=kernel).cuda().train()
    compile_layers(model, cuda_graphs=graphs)
    if graphs:
        hold_gradients(model.parameters())
    batches = [torch.randint(0, VOCAB, (2, 64), device="cuda") for _ in range(MICRO_BATCHES)]
    steps = []
    for _ in range(STEPS):
        with optimizer_step(reuse_casts=True, add_into_grads=True, graph_forwards=graphs):
            for ids in batches:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                (loss / MICRO_BATCHES).backward()
        steps.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=not graphs)
    torch._dynamo.reset()  # drop the graphs and their memory pool
    return steps


@pytest.mark.parametrize("kernel", ["torch", "twell"])
def test_micro_batches_replaying_graphs_accumulate_the_gradients_of_ungraphed_layers(kernel):
    """A gradient that was a backward graph's own output buffer would be overwritten by the next micro-batch's replay
    (two micro-batches' worth where three were summed: a third off); held gradients are only added into."""
    plain = accumulated_gradients(kernel, graphs=False)
    graphed = accumulated_gradients(kernel, graphs=True)
    for step, (expected, got) in enumerate(zip(plain, graphed, strict=True)):
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            scale = e.abs().max().item()
            assert scale > 0, f"parameter {i} has no gradient"
            error = (g - e).abs().max().item() / scale
            # the twell op sums long columns of its weight gradients with fp32 atomics: last bits vary run to run
            assert error < 1e-2, f"step {step}, parameter {i}: max error {error:.2e} of the gradient's max"
