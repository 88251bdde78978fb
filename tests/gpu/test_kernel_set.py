"""The kernel lists of sparse_llm.ffn.kernel_set against what the launchers ask for: a run that compiles them ahead
(`kernel_set.warm`) leaves no kernel to compile on first use. Needs an sm_90 GPU and cupy."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.cuda import runtime
from sparse_llm.ffn import kernel_set
from sparse_llm.ffn.twell import cost_model
from sparse_llm.ffn.twell.infer_launch import direct_up_down
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn
from sparse_llm.model.llama import ModelConfig, build_model


@pytest.fixture
def requested(monkeypatch):
    """The (source file, kernel name) pairs the launchers ask `cuda.get_function` for during the test."""
    asked: set[tuple[str, str]] = set()
    real = runtime.get_function

    def recording(filename, name, device=None):
        asked.add((filename, name))
        return real(filename, name, device)

    monkeypatch.setattr(runtime, "get_function", recording)
    return asked


def unlisted(asked: set[tuple[str, str]], listed: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted(asked - set(listed))


@pytest.mark.parametrize("k, n", [(2048, 5632), (1024, 11264)])
def test_every_route_of_a_block_asks_for_listed_kernels(k, n, requested, monkeypatch):
    """Inference on every route and walk (heavy tokens included, and the decode kernel) and training with and without
    the slices walks, with bf16 weights and with float32 master weights under autocast."""
    x, wg, wu, wd = synthetic_block(8192, k, n, 40, sigma=0.5, seed=3)
    twell_gated_mlp(x, wg, wu, wd, gate_route="direct", residual_MK=x)
    twell_gated_mlp(x[:5], wg, wu, wd, residual_MK=x[:5])  # few tokens: the decode kernel
    for walk in ("rows", "slices"):
        direct_up_down(x, torch.nn.functional.linear(x, wg), wu, wd.t().contiguous(), walk=walk)
    for slices in (False, True):
        if slices:
            monkeypatch.setattr(cost_model, "FWD_WALK", "slices")
            monkeypatch.setattr(cost_model, "DX_WALK", "slices")
        for master in (False, True):
            leaves = [t.float() if master else t.clone() for t in (x, wg, wu, wd)]
            leaves = [t.requires_grad_() for t in leaves]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
                result = twell_train_ffn(*leaves)
            (result.y_MK.float().sum() + 0.1 * result.l1_sum).backward()
            assert result.dense_rows() > 0  # the heavy tokens' path ran too
    listed = kernel_set.inference_kernels(k, n)
    listed += kernel_set.training_kernels(k, n)
    assert requested and not unlisted(requested, listed)


def test_a_models_steps_ask_for_the_kernels_it_warms(requested):
    """A small twell model's training step (float32 master weights, autocast) and its bf16 inference ask only for
    `model_kernels(model, training=True)`, the rotary embedding's included."""
    config = ModelConfig(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, vocab_size=64)
    model = build_model(config, kernel="twell").cuda()
    ids = torch.randint(0, 64, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.to(torch.bfloat16).eval()(input_ids=ids)
    assert ("rope.cu", kernel_set.ROPE_KERNELS[0][1]) in requested
    assert not unlisted(requested, kernel_set.model_kernels(model, training=True))
