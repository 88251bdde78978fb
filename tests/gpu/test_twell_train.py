"""Sparse training op (sparse_llm.ffn.twell.train_op) on the GPU vs torch autograd on the dense block.

Needs an sm_90 GPU and cupy. Forward output y, L1, L0, fired neurons and the four gradients (x, w_gate,
w_up, w_down) of loss = <y, dy> + dl1 * sum|h> are compared with an fp32 dense reference; the budget is
twice the error of the dense bf16 torch path against the same reference, plus a small atol (docs/design.md
"Conventions"; a bf16-roundoff floor for tiny tensors), globally and per token for y. Buffers the op allocates
are poisoned first (the caching allocator hands NaN / 0xFF-filled blocks back), so an element left unwritten
or a padding slot read by mistake shows up. Densities: uniform, heavy-tailed, fully dense and all-zero
tokens, a hot neuron, ELL-width overflow, TwELL-tile overflow, most tokens in the backup, general shapes and
more than 65536 tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_llm.ffn.twell import cost_model, csc, train_backward
from sparse_llm.ffn.twell.cost_model import column_parts
from sparse_llm.ffn.twell.csc import (
    csc_chunk_columns,
    csc_chunk_starts,
    csc_index,
    csc_key_dtype,
    csc_keys,
    csc_order,
    csc_shared_ranks,
    csc_weight_gradients,
    wgrad_scratch,
)
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_backward import backup_backward, backup_pointwise
from sparse_llm.ffn.twell.train_launch import STATE_NAMES, heavy_rows
from sparse_llm.ffn.twell.train_op import twell_train_ffn, twell_train_forward_op
from sparse_llm.formats import (
    hybrid_gated_mlp_backward_ref,
    hybrid_gated_mlp_forward_ref,
    hybrid_sddmm,
    hybrid_t_matmul,
    pack_hybrid,
)

ATOL = 1e-3
BF16_EPS = 2.0**-8  # unit roundoff of bf16
DL1 = 0.3  # comparable to the dy term's dh (std ~ sqrt(K/N)), so the L1 gradient is exercised


def poison(m: int, k: int, n: int, width: int) -> None:
    """Fill and free blocks of the op's buffer sizes so its next allocations of those sizes hold garbage."""
    shapes = [
        ((m, k), torch.bfloat16),
        ((m, width), torch.int32),
        ((m, width), torch.bfloat16),
        ((3, m, width), torch.bfloat16),
        ((m,), torch.int32),
        ((m,), torch.float32),
        ((m,), torch.int64),
    ]
    blocks = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes]
    for block in blocks:
        block.view(torch.uint8).fill_(0xFF)
    del blocks


def dense_run(x, wg, wu, wd, dy, dl1, upcast: bool):
    """Dense autograd: (y, l1_sum, h, grads); fp32 from the bf16 inputs when upcast, else bf16 like training."""
    leaves = [(t.float() if upcast else t).detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    xl, wgl, wul, wdl = leaves
    h = F.relu(F.linear(xl, wgl)) * F.linear(xl, wul)
    y = F.linear(h, wdl)
    l1 = h.float().abs().sum()
    ((y.float() * dy).sum() + dl1 * l1).backward()
    return y.detach(), l1.detach(), h.detach(), [t.grad for t in leaves]


def ours_run(x, wg, wu, wd, dy, dl1, width, dense_rows=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    poison(x.shape[0], x.shape[1], wg.shape[0], width)
    result = twell_train_ffn(*leaves, width=width, dense_rows=dense_rows)
    ((result.y_MK.float() * dy).sum() + dl1 * result.l1_sum).backward()
    torch.cuda.synchronize()
    return result, [t.grad for t in leaves]


def assert_budget(name: str, got: torch.Tensor, ref: torch.Tensor, dense: torch.Tensor, per_row: bool) -> None:
    """||got - ref|| <= 2 ||dense - ref|| + ATOL (1 + ||ref||) + floor, globally and (per_row) per token.

    floor = one bf16 unit roundoff of ||ref|| / sqrt(rows): with a handful of rows (decode-sized M) the
    error is a few rounding events and the dense error a noisy estimate of that level (measured on the
    torch reference path: up to 3.2x the dense error at M = 1, <= 0.75x from M = 129); it vanishes
    for large tensors.
    """
    assert not torch.isnan(got).any(), f"{name} has NaN: an element was not written or garbage was read"
    got, dense = got.float(), dense.float()
    err, dense_err, scale = (got - ref).norm(), (dense - ref).norm(), ref.norm()
    floor = BF16_EPS * scale / got.shape[0] ** 0.5
    assert err <= 2 * dense_err + ATOL * (1 + scale) + floor, (
        f"{name}: error {err.item():.3e} vs dense bf16 {dense_err.item():.3e} (|ref| {scale.item():.3e})"
    )
    if per_row:
        err_M, dense_M, ref_M = (got - ref).norm(dim=1), (dense - ref).norm(dim=1), ref.norm(dim=1)
        rel = (dense_err / scale.clamp_min(1e-30)).item()
        budget_M = 2 * torch.maximum(dense_M, rel * ref_M) + ATOL * (1 + ref_M)
        bad = (err_M > budget_M).nonzero()[:, 0]
        assert bad.numel() == 0, (
            f"{name}: tokens {bad[:10].tolist()} off: {err_M[bad[:5]].tolist()} > {budget_M[bad[:5]].tolist()}"
        )


def check_case(x, wg, wu, wd, width: int = 128, dl1: float = DL1, seed: int = 0, dense_rows: int | None = None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(x.shape, device="cuda", generator=gen).bfloat16().float()
    result, grads = ours_run(x, wg, wu, wd, dy, dl1, width, dense_rows)
    y_ref, l1_ref, h_ref, grads_ref = dense_run(x, wg, wu, wd, dy, dl1, upcast=True)
    y_dense, l1_dense, _, grads_dense = dense_run(x, wg, wu, wd, dy, dl1, upcast=False)

    assert_budget("y", result.y_MK, y_ref, y_dense, per_row=True)
    for name, got, ref, dense in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, grads_ref, grads_dense):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert_budget(name, got, ref, dense, per_row=False)
    assert (
        abs(result.l1_sum.item() - l1_ref.item())
        <= 2 * abs(l1_dense.item() - l1_ref.item()) + 1e-3 * l1_ref.item() + 1e-3
    )
    l0_ref = (h_ref != 0).sum(dim=1)
    diff_M = (result.l0_M.long() - l0_ref).abs()  # a near-zero gate may flip sign between bf16 and fp32
    assert diff_M.max() <= 2 and diff_M.sum() <= 1e-3 * l0_ref.sum() + 2, f"l0 off by up to {diff_M.max()}"
    fired_ref = (h_ref != 0).any(dim=0)
    assert result.fired_N.dtype == torch.bool and (result.fired_N != fired_ref).sum() <= 2 + 1e-3 * fired_ref.numel()
    return result


# ---------------------------------------------------------------- densities


@pytest.mark.parametrize("m, nnz", [(4096, 28), (4096, 56), (4096, 112), (16384, 56), (300, 280)])
def test_uniform_density(m, nnz):
    check_case(*synthetic_block(m, 2048, 5632, nnz, seed=m + nnz))


@pytest.mark.parametrize("sigma", [0.3, 0.5, 1.0])
def test_heavy_tailed(sigma):
    """Tokens above the ELL width take the backup rows; all exact."""
    block = synthetic_block(4096, 2048, 5632, 60, sigma=sigma, seed=int(10 * sigma))
    result = check_case(*block)
    if sigma >= 0.5:
        assert result.dense_rows() > 0 and result.path == "twell-train"


@pytest.mark.parametrize("dense_rows", [16, 4096])
def test_heavy_tokens_through_dense_rows(dense_rows):
    """The forward's first heavy tokens through dense GEMMs over their gathered rows, fewer rows than heavy tokens
    (the rest split over warps) and more than enough: exact either way."""
    result = check_case(*synthetic_block(4096, 2048, 5632, 60, sigma=1.0, seed=10), dense_rows=dense_rows)
    assert result.dense_rows() > 16


def test_dense_zero_and_hot_rows():
    x, wg, wu, wd = synthetic_block(2048, 2048, 5632, 28, seed=5)
    x[::5, 0] = -1.0  # flips the shift: ~99.5% of the gate positive, fully dense tokens
    x[1::5] = 0.0  # all-zero tokens: nothing fires
    wg[123, 0] = 10.0  # neuron 123 fires for (almost) every token: a CSC column of ~M entries, many chunks
    result = check_case(x, wg, wu, wd)
    assert result.dense_rows() >= len(range(0, 2048, 5))
    assert (result.l0_M[1::5] == 0).all() and bool(result.fired_N[123])


def test_backup_grads_kernel_matches_the_torch_steps():
    """train_backup_grads (the heavy tokens' pointwise step) against the torch ops it replaces, bit for bit:
    gates at, below and above zero, a NaN gate (relu passes it on), and an L1 gradient on every non-zero h."""
    r, n = 37, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    gate, up, dhd = (torch.randn(r, n, device="cuda", generator=gen).bfloat16() for _ in range(3))
    gate[:, ::7] = 0.0
    gate[5, 11] = float("nan")
    up[:, ::13] = 0.0  # h = 0 where the gate fires: no L1 term there
    dl1 = torch.tensor([DL1], device="cuda")
    g = F.relu(gate)
    u = torch.where(g != 0, up, 0)
    h = g * u
    dh = (torch.where(g != 0, dhd, 0).float() + dl1 * h.float().sign()).bfloat16()
    expected = (dh * u, dh * g, h)  # dg, du, h
    outs = [t.clone() for t in (gate, up, dhd)]  # rewritten in place
    backup_pointwise(*outs, dl1)
    for name, got, want in zip(("dg", "du", "h"), outs, expected):
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), name


def test_backup_backward_matches_the_reference():
    """The heavy tokens' backward (cuBLAS GEMMs around train_backup_grads, the weight gradients accumulated in
    fp32 by the GEMMs) against formats' hybrid reference on the same bf16 inputs, every token heavy (width 1),
    an all-zero token among them; the weight gradients are added to what the buffers held."""
    m, k, n = 48, 256, 512
    gen = torch.Generator(device="cuda").manual_seed(4)
    x, wg, wu, dy = (torch.randn(s, device="cuda", generator=gen).bfloat16() for s in ((m, k), (n, k), (n, k), (m, k)))
    wd = (torch.randn(k, n, device="cuda", generator=gen) / n**0.5).bfloat16()
    wg, wu = wg / k**0.5, wu / k**0.5
    x[5] = 0.0
    ref = hybrid_gated_mlp_forward_ref(x, wg, wu, wd, width=1)
    rows = ref.saved.g.heavy_M.nonzero()[:, 0]
    assert rows.numel() >= m - 1
    want = hybrid_gated_mlp_backward_ref(x, wg, wu, wd, ref.saved, dy, DL1)
    dx = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    before = torch.randn(3, n, k, device="cuda", generator=gen)
    dws = list(before.clone().unbind(0))
    backup_backward(x, wg, wu, wd, rows, dy, torch.tensor([DL1], device="cuda"), dx, *dws)
    pairs = [
        ("dx", dx[rows], want.dx_MK[rows]),
        ("dw_gate", dws[0] - before[0], want.dw_gate_NK),
        ("dw_up", dws[1] - before[1], want.dw_up_NK),
        ("dw_down", (dws[2] - before[2]).t(), want.dw_down_KN),
    ]
    for name, got, ref_grad in pairs:
        err = (got.float() - ref_grad.float()).norm() / ref_grad.float().norm()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("width", [1, 16, 512])
def test_ell_width(width):
    """Tokens with more than `width` gate non-zeros are backup rows (width 1: most of them)."""
    block = synthetic_block(2048, 2048, 5632, 40, sigma=0.3, seed=width)
    result = check_case(*block, width=width)
    expected = int((F.linear(block[0].float(), block[1].float()) > 0).sum(dim=1).gt(width).sum())
    # near-zero gates may flip sign between bf16 and fp32
    assert expected - 2 <= result.dense_rows() <= expected + 2
    if width == 1:
        assert expected > 1000


def test_positives_crowded_in_one_tile_stay_light():
    """Neurons 0..63 (one 256-column TwELL tile) fire for about half the tokens: ~32 positives in one tile, more
    than a TwELL segment holds. The training op lists positives from the gate row itself, so with a wide ELL row
    these tokens stay light (sparse) and exact."""
    x, wg, wu, wd = synthetic_block(2048, 2048, 5632, 20, seed=11)
    wg[:64, 0] = 0.0  # no negative shift for these neurons: they fire ~50% of the time
    result = check_case(x, wg, wu, wd, width=512)
    tile0_M = (F.linear(x.float(), wg[:256].float()) > 0).sum(dim=1)
    assert (tile0_M > 32).sum() > 100 and result.dense_rows() == 0


def test_without_l1_gradient():
    check_case(*synthetic_block(1024, 2048, 5632, 56, seed=2), dl1=0.0)


@pytest.mark.parametrize("k, n", [(64, 256), (320, 768), (1024, 2816), (4096, 1024)])
@pytest.mark.parametrize("m", [1, 129, 1000])
def test_general_shapes(m, k, n):
    check_case(*synthetic_block(m, k, n, n * 0.02, sigma=0.3, seed=k + n + m))


@pytest.mark.parametrize("forward_parts, sddmm_parts, dx_parts", [(2, 2, 2), (3, 3, 5)])
def test_walks_in_column_parts_give_the_one_pass_bits(forward_parts, sddmm_parts, dx_parts, monkeypatch):
    """A block whose rows outgrow L2 walks them in column parts (the forward over w_up and w_down, sddmm over w_down,
    dx over w_up and w_gate), y's and dx's fp32 sums carried from part to part. Forced on a small heavy-tailed block
    (backup rows included): y, l1, l0, fired, the saved state and dx bit for bit as in one pass, and every gradient
    within the reference budget (the weight gradients come from the entries sddmm writes part by part, and from the
    sort keys it writes in its first)."""
    block = synthetic_block(2048, 1024, 3072, 40, sigma=0.5, seed=7)
    dy = torch.randn(block[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    dy = dy.bfloat16().float()
    x, wg, wu, wd = block
    one, one_grads = ours_run(*block, dy, DL1, 128)
    saved_one = twell_train_forward_op(x, wg, wu, wd, 128)[4:9]  # ELL columns, counts, heavy flags, g, u
    monkeypatch.setattr(
        cost_model,
        "walk_column_parts",
        lambda k, n: tuple(column_parts(k, n, parts=p) for p in (forward_parts, sddmm_parts, dx_parts)),
    )
    parts, parts_grads = ours_run(*block, dy, DL1, 128)
    assert parts.dense_rows() > 0
    assert torch.equal(parts.y_MK, one.y_MK) and torch.equal(parts.l0_M, one.l0_M)
    assert torch.equal(parts.l1_sum, one.l1_sum) and torch.equal(parts.fired_N, one.fired_N)
    saved_parts = twell_train_forward_op(x, wg, wu, wd, 128)[4:9]
    for name, a, b in zip(STATE_NAMES, saved_parts, saved_one):
        assert torch.equal(a, b), f"saved {name} differs"
    assert torch.equal(parts_grads[0], one_grads[0]), "dx differs between one pass and column parts"
    check_case(*block)


@pytest.fixture
def by_slices(monkeypatch):
    """The training op's y and light dx through the slices walk wherever it fits, at any token count."""
    monkeypatch.setattr(cost_model, "FWD_WALK", "slices")
    monkeypatch.setattr(cost_model, "DX_WALK", "slices")
    monkeypatch.setattr(cost_model, "SLICES_MIN_M", 1)


@pytest.mark.parametrize(
    "m, k, n, nnz, sigma",
    [
        (4096, 2048, 5632, 28, 0.0),
        (4096, 2048, 5632, 56, 0.0),
        (4096, 2048, 5632, 60, 0.5),
        (1000, 1024, 2816, 40, 0.3),
        (129, 320, 768, 15, 0.3),
        (1, 64, 256, 5, 0.0),
    ],
)
def test_walks_by_slices(m, k, n, nnz, sigma, by_slices):
    """y of the light tokens by the slices down kernel, their dx by two passes of it (w_up's columns, then w_gate's,
    fp32 sums between): every output and gradient within the reference budget, heavy tokens' rows (backup) included."""
    assert cost_model.walk_by_slices("slices", m, k, n, 128)
    check_case(*synthetic_block(m, k, n, nnz, sigma=sigma, seed=m + nnz))


def test_dx_by_slices_in_token_chunks(by_slices, monkeypatch):
    """The passes over ORDER_GROUP slots at a time (the fp32 sums of one chunk held at once), 3000 tokens: two whole
    chunks and a partial one, heavy tokens among them."""
    monkeypatch.setattr(train_backward, "DX_SUMS_BYTES", 1)
    check_case(*synthetic_block(3000, 1024, 2816, 40, sigma=0.5, seed=9))


def test_walks_by_slices_with_dense_zero_and_hot_rows(by_slices):
    x, wg, wu, wd = synthetic_block(2048, 2048, 5632, 28, seed=6)
    x[::5, 0] = -1.0  # fully dense tokens: backup rows, no slot entries
    x[1::5] = 0.0  # all-zero tokens: a count of 0
    wg[123, 0] = 10.0  # neuron 123 fires for (almost) every token
    result = check_case(x, wg, wu, wd)
    assert result.dense_rows() >= len(range(0, 2048, 5))


def test_more_than_65536_tokens():
    check_case(*synthetic_block(70000, 256, 512, 8, sigma=0.3, seed=1))


def test_ffn_wider_than_16_bit_sort_keys():
    """N = 40960 > 32767: the CSC sort keys are int32 rather than int16."""
    check_case(*synthetic_block(300, 128, 40960, 60, sigma=0.3, seed=4))


# ---------------------------------------------------------------- pieces


def test_saved_state_is_the_hybrid_packing_of_the_gate():
    """Light tokens hold exactly the gate's positives (ascending columns, zero padding); the rest are backup rows;
    the saved weights are w_down^T in bf16 (bf16 weights) or gate, up and down^T in bf16 (fp32 master weights)."""
    m, n, width = 1024, 5632, 128
    x, wg, wu, wd = synthetic_block(m, 2048, n, 60, sigma=0.5, seed=3)
    state = dict(zip(STATE_NAMES, twell_train_forward_op(x, wg, wu, wd, width)[4:]))
    g_MN = F.relu(F.linear(x, wg))  # the gate the op reads
    count_M = (g_MN > 0).sum(dim=1, dtype=torch.int32)
    assert torch.equal(state["ell_count_M"], count_M)
    light = ~state["heavy_M"]
    assert torch.equal(light, count_M <= width)  # the routing rule
    rows = light.nonzero()[:, 0]
    ref = pack_hybrid(g_MN[rows], width=width)  # ascending columns, zero padding
    cols, g = state["ell_cols_MW"][rows], state["ell_g_MW"][rows]
    used = torch.arange(width, device="cuda") < ref.ell_count_M[:, None]
    order = torch.where(used, cols, n).argsort(dim=1, stable=True)  # entries by column, padding last
    assert torch.equal(torch.where(used, cols.gather(1, order), 0), ref.ell_cols_MW)
    assert torch.equal(torch.where(used, g.gather(1, order), 0), ref.ell_values_MW)
    u_ref = hybrid_sddmm(x[rows], wu, ref).ell_values_MW  # fp32 dots rounded to bf16; another sum order
    u = torch.where(used, state["ell_u_MW"][rows].gather(1, order), 0)
    torch.testing.assert_close(u.float(), u_ref.float(), rtol=1e-2, atol=1e-3)
    assert (state["ell_g_MW"][~light] == 0).all() and (state["ell_u_MW"][~light] == 0).all()
    assert (state["ell_cols_MW"][~light] == 0).all()
    for padding in (cols, g, state["ell_u_MW"][rows]):  # zero past each light token's entries
        assert (padding[~used] == 0).all()
    heavy = heavy_rows(state["heavy_M"], state["heavy_counts"])
    assert torch.equal(heavy, (~light).nonzero()[:, 0]) and state["heavy_counts"].tolist() == [heavy.numel()]
    assert torch.equal(state["w_compute_RK"], wd.t())
    fp32_state = dict(zip(STATE_NAMES, twell_train_forward_op(x, wg.float(), wu.float(), wd.float(), width)[4:]))
    assert torch.equal(fp32_state["w_compute_RK"], torch.cat([wg, wu, wd.t()]))
    assert torch.equal(fp32_state["ell_u_MW"], state["ell_u_MW"])


@pytest.mark.parametrize("n", [1, 256, 5632, 65536])
def test_csc_offsets_kernels_match_the_torch_reference(n):
    """Column starts, chunk starts, chunk columns and many-chunk ranks of the transposed view, with empty, ordinary
    and many-chunk columns, and with no entry at all."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    key_MW = torch.randint(0, n + 1, (3000, 40), device="cuda", generator=gen, dtype=torch.int32)  # n: unused
    key_MW[:, :5] = min(3, n)  # a hot column: 15000 entries, many chunks
    assert csc_key_dtype(n) == (torch.int16 if n < 65536 else torch.int32)
    key_dtypes = {csc_key_dtype(n), torch.int32}  # the narrow keys the op writes, and int32 keys for any N
    for keys in [k.to(dtype) for k in (key_MW, torch.full_like(key_MW, n)) for dtype in key_dtypes]:
        order, col_start, chunk_start, chunk_col, shared_rank = csc_index(keys, n)
        ref_order, ref_start = csc_order(keys, n)
        assert torch.equal(order, ref_order) and torch.equal(col_start, ref_start)
        assert torch.equal(chunk_start, csc_chunk_starts(ref_start))
        assert torch.equal(chunk_col[: chunk_start[-1]], csc_chunk_columns(chunk_start))
        assert torch.equal(shared_rank, csc_shared_ranks(chunk_start))


def csc_wgrad_case(h: torch.Tensor, width: int, k: int, out_dtype: torch.dtype) -> None:
    """csc_weight_gradients on h's light entries (and twice them as the second value array) vs
    formats.hybrid_t_matmul, on
    NaN-filled outputs of out_dtype (every row must be written) and a scratch that must be left zeroed."""
    m, n = h.shape
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    packed = pack_hybrid(h.bfloat16(), width=width)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    csc = csc_index(csc_keys(packed.ell_cols_MW, packed.ell_count_M, packed.heavy_M, n), n)
    values = packed.ell_values_MW.contiguous()
    second = (values * 2).contiguous()
    out1, out2 = torch.full((2, n, k), float("nan"), device="cuda", dtype=out_dtype).unbind(0)
    scratch, counters = wgrad_scratch(k, torch.device("cuda"))
    csc_weight_gradients(csc, (values, second), x, (out1, out2), scratch, counters[0], width)
    light = packed.with_values(values, torch.zeros_like(packed.backup_values_RN))
    want = hybrid_t_matmul(light, x.float())
    # fp32 sums rounded once: an fp32 out matches to summation order, a bf16 out to one rounding of the sum
    rtol = 1e-4 if out_dtype == torch.float32 else BF16_EPS
    torch.testing.assert_close(out1.float(), want, atol=1e-3, rtol=rtol)
    torch.testing.assert_close(out2.float(), 2 * want, atol=2e-3, rtol=rtol)
    assert not scratch.any()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_csc_weight_gradient_kernel_with_hot_columns(out_dtype):
    """Columns of 0, 1, 64 and ~M entries (many chunks, summed in a scratch slot); heavy tokens are excluded."""
    m, n = 3000, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(m, n, device="cuda", generator=gen)
    h *= torch.rand(m, n, device="cuda", generator=gen) < 0.03
    h[:, 7] = torch.randn(m, device="cuda", generator=gen)  # hot column
    h[:64, 9] = 1.0
    h[:, 11] = 0.0
    h[::50] = torch.randn(n, device="cuda", generator=gen)  # heavy tokens: excluded from the CSC walk
    csc_wgrad_case(h, 40, 2048, out_dtype)


@pytest.mark.parametrize("slots", [1, 3, None])
def test_csc_weight_gradient_kernel_reuses_scratch_slots(slots, monkeypatch):
    """More many-chunk columns than scratch slots (default count, and one or three slots, which make every column
    wait for the one a slot's turn before it): each slot is summed, stored, zeroed and handed on in turn."""
    if slots is not None:
        monkeypatch.setattr(csc, "WGRAD_SLOTS", slots)
    m, n = 3000, 4096  # 1200 columns of ~240 entries, more than twice the mean column (70): each is many chunks
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(m, n, device="cuda", generator=gen)
    fires = torch.rand(m, n, device="cuda", generator=gen) < torch.where(torch.arange(n, device="cuda") < 1200, 0.08, 0)
    h *= fires
    col_start = torch.cat([fires.new_zeros(1, dtype=torch.int64), fires.sum(0).cumsum(0)])
    assert (csc_chunk_starts(col_start).diff() > 1).sum() > csc.WGRAD_SLOTS
    csc_wgrad_case(h, 160, 1024, torch.bfloat16)


def test_no_host_sync_in_forward_nor_in_backward():
    """Heavy tokens included. The backward reads the forward's heavy-token count from pinned memory; once that
    copy has landed (here: after the synchronize, in a model: long before the layer's backward) it waits
    for nothing."""
    x, wg, wu, wd = synthetic_block(2048, 2048, 5632, 60, sigma=0.5, seed=9)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    twell_train_ffn(*leaves)  # compiles the kernels outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = twell_train_ffn(*leaves)
        loss = result.y_MK.float().sum() + 0.1 * result.l1_sum
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert result.dense_rows() > 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.grad is not None for t in leaves)


def test_backward_right_after_its_forward_waits_for_the_count_not_the_device():
    """A backward issued before its forward has run on the GPU (gradient checkpointing's recompute, the last layer)
    reads the heavy-token count as soon as its copy lands, without synchronising the device: the backward's first
    kernels, queued by then, keep running."""
    x, wg, wu, wd = synthetic_block(4096, 2048, 5632, 60, sigma=0.5, seed=10)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    twell_train_ffn(*leaves)  # compiles the kernels outside the checked region
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the GPU is busy well past the host's issuing of forward and backward
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = twell_train_ffn(*leaves)
        (result.y_MK.float().sum() + 0.1 * result.l1_sum).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.dense_rows() > 0 and all(t.grad is not None for t in leaves)


def test_ops_follow_the_callers_stream():
    """The op runs on the caller's current stream, here held busy before the op's kernels are issued: the
    transposed view, built on a side stream beside train_bwd_dx, must wait for the sort keys that stream writes,
    and the weight gradients for the view."""
    x, wg, wu, wd = synthetic_block(4096, 2048, 5632, 28, seed=11)
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)
        check_case(x, wg, wu, wd)


def test_trainer_statistics_accumulate_without_a_sync():
    """What the trainer does after each micro-batch's backward: L0 histogram, fired neurons, the heavy-token
    count still on its way from the GPU. None of it may wait for the device."""
    from sparse_llm.ffn.mlp import SparseMLP
    from sparse_llm.training.sparsity import SparsityConfig, SparsityTracker

    mlp = SparseMLP(2048, 5632, kernel="twell").cuda().bfloat16()
    tracker = SparsityTracker([mlp], SparsityConfig())
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    mlp(x)  # compiles the kernels outside the checked region
    tracker.accumulate(tracker.collect())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mlp(x)
        tracker.accumulate(tracker.collect())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tracker.l0_hist_LB.sum() == 2 * 1024 and tracker.read_window()["l0_max/layer_00"] > 0


def test_autocast_with_fp32_weights():
    """fp32 master weights under autocast: the same y as bf16 weights, and fp32 weight gradients equal to the
    bf16 op's up to the bf16 rounding those skip (so they are not all bf16-representable)."""
    block = synthetic_block(512, 2048, 5632, 56, sigma=0.3, seed=4)
    x, wg, wu, wd = (t.float().requires_grad_() for t in block)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result = twell_train_ffn(x, wg, wu, wd)
    assert result.y_MK.dtype == torch.bfloat16
    (result.y_MK.float().sum() + 0.1 * result.l1_sum).backward()
    leaves = [t.clone().requires_grad_() for t in block]
    bf16 = twell_train_ffn(*leaves)
    torch.testing.assert_close(bf16.y_MK, result.y_MK, rtol=1e-2, atol=1e-3)
    assert bf16.dense_rows() > 0  # the heavy tokens' dense path is covered too
    (bf16.y_MK.float().sum() + 0.1 * bf16.l1_sum).backward()
    for master, low in zip((x, wg, wu, wd), leaves):
        assert master.grad.dtype == torch.float32 and torch.isfinite(master.grad).all()
        rel = (master.grad - low.grad.float()).norm() / low.grad.float().norm()
        assert rel < 2 * BF16_EPS, rel
    for master in (wg, wu, wd):
        assert (master.grad != master.grad.bfloat16().float()).any()


def test_opcheck_on_cuda():
    x, wg, wu, wd = (t.requires_grad_() for t in synthetic_block(64, 256, 512, 20, sigma=0.5, seed=6))
    torch.library.opcheck(twell_train_forward_op, (x, wg, wu, wd, 16))
