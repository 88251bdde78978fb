"""Decoding steps replayed as a CUDA graph (sparse_llm.generation.decoding) give the logits of the same steps run
eagerly,
with the FFN on the dense path and on the sparse decode kernel."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.generation.decoding import DecodeSteps, decode
from sparse_llm.model.llama import ModelConfig, build_model, sparse_mlps

SMALL = ModelConfig(hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4, max_position_embeddings=128)
VOCAB = 301


def model_on_gpu(kernel: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(SMALL, vocab_size=VOCAB, kernel=kernel).to("cuda", torch.bfloat16).eval()


def prompts(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded prompts [B, S] on the GPU and their attention mask."""
    longest = max(lengths)
    ids_BS = torch.zeros(len(lengths), longest, dtype=torch.long, device="cuda")
    mask_BS = torch.zeros_like(ids_BS)
    for row, n in enumerate(lengths):
        ids_BS[row, longest - n :] = torch.randint(1, VOCAB, (n,), device="cuda")
        mask_BS[row, longest - n :] = 1
    return ids_BS, mask_BS


def forced_logits(model, ids_BS, mask_BS, tokens_BT, cuda_graph: bool) -> tuple[list[torch.Tensor], DecodeSteps]:
    """Logits [B, V] after the prompts and after each column of tokens_BT, fed whatever the logits say."""
    with torch.no_grad():
        steps = DecodeSteps(model, mask_BS, tokens_BT.shape[1], cuda_graph)
        logits = [steps.prefill(ids_BS).clone()]
        for column in tokens_BT.unbind(dim=1):
            logits.append(steps(column).clone())  # a replay rewrites its output buffer: keep a copy
    return logits, steps


@pytest.mark.parametrize("kernel", ["torch", "twell"])
@pytest.mark.parametrize("lengths", [[7], [3, 11, 1, 6]])
def test_graph_replays_give_the_eager_logits(kernel, lengths):
    model = model_on_gpu(kernel)
    ids_BS, mask_BS = prompts(lengths)
    tokens_BT = torch.randint(1, VOCAB, (len(lengths), 6), device="cuda")
    eager, _ = forced_logits(model, ids_BS, mask_BS, tokens_BT, cuda_graph=False)
    graphed, steps = forced_logits(model, ids_BS, mask_BS, tokens_BT, cuda_graph=True)
    assert steps.graph is not None, "the decoding step was not captured"
    assert {mlp.dispatcher.current for mlp in sparse_mlps(model)} == {kernel}
    for step, (want, got) in enumerate(zip(eager, graphed, strict=True)):
        # The sparse kernel adds across neurons with atomics: its sums may round differently from run to run.
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2, msg=lambda m, s=step: f"step {s}: {m}")


def test_greedy_decoding_with_graphs_equals_eager_on_the_dense_path():
    model = model_on_gpu("torch")
    ids_BS, mask_BS = prompts([5, 2, 9])
    runs = [
        decode(model, ids_BS, mask_BS, 20, temperature=0, top_p=1.0, end_id=-1, pad_id=0, cuda_graph=graph).new_ids_BT
        for graph in (False, True)
    ]
    assert torch.equal(*runs)
