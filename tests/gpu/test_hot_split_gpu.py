"""The split block of scripts/bench_hot_split.py on the GPU (sparse_llm/bench/hot_split.py): the sparse training op's
kernels on the cold neurons plus the dense path on the hot ones compute the whole block, within the error budget of
the kernel tests (twice the dense bf16 path's error against an fp32 reference, plus a small atol), for y, L1 and the
four gradients."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.bench.concentration import gate_positives
from sparse_llm.bench.hot_split import split_forward, split_weights
from sparse_llm.bench.train_block import backward, dense_forward
from sparse_llm.ffn.twell.synthetic import synthetic_block

ATOL = 1e-3
M, K, N = 4096, 1024, 2048  # N - H stays a multiple of 256 for the kernels


def _within_budget(name: str, got: torch.Tensor, ref: torch.Tensor, dense: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), f"{name} has NaN or inf"
    err, dense_err, scale = (got.float() - ref).norm(), (dense.float() - ref).norm(), ref.norm()
    assert err <= 2 * dense_err + ATOL * (1 + scale), f"{name}: {err:.3e} against dense bf16 {dense_err:.3e}"


def _dense_step(weights, x, dy, coeff, dtype):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (x, *weights)]
    y, l1 = dense_forward(*leaves)
    return y.detach(), l1.detach(), backward(y, l1, leaves, dy.to(dtype), coeff)


@pytest.mark.parametrize("hot_count, sigma", [(256, 0.0), (512, 0.3)])
def test_cold_neurons_on_the_kernels_plus_hot_ones_dense_give_the_whole_block(hot_count: int, sigma: float) -> None:
    x, wg, wu, wd = synthetic_block(M, K, N, 40, sigma, seed=hot_count)
    gen = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    coeff = torch.tensor(1e-3, device="cuda")
    hot_N = torch.zeros(N, dtype=torch.bool, device="cuda")
    hot_N[gate_positives(x, wg)[1].argsort(descending=True)[:hot_count]] = True

    cold, hot = (tuple(w.requires_grad_() for w in part) for part in split_weights((wg, wu, wd), hot_N))
    x_leaf = x.clone().requires_grad_()
    y, l1 = split_forward(x_leaf, cold, hot)
    dx, *dw_parts = backward(y, l1, [x_leaf, *cold, *hot], dy, coeff)

    y_ref, l1_ref, grads_ref = _dense_step((wg, wu, wd), x, dy, coeff, torch.float32)
    y_dense, l1_dense, grads_dense = _dense_step((wg, wu, wd), x, dy, coeff, torch.bfloat16)
    _within_budget("y", y, y_ref, y_dense)
    _within_budget("dx", dx, grads_ref[0], grads_dense[0])
    assert abs(l1.item() - l1_ref.item()) <= 2 * abs(l1_dense.item() - l1_ref.item()) + 1e-3 * l1_ref.item()
    cold_index, hot_index = (~hot_N).nonzero().squeeze(1), hot_N.nonzero().squeeze(1)
    for i, (name, dim) in enumerate((("dw_gate", 0), ("dw_up", 0), ("dw_down", 1))):
        whole = torch.empty_like(grads_ref[1 + i])
        whole.index_copy_(dim, cold_index, dw_parts[i].float())
        whole.index_copy_(dim, hot_index, dw_parts[3 + i].float())
        _within_budget(name, whole, grads_ref[1 + i], grads_dense[1 + i])
