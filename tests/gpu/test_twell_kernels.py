"""TwELL inference kernels vs the torch references, on fresh random inputs (needs an sm_90 GPU and cupy).

Tolerance (docs/design.md "Conventions"): the kernel's error against an fp32 reference may be at most twice
the error of the dense bf16 torch path against the same reference, plus a small atol; per token too, so
a single wrong row cannot hide in a global norm. Outputs are poisoned before each call by handing the
op NaN-filled blocks of the caching allocator.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparse_llm.ffn.backend import FFNResult
from sparse_llm.ffn.dispatch import density_of
from sparse_llm.ffn.twell import cost_model, infer_launch, infer_op
from sparse_llm.ffn.twell.cost_model import direct_walk
from sparse_llm.ffn.twell.decode import decode_workspace
from sparse_llm.ffn.twell.infer_launch import TransposeCache, direct_up_down, transposed_copy, twell_gate
from sparse_llm.ffn.twell.infer_op import measured_walk, twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.formats import (
    TwellPacked,
    gated_mlp_ref,
    pack_twell,
    unpack_twell,
    validate_twell,
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
    assert err_M.norm() <= 2 * dense_err_M.norm() + ATOL * (1 + ref_M.norm()), (
        f"global error {err_M.norm().item():.3e} vs dense bf16 {dense_err_M.norm().item():.3e}"
    )
    budget_M = 2 * torch.maximum(dense_err_M, rel_dense * ref_M) + ATOL * (1 + ref_M)
    bad = (err_M > budget_M).nonzero()[:, 0]
    assert bad.numel() == 0, (
        f"rows {bad[:10].tolist()} off: err {err_M[bad[:5]].tolist()} budget {budget_M[bad[:5]].tolist()}"
    )


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
    result = twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route=gate_route, dense_row_nnz=dense_row_nnz)
    torch.cuda.synchronize()
    assert_close_to_ref(result.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)
    check_stats(result, x_MK, w_gate_NK, w_up_NK)
    return result


@pytest.mark.parametrize("m", [1, 7, 64, 300, 2047, 2048, 4096, 32768])
def test_uniform_density(m):
    block = synthetic_block(m, 2048, 5632, nnz_mean=56, seed=m)
    result = run_case(*block, gate_route="direct")
    assert result.path == "twell-direct" and result.overflow_rows == 0


@pytest.mark.parametrize("sigma", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("m", [300, 4096, 16384])
def test_direct_route_heavy_tailed(m, sigma):
    """Direct route: tokens 20-100x denser than the mean are split over warps, never recomputed; all exact."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=28, sigma=sigma, seed=int(sigma * 10) + m + 1)
    result = run_case(*block, gate_route="direct")
    assert result.overflow_rows == 0 and result.path == "twell-direct"
    assert result.l0_M.max() > 128, "this case is meant to have tokens on the split path"


@pytest.mark.parametrize("dense_row_nnz", [128, 1 << 30])
@pytest.mark.parametrize("m", [7, 300, 4096])
def test_dense_zero_and_hot_rows(m, dense_row_nnz):
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(m, 2048, 5632, nnz_mean=28, seed=7 * m)
    odd_rows(x_MK, w_gate_NK)  # the dense tokens overflow every tile
    result = run_case(x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route="direct", dense_row_nnz=dense_row_nnz)
    assert result.overflow_rows == 0
    assert bool(result.fired_N[123])
    assert result.fired_N.dtype == torch.bool
    assert (result.l0_M[1::5] == 0).all()


@pytest.mark.parametrize("m", [1000, 4096])
def test_heavy_rows_stay_exact_on_the_sparse_path(m):
    """With the dense-row threshold off, long (non-overflowing) rows run through the sparse kernels."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=150, seed=4)
    result = run_case(*block, gate_route="direct", dense_row_nnz=1 << 30)
    assert result.overflow_rows == 0 and result.path == "twell-direct"


@pytest.mark.parametrize("k,n", [(64, 256), (320, 768), (1024, 2816), (4096, 1024)])
@pytest.mark.parametrize("m", [1, 129, 1500, 2500])
def test_general_shapes(m, k, n):
    block = synthetic_block(m, k, n, nnz_mean=n * 0.01, sigma=0.3, seed=k + n + m)
    run_case(*block, gate_route="direct")


@pytest.mark.parametrize("observed", [False, True])
def test_direct_route_never_syncs_and_replays_in_a_cuda_graph(observed):
    """The direct route reads nothing back to the host: it runs under sync-error mode and in a CUDA graph, also with
    a layer's observed density (its heavy tokens then go through the dense rows)."""
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(4096, 2048, 5632, nnz_mean=28, sigma=0.5, seed=21)
    first = twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route="direct")  # compiles the kernels
    l0_mean, l0_max, tail = density_of(first.l0_M)
    hints = {"l0_hint": (l0_mean, l0_max), "tail": tail} if observed else {}
    assert not observed or cost_model.dense_row_capacity(4096, (l0_mean, l0_max), tail=tail) > 0

    def call():
        return twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN, gate_route="direct", **hints)

    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x_MK.copy_(x_MK.flip(0))  # new inputs in place: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    fresh = call()
    torch.testing.assert_close(captured.y_MK, fresh.y_MK)
    assert (captured.l0_M - fresh.l0_M).abs().max() <= 1
    assert_close_to_ref(captured.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)


@pytest.mark.parametrize("m", [1, 100, 4096])
def test_fused_gate_packing(m):
    """The fused GEMM's packing equals the reference packing of an fp32 gate (up to near-zero sign flips)."""
    x_MK, w_gate_NK, _, _ = synthetic_block(m, 2048, 5632, nnz_mean=100, sigma=0.5, seed=3 * m)
    poison(((m, 22 * 32), torch.int32))
    packed = TwellPacked(twell_gate(x_MK, w_gate_NK), 5632, 8)
    validate_twell(packed)  # counts written for every segment, entries in their tiles, no duplicates
    gate_MN = F.linear(x_MK.float(), w_gate_NK.float())
    ref = pack_twell(gate_MN)
    count_diff = (packed.counts_MT - ref.counts_MT).abs()
    assert count_diff.max() <= 1 and count_diff.sum() <= 1e-4 * ref.counts_MT.sum() + 2
    rows = (~(packed.overflow_M | ref.overflow_M)).nonzero()[:, 0]
    got, want = unpack_twell(packed, rows).float(), unpack_twell(ref, rows).float()
    assert ((got - want).abs() <= 1e-2 * want.abs() + 1e-3).all()


def test_direct_split_and_one_warp_paths_agree():
    """Direct route: the same tokens through the one-warp kernel (large M) and the split kernel (small M)."""
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(4096, 2048, 5632, nnz_mean=56, seed=12)
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    y_full, l1_full, l0_full, fired_full = direct_up_down(x_MK, gate_MN, w_up_NK, w_t)
    y_part, l1_part, l0_part, _ = direct_up_down(x_MK[:17], gate_MN[:17], w_up_NK, w_t)
    assert torch.allclose(y_full[:17].float(), y_part.float(), rtol=1e-2, atol=1e-3)
    assert torch.equal(l0_full[:17], l0_part)
    assert torch.allclose(l1_full[:17], l1_part, rtol=1e-5)
    assert fired_full.dtype == torch.int32 and set(fired_full.unique().tolist()) <= {0, 1}


@pytest.mark.parametrize("k", [1024, 4096])
def test_direct_column_parts_give_the_one_pass_bits(k):
    """Walking the gate columns in parts, as wide blocks are walked, carries each token's fp32 sums from part to part:
    tokens on the one-warp path (4096 tokens, none heavy) get the one-pass y, l1, l0 and fired bit for bit, with the
    residual folded in on the last part."""
    m = 4096
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(m, k, 3072, nnz_mean=40, seed=k + 5)
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    residual_MK = torch.randn(m, k, device="cuda").bfloat16()
    one = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, residual_MK=residual_MK, parts=1)
    assert one[2].max() <= 128  # every token on the one-warp path
    for parts in (2, 3, 12):
        poison(((m, k), torch.bfloat16), ((m, k), torch.float32), ((m,), torch.float32))
        got = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, residual_MK=residual_MK, parts=parts)
        for name, a, b in zip(("y", "l1", "l0", "fired"), got, one):
            assert torch.equal(a, b), f"{name} differs with {parts} parts"


@pytest.mark.parametrize("m", [17, 4096])
def test_direct_column_parts_with_heavy_tokens(m):
    """Parts with a heavy tail (tokens split over warps in some parts and not in others) and at 17 tokens (every
    token split over warps): y within the reference tolerance, the same l0 and fired as one pass."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=56, sigma=0.6, seed=m + 21)
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    one = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, parts=1)
    if m > 17:
        assert one[2].max() > 128  # some tokens take the split kernel
    poison(((m, 2048), torch.bfloat16), ((m, 2048), torch.float32))
    y_MK, l1_M, l0_M, fired_N = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, parts=5)
    assert_close_to_ref(y_MK, *block)
    assert torch.equal(l0_M, one[2]) and torch.equal(fired_N, one[3])
    assert torch.allclose(l1_M, one[1], rtol=1e-5)


def heavy_token_count(gate_MN: torch.Tensor, threshold: int = 128) -> int:
    return int(((gate_MN > 0).sum(dim=1) > threshold).sum())


@pytest.mark.parametrize("walk", ["rows", "slices"])
@pytest.mark.parametrize(
    "m, sigma, capacity",
    [
        (2048, 0.5, 64),  # more heavy tokens than rows reserved: the rest split over warps
        (2048, 0.5, 2048),  # every token could be dense; only the heavy ones are
        (16384, 0.5, 512),
        (4096, 1.0, 4096),  # tokens 20-100x the mean, nearly dense ones among them
        (4096, 0.0, 256),  # no heavy token: the reserved rows stay unused
    ],
)
def test_direct_route_heavy_tokens_through_dense_rows(m, sigma, capacity, walk):
    """Heavy tokens through the dense GEMMs up to the reserved rows, the others split over warps: y within the
    reference tolerance, l0 / fired / l1 as the sparse walk gives them, and the residual added as the two unfused
    bf16 steps (bit for bit where every heavy token fits the rows)."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=28, sigma=sigma, seed=m + capacity + int(10 * sigma))
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    heavy = heavy_token_count(gate_MN)
    if sigma > 0:
        assert heavy > (64 if capacity == 64 else 0), f"this case is meant to have heavy tokens ({heavy})"
    sparse = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, walk=walk)
    poison(((m, 2048), torch.bfloat16), ((m,), torch.float32), ((m,), torch.int32), ((capacity, 5632), torch.bfloat16))
    y_MK, l1_M, l0_M, fired_N = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, walk=walk, dense_rows=capacity)
    torch.cuda.synchronize()
    assert_close_to_ref(y_MK, *block)
    # l0 and fired count the bf16 h of the dense rows, the fp32 h of the walk: a tiny h may round to zero
    assert (l0_M - sparse[2]).abs().max() <= 1 and (fired_N != sparse[3]).sum() <= 2
    torch.testing.assert_close(l1_M, sparse[1], rtol=2e-2, atol=1e-3)
    residual_MK = torch.randn(m, 2048, device="cuda").bfloat16()
    poison(((m, 2048), torch.bfloat16))
    with_residual = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, residual_MK=residual_MK, walk=walk, dense_rows=capacity)
    if capacity >= heavy:
        assert torch.equal(with_residual[0], residual_MK + y_MK)
    else:  # which heavy tokens get the dense rows follows the order they were listed in, which varies by call
        expected_MK = (residual_MK + y_MK).float()
        scale_MK = expected_MK.abs() + y_MK.float().abs().amax(dim=1, keepdim=True)  # the row's largest output
        assert ((with_residual[0].float() - expected_MK).abs() <= 2**-6 * scale_MK).all()


def assert_is_rms_norm_of(normed_MK: torch.Tensor, y_MK: torch.Tensor, weight_K: torch.Tensor, eps: float) -> None:
    """normed_MK is F.rms_norm of the stored rows y_MK: within one bf16 rounding of it everywhere (the kernels sum the
    squares in another order, so rstd may differ in its last fp32 bits), the same bits nearly everywhere."""
    want_MK = F.rms_norm(y_MK, (y_MK.shape[1],), weight_K, eps)
    assert not normed_MK.isnan().any(), "a row was left unwritten"
    torch.testing.assert_close(normed_MK, want_MK, rtol=2**-7, atol=1e-30)
    same = (normed_MK == want_MK).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the normed values have F.rms_norm's bits"


@pytest.mark.parametrize(
    "m, k, sigma, capacity, parts, residual",
    [
        (
            4096,
            2048,
            0.5,
            256,
            1,
            True,
        ),  # light tokens; heavy ones through the dense rows and past them split over warps
        (4096, 2048, 0.5, 0, 1, False),  # heavy tokens split over warps; no residual
        (4096, 2048, 0.0, 0, 2, True),  # two column parts: the last one writes the norm
        (300, 2048, 0.5, 0, 1, True),  # below SPLIT_BELOW_M every token is split over warps
        (2048, 4096, 0.5, 512, 1, True),  # 16 pieces a lane
    ],
)
def test_rows_walk_writes_the_rms_norm_of_its_rows(m, k, sigma, capacity, parts, residual):
    """With an OutputNorm the rows walk writes F.rms_norm of every stored y row (light, split and dense-row tokens),
    and y stays exact."""
    block = synthetic_block(m, k, 5632, nnz_mean=28, sigma=sigma, seed=7 * m + k)
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    gate_MN = F.linear(x_MK, w_gate_NK)
    if sigma > 0 and m >= 2048:
        assert heavy_token_count(gate_MN) > capacity / 4, "this case is meant to have heavy tokens"
    residual_MK = torch.randn(m, k, device="cuda").bfloat16() if residual else None
    weight_K = (1 + 0.2 * torch.randn(k, device="cuda")).bfloat16()
    norm = infer_launch.OutputNorm(weight_K, 1e-5, torch.full((m, k), math.nan, device="cuda").bfloat16())
    w_t = w_down_KN.t().contiguous()
    y_MK, *_ = direct_up_down(
        x_MK, gate_MN, w_up_NK, w_t, residual_MK=residual_MK, parts=parts, dense_rows=capacity, norm=norm
    )
    assert_is_rms_norm_of(norm.out_MK, y_MK, weight_K, 1e-5)
    plain_MK = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, parts=parts, dense_rows=capacity)[0]
    assert_close_to_ref(plain_MK, *block)
    # y as without the norm: the same bits but where heavy tokens outnumber the dense rows (which of them get the
    # rows follows the order they were listed in, which varies by call)
    expected_MK = (plain_MK if residual_MK is None else residual_MK + plain_MK).float()
    scale_MK = expected_MK.abs() + plain_MK.float().abs().amax(dim=1, keepdim=True)  # the row's largest output
    assert ((y_MK.float() - expected_MK).abs() <= 2**-6 * scale_MK).all()


def test_block_op_writes_the_output_norm_only_from_the_rows_walk(monkeypatch):
    """twell_gated_mlp's output_norm: the rows walk writes it (normed_MK), the slices walk and a residual the kernels
    cannot add leave it to the caller (None), and y is the same with and without it."""
    monkeypatch.setenv("SPARSE_LLM_TWELL_WALK", "priced")
    block = synthetic_block(8192, 2048, 5632, nnz_mean=28, seed=3)
    x_MK = block[0]
    residual_MK = torch.randn_like(x_MK)
    weight_K = (1 + 0.2 * torch.randn(2048, device="cuda")).bfloat16()
    for hint, walk in (((28.0, 1000.0), "rows"), ((28.0, 52.0), "slices")):
        assert direct_walk(8192, 2048, 5632, hint) == walk
        plain = twell_gated_mlp(*block, residual_MK=residual_MK, l0_hint=hint)
        result = twell_gated_mlp(*block, residual_MK=residual_MK, l0_hint=hint, output_norm=(weight_K, 1e-6))
        assert torch.equal(result.y_MK, plain.y_MK) and plain.normed_MK is None
        if walk == "rows":
            assert_is_rms_norm_of(result.normed_MK, result.y_MK, weight_K, 1e-6)
        else:
            assert result.normed_MK is None
    unfused = twell_gated_mlp(
        *block, residual_MK=residual_MK.float(), l0_hint=(28.0, 1000.0), output_norm=(weight_K, 1e-6)
    )
    assert unfused.normed_MK is None  # the residual is added after the kernels: their rows are not the output's


def test_block_op_reserves_dense_rows_from_the_density_hint():
    """twell_gated_mlp with a heavy-tailed layer's density (as a layer observes it) computes its heavy tokens by dense
    GEMMs, without a host sync; the result stays exact."""
    m = 8192
    block = synthetic_block(m, 2048, 5632, nnz_mean=28, sigma=0.5, seed=41)
    plain = twell_gated_mlp(*block)
    l0_mean, l0_max, tail = density_of(plain.l0_M)
    heavy = int((plain.l0_M > 128).sum())
    assert heavy > 0 and cost_model.dense_row_capacity(m, (l0_mean, l0_max), tail=tail) >= heavy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        poison(((m, 2048), torch.bfloat16))
        hinted = twell_gated_mlp(*block, l0_hint=(l0_mean, l0_max), tail=tail)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_ref(hinted.y_MK, *block)
    check_stats(hinted, *block[:3])


def odd_rows(x_MK: torch.Tensor, w_gate_NK: torch.Tensor) -> None:
    """Every fifth token almost fully dense, the next one all zero, neuron 123 firing for (almost) every token."""
    x_MK[::5, 0] = -1.0  # flips the shift: ~99.5% of the gate positive
    x_MK[1::5] = 0.0  # the gate is exactly 0: nothing is positive
    w_gate_NK[123, 0] = 10.0


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 40, 64])
@pytest.mark.parametrize(
    "k, n, nnz, sigma",
    [
        (2048, 5632, 28, 0.0),
        (2048, 5632, 56, 1.0),
        (4096, 11008, 40, 0.5),
        (64, 256, 3, 0.3),
        (320, 768, 8, 0.0),
    ],
)
def test_decode_kernel_for_few_tokens(m, k, n, nnz, sigma):
    """Up to DECODE_MAX_M tokens "auto" takes the one-pass decode kernel, in groups of DECODE_GROUP_M tokens from 17:
    exact at any density, heavy tails too."""
    block = synthetic_block(m, k, n, nnz_mean=nnz, sigma=sigma, seed=m + k + nnz)
    poison(((2 * m + n,), torch.int32))  # l1, l0 and the flags: all written
    result = run_case(*block)
    assert result.path == "twell-decode" and result.overflow_rows == 0
    assert not decode_workspace(block[0].device, k).any()  # left zeroed for the next call


def test_decode_workspace_is_left_zeroed_across_sizes_and_streams():
    """Calls of 16 tokens, then fewer and more (groups), on the default stream and on a side stream (a workspace each),
    heavy tokens with block sums and without: every call matches the reference, so none saw an earlier call's sums, and
    both workspaces end zeroed."""
    side = torch.cuda.Stream()
    k, n = 2048, 5632
    for seed, m in enumerate((16, 3, 64, 1, 33, 9)):
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(m, k, n, nnz_mean=60, sigma=1.0, seed=seed)
                l0_hint = (60.0, 1000.0 if seed % 2 else 100.0)  # block sums where the tokens fit shared memory, or not
                result = twell_gated_mlp(x_MK, w_gate_NK, w_up_NK, w_down_KN, l0_hint=l0_hint)
            torch.cuda.synchronize()
            assert result.path == "twell-decode"
            assert_close_to_ref(result.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)
            check_stats(result, x_MK, w_gate_NK, w_up_NK)
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert not decode_workspace(x_MK.device, k).any()


@pytest.mark.parametrize("m", [1, 7, 16, 40])
@pytest.mark.parametrize("block_sums", [True, False])
@pytest.mark.parametrize("mma_gate", [True, False])
def test_decode_kernel_dense_zero_and_hot_rows(m, block_sums, mma_gate, monkeypatch):
    """Dense, all-zero and hot rows, each block's sums in shared memory (up to DECODE_BLOCK_SUM_PIECES) or not, the
    gates on the tensor cores or not (always for groups of tokens, as at 40)."""
    monkeypatch.setattr(cost_model, "DECODE_BLOCK_SUM_PIECES", 1 << 30 if block_sums else 0)
    monkeypatch.setattr(cost_model, "DECODE_MMA_MIN_M", 1 if mma_gate else 1 << 30)
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(m, 2048, 5632, nnz_mean=28, seed=11 * m)
    odd_rows(x_MK, w_gate_NK)  # a fully dense token fires almost every neuron: every row pair is read
    result = run_case(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    assert result.path == "twell-decode" and bool(result.fired_N[123]) == (m > 2)  # it fires for tokens 2, 3, 4, ...
    assert (result.l0_M[1::5] == 0).all() and result.l0_M[0] > 5000


@pytest.mark.parametrize("m", [9, 40])
def test_decode_kernel_residual_statistics_and_graph_capture(m):
    """The residual is added as adding it after; without statistics y stays; no host sync; a CUDA graph replays it on
    new inputs, on another stream too. (Its fp32 sums are added by atomics, in an order that varies: compared within a
    bf16 rounding.) At 40 tokens, three groups of blocks."""
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block = synthetic_block(m, 2048, 5632, nnz_mean=40, sigma=0.5, seed=2)
    residual_MK = torch.randn(m, 2048, device="cuda").bfloat16()
    plain = twell_gated_mlp(*block)
    fused = twell_gated_mlp(*block, residual_MK=residual_MK)
    torch.testing.assert_close(fused.y_MK, residual_MK + plain.y_MK, rtol=2**-7, atol=1e-3)
    assert torch.equal(fused.l0_M, plain.l0_M) and torch.equal(fused.fired_N, plain.fired_N)
    bare = twell_gated_mlp(*block, statistics=False)
    assert bare.l1_sum is None and bare.fired_N is None and bare.l0_M is None  # as the dense block's
    torch.testing.assert_close(bare.y_MK, plain.y_MK, rtol=2**-7, atol=1e-3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        twell_gated_mlp(*block, statistics=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = twell_gated_mlp(*block, statistics=False)
        with_stats = twell_gated_mlp(*block, residual_MK=residual_MK)
    x_MK.copy_(x_MK.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(captured.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)
    check_stats(with_stats, x_MK, w_gate_NK, w_up_NK)
    torch.testing.assert_close(with_stats.y_MK, residual_MK + captured.y_MK, rtol=2**-7, atol=1e-3)
    x_MK.copy_(x_MK.flip(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(captured.y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)


@pytest.mark.parametrize(
    "m, k, n, nnz, sigma",
    [
        (1, 2048, 5632, 28, 0.0),  # fewer tokens than a warp item
        (33, 256, 512, 5, 0.0),  # a 32-token item and a one-token one
        (1000, 2048, 5632, 28, 0.5),  # heavy tokens on the split kernel, the rest on the slices
        (4099, 2048, 5632, 56, 0.0),
        (8192, 2048, 5632, 60, 1.0),  # tokens 20-100x the mean
        (4096, 1024, 11264, 40, 0.3),  # 8-column slices
        (2048, 4096, 14336, 20, 0.0),  # the widest slice (229 KiB of shared memory)
    ],
)
def test_slices_walk_matches_reference(m, k, n, nnz, sigma):
    """The "slices" walk: y within the reference tolerance (h rounds to bf16 between its kernels, as dense bf16 rounds
    it), and the same l0 and fired as the "rows" walk (l1 within fp32 rounding: the sums run in another order)."""
    block = synthetic_block(m, k, n, nnz_mean=nnz, sigma=sigma, seed=m + k + n)
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    rows = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, walk="rows")
    poison(((m, k), torch.bfloat16), ((m,), torch.float32), ((m,), torch.int32))
    y_MK, l1_M, l0_M, fired_N = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, walk="slices")
    torch.cuda.synchronize()
    assert_close_to_ref(y_MK, *block)
    assert torch.equal(l0_M, rows[2]) and torch.equal(fired_N, rows[3])
    assert torch.allclose(l1_M, rows[1], rtol=1e-5, atol=1e-6)
    if sigma >= 0.5:
        assert l0_M.max() > 128, "this case is meant to have tokens on the split path"


@pytest.mark.parametrize("m", [7, 4096])
def test_slices_walk_dense_zero_and_hot_rows(m):
    """Fully dense tokens (split over warps), all-zero tokens and a neuron firing for every token, through the slices
    walk with and without a residual (added as the two unfused bf16 steps)."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=28, seed=9 * m)
    odd_rows(block[0], block[1])
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    gate_MN = F.linear(x_MK, w_gate_NK)
    w_t = w_down_KN.t().contiguous()
    residual_MK = torch.randn(m, 2048, device="cuda").bfloat16()
    poison(((m, 2048), torch.bfloat16))
    y_MK, _, l0_M, fired_N = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, walk="slices")
    assert_close_to_ref(y_MK, *block)
    assert bool(fired_N[123]) and (l0_M[1::5] == 0).all() and (l0_M[::5] > 128).all()
    poison(((m, 2048), torch.bfloat16))
    with_residual_MK = direct_up_down(x_MK, gate_MN, w_up_NK, w_t, residual_MK=residual_MK, walk="slices")[0]
    assert torch.equal(with_residual_MK, residual_MK + y_MK)


def walk_from_fused_gate(block, walk, residual_MK=None, dense_rows=0, parts=None):
    """A walk listing from the fused GEMM's TwELL words (as the block op runs it; the "rows" walk in `parts` column
    parts), with the heavy tokens' gate buffer poisoned: a row its dense paths read that was not written would give
    NaN."""
    x_MK, w_gate_NK, w_up_NK, w_down_KN = block
    (m, k), n = x_MK.shape, w_gate_NK.shape[0]
    gate_MN = torch.full((m, n), float("nan"), device="cuda").bfloat16()
    packed_MS = twell_gate(x_MK, w_gate_NK, overflow_gate_MN=gate_MN)
    poison(((m, k), torch.bfloat16))
    columns = None if parts is None else cost_model.column_parts(k, n, parts)
    outs = infer_launch.launch_direct_up_down(
        x_MK,
        gate_MN,
        w_up_NK,
        w_down_KN.t().contiguous(),
        cost_model.DENSE_ROW_NNZ,
        residual_MK,
        columns,
        walk=walk,
        dense_rows=dense_rows,
        packed_MS=packed_MS,
    )
    torch.cuda.synchronize()
    return outs, packed_MS


@pytest.mark.parametrize("walk", ["rows", "slices"])
@pytest.mark.parametrize(
    "m, k, n, nnz, sigma, dense_rows, parts",
    [
        (1, 2048, 5632, 28, 0.0, 0, None),
        (33, 256, 512, 5, 0.0, 0, None),
        (1000, 2048, 5632, 28, 0.5, 0, None),  # heavy tokens split over warps
        (4099, 2048, 5632, 56, 0.0, 0, None),
        (8192, 2048, 5632, 60, 1.0, 0, None),  # overflowed segments
        (8192, 2048, 5632, 60, 1.0, 256, None),  # the first 256 heavy tokens through dense rows
        (4096, 1024, 11264, 40, 0.3, 0, None),  # 8-column slices
        (2048, 4096, 14336, 20, 0.0, 0, None),  # rows: two column parts (the weights outgrow L2)
        (3000, 2048, 5632, 50, 1.0, 0, 3),  # rows: three column parts, heavy tokens' rows completed part by part
    ],
)
def test_walks_from_the_fused_gate_words(walk, m, k, n, nnz, sigma, dense_rows, parts):
    """Either walk from TwELL words: y within the reference tolerance, l0, l1 and fired as the reference's (up to sign
    flips of near-zero gates: the fused GEMM rounds apart from cuBLAS), heavy tokens exact on either path."""
    block = synthetic_block(m, k, n, nnz_mean=nnz, sigma=sigma, seed=m + k + n + dense_rows)
    (y_MK, l1_M, l0_M, fired_N), packed_MS = walk_from_fused_gate(block, walk, dense_rows=dense_rows, parts=parts)
    assert_close_to_ref(y_MK, *block)
    check_stats(FFNResult(y_MK, l1_M.sum(), l0_M, fired_N.bool(), "twell-direct"), *block[:3])
    if sigma >= 1.0:
        counts_MT = packed_MS.view(m, n // 256, 32)[:, :, 0]
        assert (counts_MT > 31).any(), "this case is meant to have overflowed segments"


@pytest.mark.parametrize("walk", ["rows", "slices"])
@pytest.mark.parametrize("m", [7, 4096])
def test_walks_from_the_fused_gate_words_dense_zero_and_hot_rows(walk, m):
    """Fully dense tokens (every segment overflowed), all-zero tokens and a neuron firing for every token, with and
    without a residual (added as the two unfused bf16 steps)."""
    block = synthetic_block(m, 2048, 5632, nnz_mean=28, seed=11 * m)
    odd_rows(block[0], block[1])
    residual_MK = torch.randn(m, 2048, device="cuda").bfloat16()
    (y_MK, _, l0_M, fired_N), _ = walk_from_fused_gate(block, walk)
    assert_close_to_ref(y_MK, *block)
    assert bool(fired_N[123]) and (l0_M[1::5] == 0).all() and (l0_M[::5] > 128).all()
    with_residual_MK = walk_from_fused_gate(block, walk, residual_MK=residual_MK)[0][0]
    assert torch.equal(with_residual_MK, residual_MK + y_MK)


def test_block_op_takes_the_walk_its_density_hint_prices_cheaper(monkeypatch):
    """twell_gated_mlp with the layer's (mean, max) non-zeros, the price trusted: slices for an even spread at many
    tokens (exact), rows without a hint or with a heavy tail; every walk gives the same l0 and fired."""
    monkeypatch.setenv(infer_op.WALK_CHOICE_ENV, "priced")
    block = synthetic_block(8192, 2048, 5632, nnz_mean=28, seed=31)
    m, k, n = 8192, 2048, 5632
    plain = twell_gated_mlp(*block)
    l0 = (plain.l0_M.float().mean().item(), plain.l0_M.max().item())
    assert direct_walk(m, k, n, None) == "rows" and direct_walk(m, k, n, l0) == "slices"
    assert direct_walk(m, k, n, (28.0, 1500.0)) == "rows"
    poison(((m, k), torch.bfloat16))
    hinted = twell_gated_mlp(*block, l0_hint=l0)
    assert_close_to_ref(hinted.y_MK, *block)
    assert torch.equal(hinted.l0_M, plain.l0_M) and torch.equal(hinted.fired_N, plain.fired_N)
    assert hinted.path == "twell-slices" and plain.path == "twell-direct"


def test_block_op_without_statistics_gives_the_same_output_and_l0():
    """statistics=False leaves out the L1 sum and the fired flags (their extra kernels), nothing else."""
    block = synthetic_block(2048, 2048, 5632, nnz_mean=40, sigma=0.5, seed=47)
    full = twell_gated_mlp(*block, gate_route="direct")
    lean = twell_gated_mlp(*block, gate_route="direct", statistics=False)
    assert lean.l1_sum is None and lean.fired_N is None and full.l1_sum is not None and full.fired_N is not None
    assert torch.equal(lean.y_MK, full.y_MK) and torch.equal(lean.l0_M, full.l0_M) and lean.path == full.path


@pytest.mark.parametrize("slow", ["rows", "slices"])
def test_measured_walk_keeps_the_faster_walk(monkeypatch, slow):
    """A trial times both walks on the device and keeps the faster for its key; later calls with that key run
    nothing; a walk made slow by extra GPU work loses."""
    monkeypatch.setattr(infer_op, "_measured_walks", {})
    a = torch.randn(4096, 4096, device="cuda")
    calls = []

    def walk_through(walk):
        calls.append(walk)
        for _ in range(20 if walk == slow else 1):
            a @ a

    fast = "slices" if slow == "rows" else "rows"
    assert measured_walk((1, 2, 3, 4), walk_through) == fast
    assert calls.count("rows") == calls.count("slices") == 1 + infer_op.WALK_TRIAL_REPS
    calls.clear()
    assert measured_walk((1, 2, 3, 4), walk_through) == fast and calls == []


def test_block_op_measures_the_walk_where_slices_are_priced_ahead(monkeypatch):
    """With a hint that prices slices ahead, the block op runs the walk its trial found faster (here made rows by
    slowing the slices walk), exactly, and remembers it for the shape and density."""
    monkeypatch.delenv(infer_op.WALK_CHOICE_ENV, raising=False)  # the default: measured
    monkeypatch.setattr(infer_op, "_measured_walks", {})
    block = synthetic_block(8192, 2048, 5632, nnz_mean=28, seed=32)
    plain = twell_gated_mlp(*block)
    l0 = (plain.l0_M.float().mean().item(), plain.l0_M.max().item())
    assert direct_walk(8192, 2048, 5632, l0) == "slices"
    direct = infer_launch.launch_direct_up_down
    spin = torch.randn(4096, 4096, device="cuda")

    def slow_slices(*args, **kwargs):
        if kwargs["walk"] == "slices":
            for _ in range(20):
                spin @ spin
        return direct(*args, **kwargs)

    monkeypatch.setattr(infer_op, "launch_direct_up_down", slow_slices)
    hinted = twell_gated_mlp(*block, l0_hint=l0)
    assert hinted.path == "twell-direct" and list(infer_op._measured_walks.values()) == ["rows"]
    assert torch.equal(hinted.y_MK, plain.y_MK) and torch.equal(hinted.l0_M, plain.l0_M)


@pytest.mark.parametrize("m, k", [(17, 2048), (4096, 2048), (4096, 4096)])
def test_residual_is_added_as_adding_it_after(m, k):
    """The decoder layer's residual add folded into the block: the same bits as residual + y (the direct kernels
    add it as they store y: at 17 tokens every token is split over warps, at 4096 most take one warp; other dtypes
    add it after; at K = 4096 the one-warp kernel needs more than 48 KiB of shared memory)."""
    block = synthetic_block(m, k, 5632, nnz_mean=28, sigma=0.5, seed=m + 3)
    residual_MK = torch.randn(m, k, device="cuda").bfloat16()
    plain = twell_gated_mlp(*block, gate_route="direct")
    poison(((m, k), torch.bfloat16))
    fused = twell_gated_mlp(*block, gate_route="direct", residual_MK=residual_MK)
    assert torch.equal(fused.y_MK, residual_MK + plain.y_MK)
    assert torch.equal(fused.l0_M, plain.l0_M) and torch.equal(fused.fired_N, plain.fired_N)
    fp32 = twell_gated_mlp(*block, gate_route="direct", residual_MK=residual_MK.float())
    assert fp32.y_MK.dtype == torch.float32 and torch.equal(fp32.y_MK, residual_MK.float() + plain.y_MK)
    with pytest.raises(ValueError, match="residual_MK has shape"):
        twell_gated_mlp(*block, gate_route="direct", residual_MK=residual_MK[:-1])


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


@pytest.mark.parametrize(
    "dtype, out_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("rows,cols", [(32, 32), (64, 256), (2048, 5632), (96, 4096)])
def test_transpose_kernel_is_exact(rows, cols, dtype, out_dtype):
    src = torch.randn(rows, cols, device="cuda", dtype=dtype)
    got = transposed_copy(src, out_dtype)
    assert got.shape == (cols, rows) and got.dtype == out_dtype and got.is_contiguous()
    assert torch.equal(got, src.t().to(out_dtype))
    view = transposed_copy(src[:, : cols // 2], out_dtype)  # a non-contiguous input is copied first
    assert torch.equal(view, src[:, : cols // 2].t().to(out_dtype))


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


def test_auto_layer_settles_close_prices_by_a_trial(monkeypatch):
    """Where the prices are close (here: any prices), an `auto` layer times both paths once on its call and keeps the
    faster for that token count and density; its output is the block's either way."""
    from sparse_llm.ffn import dispatch
    from sparse_llm.ffn.mlp import SparseMLP

    monkeypatch.setattr(dispatch, "TRIAL_BAND", 1e9)
    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(4096, 2048, 5632, nnz_mean=80, sigma=0.3, seed=11)
    mlp = SparseMLP(2048, 5632, kernel="auto").to("cuda", torch.bfloat16)
    with torch.no_grad():
        for linear, w in ((mlp.gate_proj, w_gate_NK), (mlp.up_proj, w_up_NK), (mlp.down_proj, w_down_KN)):
            linear.weight.copy_(w)
        mlp.dispatcher.observe(*density_of((F.linear(x_MK, w_gate_NK) > 0).sum(dim=1)))
        y_MK = mlp(x_MK)
        assert list(mlp.dispatcher.trials.values()) in (["torch"], ["twell"])
        assert mlp.dispatcher.current == next(iter(mlp.dispatcher.trials.values()))
        assert_close_to_ref(y_MK, x_MK, w_gate_NK, w_up_NK, w_down_KN)
        mlp(x_MK)
    assert len(mlp.dispatcher.trials) == 1


def test_auto_layer_trials_host_bound_calls_but_prices_graphed_ones():
    """A decoding step's few tokens issued from Python run at the host's pace on either path, so an `auto` layer times
    both paths once per token count (keyed apart from graphed calls); inside `cuda_graphed` (a CUDA graph's capture
    and its warm-up step) the device prices decide and no trial runs. The output is the block's either way."""
    from sparse_llm.ffn.mlp import SparseMLP, cuda_graphed

    x_MK, w_gate_NK, w_up_NK, w_down_KN = synthetic_block(4, 2048, 5632, nnz_mean=28, seed=12)
    mlp = SparseMLP(2048, 5632, kernel="auto").to("cuda", torch.bfloat16)
    with torch.no_grad():
        for linear, w in ((mlp.gate_proj, w_gate_NK), (mlp.up_proj, w_up_NK), (mlp.down_proj, w_down_KN)):
            linear.weight.copy_(w)
        mlp.dispatcher.observe(*density_of((F.linear(x_MK, w_gate_NK) > 0).sum(dim=1)))
        with cuda_graphed(mlp):
            graphed_y_MK = mlp(x_MK)
        assert mlp.dispatcher.trials == {}  # the prices chose
        assert mlp.dispatcher.current == "twell"  # the decode kernel's device time is below the dense block's
        y_MK = mlp(x_MK)
        ((host_bound, _, _), choice), *more = mlp.dispatcher.trials.items()
        assert host_bound and not more and choice in ("torch", "twell")
        assert mlp.dispatcher.current == choice
    for y in (graphed_y_MK, y_MK):
        assert_close_to_ref(y, x_MK, w_gate_NK, w_up_NK, w_down_KN)
