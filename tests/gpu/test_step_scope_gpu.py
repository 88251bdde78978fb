"""The training op inside `step_scope.optimizer_step` on the GPU: weight gradients added into held float32 `.grad`
tensors by the kernels themselves (the weight-gradient kernel's `add`, the transposed add of dW_down, the heavy
tokens' GEMMs), and the weights' bf16 casts reused over a step's micro-batches. Accumulated gradients must equal those
autograd sums from the op's own gradients, with heavy tokens, a hot neuron (a column summed in scratch slots) and dead
neurons (empty columns) in every micro-batch."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from helpers.runs import ROOT, child_env

from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.ffn.twell import train_op
from sparse_llm.ffn.twell.csc import csc_index, csc_keys, csc_weight_gradients, wgrad_scratch
from sparse_llm.ffn.twell.infer_launch import transposed_copy
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn
from sparse_llm.formats import hybrid_t_matmul, pack_hybrid

M, K, N = 2048, 1024, 2816
MICRO_BATCHES = 3
DL1 = 0.3
HOT, DEAD = 123, slice(200, 300)


def weights_and_batches() -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """fp32 master weights and MICRO_BATCHES (x, dy) pairs: heavy-tailed tokens (sigma 0.5: some take the backup
    rows), a neuron that fires for every token and a hundred that never fire."""
    _, wg, wu, wd = synthetic_block(M, K, N, 40, sigma=0.5, seed=0)
    wg[HOT, 0] = 10.0
    wg[DEAD, 0] = -100.0
    batches = []
    for micro in range(MICRO_BATCHES):
        x = synthetic_block(M, K, N, 40, sigma=0.5, seed=1 + micro)[0]
        dy = torch.randn(M, K, device="cuda", generator=torch.Generator("cuda").manual_seed(micro)).bfloat16()
        batches.append((x, dy))
    return [w.float() for w in (wg, wu, wd)], batches


def accumulated(add_into_grads: bool, held: bool) -> list[torch.Tensor]:
    weights, batches = weights_and_batches()
    weights = [w.clone().requires_grad_() for w in weights]
    if held:
        for w in weights:
            w.grad = torch.zeros_like(w)
    heavy = 0
    with optimizer_step(reuse_casts=True, add_into_grads=add_into_grads):
        for x, dy in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                result = twell_train_ffn(x, *weights)
            ((result.y_MK.float() * dy.float()).sum() + DL1 * result.l1_sum).backward()
            heavy += result.dense_rows()
    assert heavy > 0  # the heavy tokens' GEMMs added into the gradients too
    return [w.grad for w in weights]


@pytest.fixture
def into_calls(monkeypatch) -> list[bool]:
    calls = []
    backward = train_op.cuda_backward

    def spy(*args, grads_into=None):
        calls.append(grads_into is not None)
        return backward(*args, grads_into=grads_into)

    monkeypatch.setattr(train_op, "cuda_backward", spy)
    return calls


@pytest.mark.parametrize("held", [False, True])
def test_gradients_added_into_grad_equal_autograds_sums(held, into_calls):
    plain = accumulated(add_into_grads=False, held=held)
    assert into_calls == [False] * MICRO_BATCHES
    into_calls.clear()
    fused = accumulated(add_into_grads=True, held=held)
    assert into_calls == [held] + [True] * (MICRO_BATCHES - 1)  # without held grads the first one hands its over
    for name, got, want in zip(("w_gate", "w_up", "w_down"), fused, plain, strict=True):
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
        scale = want.abs().max().item()
        assert scale > 0 and want[HOT if name != "w_down" else slice(None)].abs().max() > 0, name
        # fp32 sums either way; the hot column's chunks are added with atomics in a varying order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert not fused[0][DEAD].any() and not fused[2][:, DEAD].any()  # empty columns add nothing


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_kernel_adds_to_every_row(out_dtype):
    """csc_weight_gradients with add: out = what it held + the sums, rows of empty columns untouched, hot columns
    summed in a
    scratch slot first (left zeroed)."""
    m, n, k, width = 3000, 512, 2048, 40
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(m, n, device="cuda", generator=gen)
    h *= torch.rand(m, n, device="cuda", generator=gen) < 0.03
    h[:, 7] = torch.randn(m, device="cuda", generator=gen)  # hot column: many chunks
    h[:, 11] = 0.0  # empty column
    packed = pack_hybrid(h.bfloat16(), width=width)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    csc = csc_index(csc_keys(packed.ell_cols_MW, packed.ell_count_M, packed.heavy_M, n), n)
    values = packed.ell_values_MW.contiguous()
    before = torch.randn(n, k, device="cuda", generator=gen).to(out_dtype)
    out = before.clone()
    scratch, counters = wgrad_scratch(k, torch.device("cuda"))
    csc_weight_gradients(csc, (values,), x, (out,), scratch, counters[0], width, add=True)
    want = before.float() + hybrid_t_matmul(
        packed.with_values(values, torch.zeros_like(packed.backup_values_RN)), x.float()
    )
    rtol = 1e-4 if out_dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=rtol)
    assert torch.equal(out[11], before[11]) and not scratch.any()


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_transposed_add(src_dtype):
    src = torch.randn(768, 320, device="cuda").to(src_dtype)
    out = torch.randn(320, 768, device="cuda")
    want = out + src.float().t()
    transposed_copy(src, torch.float32, out=out, add=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_ddp_all_reduces_gradients_the_kernels_added_in_place():
    """Two ranks on the GPU (gloo: they may share one), the op's kernels under DDP
    (tests/helpers/ddp_step_scope_check.py): from the second micro-batch on the kernels and the heavy tokens' GEMMs add
    into .grad, and the reducer all-reduces those sums, equal to one process's over both ranks' batches."""
    run = subprocess.run(
        ["torchrun", "--nproc_per_node", "2", "tests/helpers/ddp_step_scope_check.py", "cuda"],
        cwd=ROOT,
        env=child_env(gpu=True),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    ranks = [line for line in run.stdout.splitlines() if "added in place [False, True, True]" in line]
    assert len(ranks) == 2, run.stdout[-2000:]
