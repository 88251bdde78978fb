"""TwELL inference kernels vs the torch references, on fresh random inputs (needs an sm_90 GPU and cupy).

Tolerance (DESIGN.md conventions): the kernel's error against an fp32 reference may be at most twice
the error of the dense bf16 torch path against the same reference, plus a small atol; per token too, so
a single wrong row cannot hide in a global norm. Outputs are poisoned before each call by handing the
op NaN-filled blocks of the caching allocator.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparse_llm import cuda
from sparse_llm.formats import (
    TwellPacked,
    canonicalize_twell,
    gated_mlp_ref,
    pack_twell,
    unpack_twell,
    validate_twell,
)

REASON = cuda.unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(REASON is not None, reason=f"twell kernels unavailable: {REASON}"),
]

if REASON is None:
    from sparse_llm.twell_backend import (
        TransposeCache,
        synthetic_block,
        transposed_bf16,
        twell_gate,
        twell_gated_mlp,
        twell_pack,
        twell_up_down,
    )

ATOL = 1e-3


def poison(*shapes_dtypes: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill and free blocks of the given sizes so the op's next torch.empty of that size gets NaN/0xFF.. bytes."""
    blocks = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes_dtypes]
    for block in blocks:
        block.view(torch.uint8).fill_(0xFF)  # NaN for float types, count 0xFFFFFFFF for packed words
    del blocks


def assert_close_to_ref(y_MK: torch.Tensor, x_MK, w_gate_NK, w_up_NK, w_down_KN) -> None:
    """Kernel output vs fp32 reference, with 2x the dense bf16 error as budget, globally and per token."""
    assert not torch.isnan(y_MK).any(), "output has NaN: some element was not written"
    ref_MK = gated_mlp_ref(x_MK, w_gate_NK, w_up_NK, w_down_KN, upcast=True)[0]
    dense_MK = gated_mlp_ref(x_MK, w_gate_NK, w_up_NK, w_down_KN)[0].float()
    err_M = (y_MK.float() - ref_MK).norm(dim=1)
    dense_err_M = (dense_MK - ref_MK).norm(dim=1)
    ref_M = ref_MK.norm(dim=1)
    rel_dense = (dense_err_M.norm() / ref_M.norm().clamp_min(1e-30)).item()
    assert err_M.norm() <= 2 * dense_err_M.norm() + ATOL * (
        1 + ref_M.norm()
    ), f"global error {err_M.norm().item():.3e} vs dense bf16 {dense_err_M.norm().item():.3e}"
    budget_M = 2 * torch.maximum(dense_err_M, rel_dense * ref_M) + ATOL * (1 + ref_M)
    bad = (err_M > budget_M).nonzero()[:, 0]
    assert (
        bad.numel() == 0
    ), f"rows {bad[:10].tolist()} off: err {err_M[bad[:5]].tolist()} budget {budget_M[bad[:5]].tolist()}"


def check_stats(result, x_MK, w_gate_NK, w_up_NK) -> None:
    """l0_M, fired_N and l1_sum against the fp32 reference (sign flips of near-zero gates are tolerated)."""
    h_MN = F.relu(F.linear(x_MK.float(), w_gate_NK.float())) * F.linear(x_MK.float(), w_up_NK.float())
    l0_ref_M = (h_MN != 0).sum(dim=1)
    diff_M = (result.l0_M.long() - l0_ref_M).abs()
    assert diff_M.max() <= 2 and diff_M.sum() <= 1e-3 * l0_ref_M.sum() + 2, f"l0 off by up to {diff_M.max()}"
    fired_ref_N = (h_MN != 0).any(dim=0)
    assert (result.fired_N != fired_ref_N).sum() <= 2 + 1e-3 * fired_ref_N.numel()
    l1_ref = h_MN.abs().sum()
    assert abs(result.l1_sum.item() - l1_ref.item()) <= 1e-2 * l1_ref.item() + 1e-3


def run_case(x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route="auto", dense_row_nnz=128):
    m, k = x_MK.shape
    poison(((m, k), torch.bfloat16))
    result = twell_gated_mlp(
        x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route=gate_route, dense_row_nnz=dense_row_nnz
    )
    torch.cuda.synchronize()
    assert_close_to_ref(result.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)
    check_stats(result, x_MK, w_gate_NK, w_up_NK)
    return result


@pytest.mark.parametrize("m", [1, 7, 64, 300, 4096, 32768])
@pytest.mark.parametrize("route", ["fused", "cublas"])
def test_uniform_density(m, route):
    if m == 32768 and route == "cublas":
        pytest.skip("cublas route is for small M; covered at 4096")
    block = synthetic_block(m, 2048, 5632, nnz_mean=56, seed=m)
    result = run_case(*block, gate_route=route)
    assert result.path == "twell" or result.overflow_rows > 0


@pytest.mark.parametrize("sigma", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("m", [300, 4096])
def test_heavy_tailed_with_overflow(m, sigma):
    """Heavy tokens (> 128 non-zeros) and overflowed ones go dense; the rest sparse; all exact."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=60, sigma=sigma, seed=int(sigma * 10) + m)
    result = run_case(*block)
    packed = pack_twell(F.linear(block[0].float(), block[1].float()))
    expected = int(packed.overflow_M.sum())
    assert abs(result.overflow_rows - expected) <= 1  # a near-zero gate may flip sign at a tile's edge
    if sigma >= 0.5:
        assert expected > 0, "this case is meant to overflow some tiles"
        assert result.path == "twell+dense-rows"


@pytest.mark.parametrize("dense_row_nnz", [128, 1 << 30])
@pytest.mark.parametrize("m", [7, 300, 4096])
def test_dense_zero_and_hot_rows(m, dense_row_nnz):
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(m, 2048, 5632, nnz_mean=28, seed=7 * m)
    x_MK[::5, 0] = -1.0  # flips the shift: ~99.5% of the gate positive, every tile overflows
    x_MK[1::5] = 0.0  # all-zero tokens: the gate is exactly 0, nothing is positive
    w_gate_NK[123, 0] = 10.0  # neuron 123 fires for (almost) every token
    result = run_case(x_MK, w_gate_NK, w_up_NK, w_down_KN, dense_row_nnz=dense_row_nnz)
    assert result.overflow_rows == len(range(0, m, 5))
    assert bool(result.fired_N[123])
    assert result.fired_N.dtype == torch.bool
    assert (result.l0_M[1::5] == 0).all()


def test_heavy_rows_stay_exact_on_the_sparse_path():
    """With the dense-row threshold off, long (non-overflowing) rows run through the kernel itself."""
    block = synthetic_block(1000, 2048, 5632, nnz_mean=150, seed=4)
    result = run_case(*block, dense_row_nnz=1 << 30)
    assert result.overflow_rows == 0 and result.path == "twell"


@pytest.mark.parametrize("k,n", [(64, 256), (320, 768), (1024, 2816), (4096, 1024)])
@pytest.mark.parametrize("m", [1, 129, 1500])
def test_general_shapes(m, k, n):
    block = synthetic_block(m, k, n, nnz_mean=n * 0.01, sigma=0.3, seed=k + n + m)
    for route in ("fused", "cublas"):
        run_case(*block, gate_route=route)


@pytest.mark.parametrize("m", [1, 100, 4096])
def test_fused_gate_packing(m):
    """The fused GEMM's packing equals the reference packing of an fp32 gate (up to near-zero sign flips)."""
    x_MK, w_gate_NK, _, _ = synthetic_block(m, 2048, 5632, nnz_mean=100, sigma=0.5, seed=3 * m)
    poison(((m, 22 * 32), torch.int32))
    packed = TwellPacked(twell_gate(x_MK, w_gate_NK, route="fused"), 5632, 8)
    validate_twell(packed)  # counts written for every segment, entries in their tiles, no duplicates
    gate_MN = F.linear(x_MK.float(), w_gate_NK.float())
    ref = pack_twell(gate_MN)
    count_diff = (packed.counts_MT - ref.counts_MT).abs()
    assert count_diff.max() <= 1 and count_diff.sum() <= 1e-4 * ref.counts_MT.sum() + 2
    rows = (~(packed.overflow_M | ref.overflow_M)).nonzero()[:, 0]
    got, want = unpack_twell(packed, rows).float(), unpack_twell(ref, rows).float()
    assert ((got - want).abs() <= 1e-2 * want.abs() + 1e-3).all()


@pytest.mark.parametrize("m", [1, 33, 2000])
def test_pack_kernel_is_exact(m):
    """The packing kernel gives the reference packing bit for bit (after sorting entries)."""
    gate_MN = torch.randn(m, 2560, device="cuda").to(torch.bfloat16) - 1.5
    gate_MN[::3, :300] = 1.0  # overflowing tiles
    poison(((m, 10 * 32), torch.int32))
    got = canonicalize_twell(TwellPacked(twell_pack(gate_MN), 2560, 8))
    assert torch.equal(got.words_MS, pack_twell(gate_MN).words_MS)


def test_up_down_splits_agree():
    """The split (small-M) and unsplit layouts of the up+down kernel compute the same rows."""
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(4096, 2048, 5632, nnz_mean=56, seed=11)
    packed = twell_gate(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    full = twell_up_down(x_MK, packed, w_up_NK, w_t)
    part = twell_up_down(x_MK[:17], packed[:17], w_up_NK, w_t)
    assert not full.dense_M[:17].any()
    assert torch.allclose(full.y_MK[:17].float(), part.y_MK.float(), rtol=1e-2, atol=1e-3)
    assert torch.equal(full.l0_M[:17], part.l0_M)


def test_transpose_cache_follows_weight_updates():
    cache = TransposeCache()
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    first = cache.get(w)
    assert cache.get(w) is first
    w.mul_(2)  # in-place update bumps the version
    second = cache.get(w)
    assert second is not first and torch.equal(second, w.t())
    del w
    assert len(cache) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(32, 32), (64, 256), (2048, 5632), (96, 4096)])
def test_transpose_kernel_is_exact(rows, cols, dtype):
    src = torch.randn(rows, cols, device="cuda", dtype=dtype)
    got = transposed_bf16(src)
    assert got.shape == (cols, rows) and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, src.t().to(torch.bfloat16))
    view = transposed_bf16(src[:, : cols // 2])  # a non-contiguous input is copied first
    assert torch.equal(view, src[:, : cols // 2].t().to(torch.bfloat16))


def test_empty_batch():
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(3, 256, 256, nnz_mean=5)
    result = twell_gated_mlp(x_MK[:0], w_gate_NK, w_up_NK, w_down_KN)
    assert result.y_MK.shape == (0, 256) and result.l0_M.shape == (0,)


def test_runs_on_current_stream():
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(2048, 2048, 5632, nnz_mean=56, seed=5)
    expected = twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN).y_MK
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN).y_MK
    torch.cuda.current_stream().wait_stream(stream)
    assert math.isclose((got.float() - expected.float()).abs().max().item(), 0.0, abs_tol=1e-6)
