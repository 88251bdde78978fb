"""CPU tests of the TwELL and hybrid formats (sparse_llm.formats), the oracle of the CUDA kernels.

fp32 inputs are used where the result must be exact up to accumulation order; bf16 inputs where the
format itself rounds, checked with the tolerance rule of the project: error against an fp32
reference <= 2x the error of the dense bf16 torch path + a small atol.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sparse_llm.formats import (
    SUPPORTED_COMPRESSION,
    TILE,
    HybridPacked,
    TwellPacked,
    canonicalize_twell,
    gated_mlp_ref,
    hybrid_gated_mlp_backward_ref,
    hybrid_gated_mlp_forward_ref,
    hybrid_matmul,
    hybrid_mul,
    hybrid_sddmm,
    hybrid_t_matmul,
    pack_hybrid,
    pack_twell,
    twell_gated_mlp_ref,
    unpack_hybrid,
    unpack_twell,
    validate_twell,
)

# ---------------------------------------------------------------------------------------------
# Data helpers
# ---------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _heavy_tailed_density_M(m: int, mean: float, gen: torch.Generator) -> torch.Tensor:
    """Per-row densities with a Pareto(alpha=1.5) tail: most rows near `mean`/3, a few dense ones."""
    pareto_M = torch.rand(m, generator=gen).clamp_min(1e-6) ** (-1 / 1.5)  # >= 1, mean 3
    return (pareto_M * mean / 3).clamp(max=1.0)


def _signed_sparse(m: int, n: int, density_M: torch.Tensor, gen: torch.Generator, signed: bool) -> torch.Tensor:
    """[M, N] fp32 with non-zeros at rate density_M[m]; elsewhere negative (a gate) or zero."""
    keep_MN = torch.rand(m, n, generator=gen) < density_M[:, None]
    mag_MN = torch.rand(m, n, generator=gen) * 4 + 0.01
    if signed:
        values_MN = mag_MN * torch.where(torch.rand(m, n, generator=gen) < 0.5, -1.0, 1.0)
        return torch.where(keep_MN, values_MN, 0.0)
    return torch.where(keep_MN, mag_MN, -mag_MN)


def _mlp(m: int, k: int, n: int, density_M: torch.Tensor, dtype: torch.dtype, seed: int):
    """Block operands whose gate fires at about density_M[m] per row.

    Column 0 of x carries a per-row offset c_m and w_gate[:, 0] = 1, so gate[m] ~ c_m + N(0, 1)
    and P(gate > 0) = Phi(c_m).
    """
    gen = _gen(seed)
    x_MK = torch.randn(m, k, generator=gen)
    x_MK[:, 0] = torch.special.ndtri(density_M.clamp(1e-4, 1 - 1e-4))
    w_gate_NK = torch.randn(n, k, generator=gen) / (k - 1) ** 0.5
    w_gate_NK[:, 0] = 1.0
    w_up_NK = torch.randn(n, k, generator=gen) / k**0.5
    w_down_KN = torch.randn(k, n, generator=gen) / n**0.5
    return tuple(t.to(dtype) for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN))


def _assert_within_rule(name: str, out: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor, atol: float) -> None:
    """|out - ref| <= 2 |lowp - ref| + atol (max norm), printing the diffs first."""
    err = (out.float() - ref.float()).abs()
    base = (lowp.float() - ref.float()).abs()
    print(f"{name}: max {err.max():.3e} mean {err.mean():.3e} | dense low-precision max {base.max():.3e}")
    assert err.max() <= 2 * base.max() + atol


# ---------------------------------------------------------------------------------------------
# TwELL
# ---------------------------------------------------------------------------------------------


def test_constants() -> None:
    assert TILE == 256
    assert SUPPORTED_COMPRESSION == (2, 4, 8)


@pytest.mark.parametrize("compression", SUPPORTED_COMPRESSION)
@pytest.mark.parametrize("density", [0.0, 0.02, 0.1, 0.3, "heavy"])
@pytest.mark.parametrize("m,n", [(1, 256), (9, 512), (33, 1024)])
def test_twell_round_trip(m: int, n: int, density: float | str, compression: int) -> None:
    gen = _gen(m * n)
    density_M = _heavy_tailed_density_M(m, 0.05, gen) if density == "heavy" else torch.full((m,), float(density))
    gate_MN = _signed_sparse(m, n, density_M, gen, signed=False)
    packed = pack_twell(gate_MN, compression)
    slots = TILE // compression

    assert packed.words_MS.dtype == torch.int32
    assert packed.words_MS.shape == (m, n // TILE * slots)
    true_counts_MT = (gate_MN > 0).reshape(m, -1, TILE).sum(-1)
    assert torch.equal(packed.counts_MT, true_counts_MT.to(torch.int32))
    assert torch.equal(packed.overflow_M, (true_counts_MT > slots - 1).any(1))
    if density != "heavy" and (density <= 0.02 or compression == 2):
        assert not packed.overflow_M.any()  # these cases must exercise the full-row decode

    ok_R = (~packed.overflow_M).nonzero()[:, 0]
    assert torch.equal(unpack_twell(packed, rows_R=ok_R), F.relu(gate_MN[ok_R]).to(torch.bfloat16))
    if packed.overflow_M.any():
        with pytest.raises(ValueError, match="overflow"):
            unpack_twell(packed)
    else:
        assert torch.equal(unpack_twell(packed), F.relu(gate_MN).to(torch.bfloat16))


def test_twell_word_encoding_bits() -> None:
    gate_MN = torch.zeros(2, 512)
    gate_MN[0, 301] = 0.1  # bf16(0.1) rounds to nearest: 0x3DCD (truncation would give 0x3DCC)
    gate_MN[0, 300] = 1.5  # bf16 0x3FC0
    gate_MN[1, 0] = -3.0  # not positive: not packed
    words_MS = pack_twell(gate_MN, compression=8).words_MS

    expected_MS = torch.zeros(2, 64, dtype=torch.int64)
    expected_MS[0, 32] = 2  # count of tile 1 (columns 256..511), word 0 of its segment
    expected_MS[0, 33] = (0x3FC0 << 16) | 300  # ascending global columns
    expected_MS[0, 34] = (0x3DCD << 16) | 301
    assert torch.equal(words_MS.to(torch.int64), expected_MS)
    assert words_MS[0, 33].item() == 0x3FC0012C


@pytest.mark.parametrize("compression", SUPPORTED_COMPRESSION)
def test_twell_overflow_boundary(compression: int) -> None:
    slots = TILE // compression
    gate_MN = -torch.ones(2, 512)
    gate_MN[0, 256 : 256 + slots - 1] = 1.0  # exactly fills the slots: no overflow
    gate_MN[1, 256 : 256 + slots] = torch.arange(1, slots + 1, dtype=torch.float32)  # one too many
    packed = pack_twell(gate_MN, compression)

    assert packed.counts_MT.tolist() == [[0, slots - 1], [0, slots]]
    assert packed.overflow_M.tolist() == [False, True]
    seg_P = packed.segments_MTP[1, 1].to(torch.int64)
    assert torch.equal(seg_P[1:] & 0xFFFF, torch.arange(256, 256 + slots - 1))  # first slots-1, ascending
    assert torch.equal(unpack_twell(packed, rows_R=torch.tensor([0]))[0], F.relu(gate_MN[0]).bfloat16())
    with pytest.raises(ValueError, match=r"rows \[1\].*\(1, 1, " + str(slots)):
        unpack_twell(packed)


def test_twell_adversarial_rows() -> None:
    gate_MN = -torch.ones(4, 512)
    gate_MN[0, 256:] = 1.0  # every column of tile 1
    gate_MN[1] = torch.rand(512) + 0.1  # fully dense row
    gate_MN[2] = 0.0  # all-zero row: zero is not positive
    packed = pack_twell(gate_MN, compression=8)

    assert packed.counts_MT.tolist() == [[0, 256], [256, 256], [0, 0], [0, 0]]
    assert packed.overflow_M.tolist() == [True, True, False, False]
    assert not packed.words_MS[2:].any()
    assert torch.equal(packed.segments_MTP[0, 1, 1:].to(torch.int64) & 0xFFFF, torch.arange(256, 287))
    with pytest.raises(ValueError, match=r"rows \[0, 1\]"):
        unpack_twell(packed)
    with pytest.raises(ValueError, match="overflow"):
        unpack_twell(packed, rows_R=torch.tensor([2, 1]))
    assert not unpack_twell(packed, rows_R=torch.tensor([2, 3])).any()


def test_twell_one_hot_column_for_every_token() -> None:
    gate_MN = -torch.rand(64, 768)
    gate_MN[:, 700] = torch.rand(64) + 0.5
    packed = pack_twell(gate_MN, compression=8)
    assert packed.counts_MT.sum(0).tolist() == [0, 0, 64]
    assert not packed.overflow_M.any()
    assert torch.equal(unpack_twell(packed), F.relu(gate_MN).bfloat16())


def _kernel_style(packed: TwellPacked, gen: torch.Generator) -> TwellPacked:
    """Same content with stored entries in random order and garbage in unused slots."""
    seg_MTP = packed.segments_MTP.clone()
    payload_MTQ = seg_MTP[..., 1:]
    stored_MTQ = torch.arange(payload_MTQ.shape[-1]) < seg_MTP[..., :1].clamp(max=payload_MTQ.shape[-1])
    key_MTQ = torch.where(stored_MTQ, torch.rand(payload_MTQ.shape, generator=gen), 2.0)
    shuffled_MTQ = payload_MTQ.gather(-1, key_MTQ.argsort(-1))
    garbage_MTQ = torch.randint(-(2**31), 2**31 - 1, payload_MTQ.shape, generator=gen, dtype=torch.int32)
    seg_MTP[..., 1:] = torch.where(stored_MTQ, shuffled_MTQ, garbage_MTQ)
    return TwellPacked(seg_MTP.reshape(packed.n_rows, -1), packed.n_cols, packed.compression)


def test_canonicalize_and_validate_kernel_style_output() -> None:
    gen = _gen(7)
    gate_MN = _signed_sparse(40, 768, _heavy_tailed_density_M(40, 0.05, gen), gen, signed=False)
    packed = pack_twell(gate_MN, compression=8)
    kernel = _kernel_style(packed, gen)
    assert not torch.equal(kernel.words_MS, packed.words_MS)

    assert torch.equal(canonicalize_twell(kernel).words_MS, packed.words_MS)
    validate_twell(kernel)
    ok_R = (~packed.overflow_M).nonzero()[:, 0]
    assert torch.equal(unpack_twell(kernel, rows_R=ok_R), unpack_twell(packed, rows_R=ok_R))

    row = int(ok_R[0])
    first = int(packed.counts_MT[row].nonzero()[0, 0])  # a tile of this row with an entry
    slot = row * kernel.words_MS.shape[1] + first * 32 + 1
    wrong_tile = kernel.words_MS.clone().view(-1)
    wrong_tile[slot] = (wrong_tile[slot] & ~0xFFFF) | ((first + 1) % 3 * 256)
    with pytest.raises(ValueError, match="outside their tile"):
        validate_twell(TwellPacked(wrong_tile.view(kernel.words_MS.shape), 768, 8))

    dup = torch.zeros(1, 256)
    dup[0, :2] = 1.0
    dup_words = pack_twell(dup).words_MS.clone()
    dup_words[0, 2] = dup_words[0, 1]
    with pytest.raises(ValueError, match="stored twice"):
        validate_twell(TwellPacked(dup_words, 256, 8))


def test_twell_gated_mlp_bf16_within_tolerance_with_overflow_rows() -> None:
    m, k, n = 96, 64, 512
    density_M = _heavy_tailed_density_M(m, 0.06, _gen(1))
    density_M[:3] = torch.tensor([0.0, 0.5, 1.0])  # an empty row and two rows that must overflow
    x, w_gate, w_up, w_down = _mlp(m, k, n, density_M, torch.bfloat16, seed=2)

    y_MK, stats = twell_gated_mlp_ref(x, w_gate, w_up, w_down, compression=8)
    y_ref_MK, _ = gated_mlp_ref(x, w_gate, w_up, w_down, upcast=True)
    y_bf16_MK, _ = gated_mlp_ref(x, w_gate, w_up, w_down)

    assert y_MK.dtype == torch.bfloat16 and y_MK.shape == (m, k)
    assert 2 <= stats.n_overflow_rows < m // 2
    assert {1, 2} <= set(stats.overflow_rows_R.tolist())
    gate_MN = F.linear(x.float(), w_gate.float())
    assert torch.equal(stats.nnz_M, (gate_MN > 0).sum(1))
    _assert_within_rule("twell y", y_MK, y_ref_MK, y_bf16_MK, atol=1e-2)


@pytest.mark.parametrize("compression", SUPPORTED_COMPRESSION)
def test_twell_gated_mlp_fp32_is_exact_up_to_gate_rounding(compression: int) -> None:
    m, k, n = 48, 32, 768
    density_M = _heavy_tailed_density_M(m, 0.1, _gen(3))
    x, w_gate, w_up, w_down = _mlp(m, k, n, density_M, torch.float32, seed=4)
    y_MK, stats = twell_gated_mlp_ref(x, w_gate, w_up, w_down, compression=compression)

    # Spec: the gate is stored in bf16, everything else accumulates in fp32; overflow rows are dense.
    g_bf16_MN = F.relu(F.linear(x, w_gate)).bfloat16().float()
    y_spec_MK = F.linear(g_bf16_MN * F.linear(x, w_up), w_down)
    y_dense_MK, _ = gated_mlp_ref(x, w_gate, w_up, w_down)
    y_spec_MK[stats.overflow_rows_R] = y_dense_MK[stats.overflow_rows_R]
    torch.testing.assert_close(y_MK, y_spec_MK, rtol=1e-5, atol=1e-5)
    if compression == 8:
        assert stats.n_overflow_rows > 0


def test_twell_validation_errors() -> None:
    x, w_gate, w_up, w_down = _mlp(4, 8, 256, torch.full((4,), 0.1), torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        twell_gated_mlp_ref(x, w_gate[:200], w_up[:200], w_down[:, :200])
    with pytest.raises(ValueError, match="compression=3"):
        twell_gated_mlp_ref(x, w_gate, w_up, w_down, compression=3)
    with pytest.raises(ValueError, match="compression"):
        pack_twell(torch.zeros(1, 256), compression=16)
    with pytest.raises(ValueError, match="w_down_KN.*transposed"):
        twell_gated_mlp_ref(x, w_gate, w_up, w_down.t())
    with pytest.raises(ValueError, match="w_gate_NK.*K=8"):
        twell_gated_mlp_ref(x, w_gate[:, :7], w_up, w_down)
    with pytest.raises(ValueError, match="w_up_NK"):
        twell_gated_mlp_ref(x, w_gate, w_up[:, :7], w_down)
    with pytest.raises(TypeError, match="w_up_NK.*dtype"):
        twell_gated_mlp_ref(x, w_gate, w_up.double(), w_down)
    with pytest.raises(TypeError, match="x_MK.*floating"):
        twell_gated_mlp_ref(x.to(torch.int32), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="x_MK must be 2-D"):
        twell_gated_mlp_ref(x[None], w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="16-bit"):
        pack_twell(torch.zeros(1, 65536 + 256, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_twell([[1.0] * 256])


# ---------------------------------------------------------------------------------------------
# Hybrid
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 8, 32])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, "heavy"])
def test_hybrid_round_trip_and_layout(density: float | str, width: int, dtype: torch.dtype) -> None:
    m, n = 37, 96
    gen = _gen(width)
    if density == "heavy":
        density_M = _heavy_tailed_density_M(m, 0.08, gen)
        density_M[0] = 1.0  # a fully dense row
    else:
        density_M = torch.full((m,), float(density))
    h_MN = _signed_sparse(m, n, density_M, gen, signed=True).to(dtype)
    packed = pack_hybrid(h_MN, width=width)

    assert torch.equal(unpack_hybrid(packed), h_MN)
    nnz_M = (h_MN != 0).sum(1)
    assert packed.ell_count_M.dtype == torch.int32 and torch.equal(packed.ell_count_M.long(), nnz_M)
    assert torch.equal(packed.backup_rows_R, (nnz_M > width).nonzero()[:, 0])
    assert torch.equal(packed.backup_values_RN, h_MN[packed.backup_rows_R])
    assert packed.ell_values_MW.shape == (m, width) and packed.ell_cols_MW.dtype == torch.int32
    used_MW = torch.arange(width) < packed.ell_count_M[:, None]
    used_MW &= ~packed.heavy_M[:, None]
    assert not packed.ell_values_MW[~used_MW].any() and not packed.ell_cols_MW[~used_MW].any()  # padding
    light_cols_MW = torch.where(used_MW, packed.ell_cols_MW, n)
    assert (light_cols_MW[:, 1:] >= light_cols_MW[:, :-1]).all()  # ascending columns
    if density == "heavy":
        assert 0 < packed.backup_rows_R.numel() < m


def test_hybrid_capacity_default_and_growth() -> None:
    def rows_with_nnz(m: int, heavy: int) -> torch.Tensor:
        h_MN = torch.zeros(m, 64)
        h_MN[:, 0] = 1.0
        h_MN[:heavy, :10] = -2.0  # 10 > width 4: heavy
        return h_MN

    packed = pack_hybrid(rows_with_nnz(64, 3), width=4)
    assert (packed.capacity, packed.capacity_grown) == (8, False)  # default M // 8

    h_MN = rows_with_nnz(64, 20)
    packed = pack_hybrid(h_MN, width=4)
    assert (packed.capacity, packed.capacity_grown) == (32, True)  # next power of two >= 20
    assert packed.backup_rows_R.tolist() == list(range(20))
    assert torch.equal(unpack_hybrid(packed), h_MN)  # nothing dropped

    assert pack_hybrid(h_MN, width=4, backup_capacity=20).capacity_grown is False
    assert (pack_hybrid(rows_with_nnz(24, 24), width=4, backup_capacity=1).capacity) == 24  # at most M
    assert pack_hybrid(rows_with_nnz(3, 0), width=4).capacity == 1  # at least 1


def _support_and_dense(m: int, n: int, width: int, seed: int) -> tuple[HybridPacked, torch.Tensor]:
    gen = _gen(seed)
    density_M = _heavy_tailed_density_M(m, 0.15, gen)
    h_MN = _signed_sparse(m, n, density_M, gen, signed=True)
    packed = pack_hybrid(h_MN, width=width, backup_capacity=2)
    assert 0 < packed.backup_rows_R.numel() < m  # both paths are exercised
    return packed, h_MN


def test_hybrid_matmuls_match_dense() -> None:
    m, k, n = 50, 24, 128
    support, h_MN = _support_and_dense(m, n, width=12, seed=5)
    gen = _gen(6)
    x_MK, w_NK, w_KN = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(k, n, generator=gen),
    )

    sampled = hybrid_sddmm(x_MK, w_NK, support)
    assert sampled.ell_cols_MW is support.ell_cols_MW  # structure shared, not copied
    torch.testing.assert_close(unpack_hybrid(sampled), (x_MK @ w_NK.T) * (h_MN != 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hybrid_matmul(support, w_KN), h_MN @ w_KN.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hybrid_t_matmul(support, x_MK), h_MN.T @ x_MK, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        unpack_hybrid(hybrid_mul(support, sampled)), h_MN * (x_MK @ w_NK.T), rtol=1e-5, atol=1e-5
    )


def test_hybrid_forward_fp32_matches_dense() -> None:
    m, k, n = 80, 32, 192
    density_M = _heavy_tailed_density_M(m, 0.08, _gen(8))
    x, w_gate, w_up, w_down = _mlp(m, k, n, density_M, torch.float32, seed=9)
    fwd = hybrid_gated_mlp_forward_ref(x, w_gate, w_up, w_down, width=16, backup_capacity=1)
    y_ref_MK, h_ref_MN = gated_mlp_ref(x, w_gate, w_up, w_down)

    assert fwd.saved.g.capacity_grown and fwd.saved.g.backup_rows_R.numel() > 1
    torch.testing.assert_close(fwd.y_MK, y_ref_MK, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unpack_hybrid(hybrid_mul(fwd.saved.g, fwd.saved.u)), h_ref_MN, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fwd.l1_sum, h_ref_MN.abs().sum(), rtol=1e-5, atol=1e-5)
    assert torch.equal(fwd.l0_M.long(), (h_ref_MN != 0).sum(1))


def test_hybrid_forward_bf16_within_tolerance() -> None:
    m, k, n = 80, 64, 256
    density_M = _heavy_tailed_density_M(m, 0.08, _gen(10))
    x, w_gate, w_up, w_down = _mlp(m, k, n, density_M, torch.bfloat16, seed=11)
    fwd = hybrid_gated_mlp_forward_ref(x, w_gate, w_up, w_down, width=24)
    y_ref_MK, h_ref_MN = gated_mlp_ref(x, w_gate, w_up, w_down, upcast=True)
    y_bf16_MK, h_bf16_MN = gated_mlp_ref(x, w_gate, w_up, w_down)

    assert fwd.y_MK.dtype == torch.bfloat16 and fwd.saved.g.backup_rows_R.numel() > 0
    _assert_within_rule("hybrid y", fwd.y_MK, y_ref_MK, y_bf16_MK, atol=1e-2)
    l1_ref, l1_bf16 = h_ref_MN.abs().sum(), h_bf16_MN.float().abs().sum()
    _assert_within_rule("hybrid l1", fwd.l1_sum, l1_ref, l1_bf16, atol=1e-3 * float(l1_ref))


def _autograd_grads(x, w_gate, w_up, w_down, r_MK, l1):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_gate, w_up, w_down)]
    y_MK, h_MN = gated_mlp_ref(*leaves)
    ((y_MK * r_MK).sum() + l1 * h_MN.abs().sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("l1_as_tensor", [False, True])
def test_hybrid_backward_matches_autograd_fp32(l1_as_tensor: bool) -> None:
    m, k, n, l1 = 72, 24, 128, 0.3
    density_M = _heavy_tailed_density_M(m, 0.1, _gen(12))
    x, w_gate, w_up, w_down = _mlp(m, k, n, density_M, torch.float32, seed=13)
    r_MK = torch.randn(m, k, generator=_gen(14))

    fwd = hybrid_gated_mlp_forward_ref(x, w_gate, w_up, w_down, width=10, backup_capacity=1)
    assert fwd.saved.g.capacity_grown and 0 < fwd.saved.g.backup_rows_R.numel() < m
    dl1 = torch.tensor(l1) if l1_as_tensor else l1
    grads = hybrid_gated_mlp_backward_ref(x, w_gate, w_up, w_down, fwd.saved, r_MK, dl1)
    dx, dw_gate, dw_up, dw_down = _autograd_grads(x, w_gate, w_up, w_down, r_MK, l1)

    torch.testing.assert_close(grads.dx_MK, dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads.dw_gate_NK, dw_gate, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads.dw_up_NK, dw_up, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads.dw_down_KN, dw_down, rtol=1e-4, atol=1e-5)


def test_hybrid_backward_bf16_within_tolerance() -> None:
    m, k, n, l1 = 64, 64, 256, 0.05
    density_M = _heavy_tailed_density_M(m, 0.08, _gen(15))
    ops_bf16 = _mlp(m, k, n, density_M, torch.bfloat16, seed=16)
    r_MK = torch.randn(m, k, generator=_gen(17))

    fwd = hybrid_gated_mlp_forward_ref(*ops_bf16, width=24)
    grads = hybrid_gated_mlp_backward_ref(*ops_bf16, fwd.saved, r_MK, l1)
    ref = _autograd_grads(*(t.float() for t in ops_bf16), r_MK, l1)
    lowp = _autograd_grads(*ops_bf16, r_MK.bfloat16(), l1)
    names = ("dx", "dw_gate", "dw_up", "dw_down")
    outs = (grads.dx_MK, grads.dw_gate_NK, grads.dw_up_NK, grads.dw_down_KN)
    for name, out, want, dense in zip(names, outs, ref, lowp, strict=True):
        assert out.dtype == torch.bfloat16
        _assert_within_rule(name, out, want, dense, atol=1e-2)


def test_hybrid_validation_errors() -> None:
    h_MN = torch.randn(8, 16)
    with pytest.raises(ValueError, match="width"):
        pack_hybrid(h_MN, width=0)
    with pytest.raises(ValueError, match="backup_capacity"):
        pack_hybrid(h_MN, backup_capacity=0)
    with pytest.raises(ValueError, match="16-bit"):
        pack_hybrid(torch.zeros(1, 65537))
    packed = pack_hybrid(h_MN, width=4)
    with pytest.raises(ValueError, match="ell_cols_MW is torch.int64"):
        dataclasses.replace(packed, ell_cols_MW=packed.ell_cols_MW.long())
    with pytest.raises(ValueError, match="capacity"):
        dataclasses.replace(packed, capacity=packed.backup_rows_R.numel() - 1)
    with pytest.raises(ValueError, match="w_KN"):
        hybrid_matmul(packed, torch.randn(16, 8))
    with pytest.raises(ValueError, match="x_MK has 7 rows"):
        hybrid_t_matmul(packed, torch.randn(7, 3))
    with pytest.raises(ValueError, match="w_NK"):
        hybrid_sddmm(torch.randn(8, 3), torch.randn(15, 3), packed)
    with pytest.raises(TypeError, match="w_NK.*dtype"):
        hybrid_sddmm(torch.randn(8, 3), torch.randn(16, 3).double(), packed)
    with pytest.raises(ValueError, match="different structures"):
        hybrid_mul(packed, pack_hybrid(torch.randn(8, 16), width=5))

    x, w_gate, w_up, w_down = _mlp(8, 4, 16, torch.full((8,), 0.3), torch.float32, seed=0)
    saved = hybrid_gated_mlp_forward_ref(x, w_gate, w_up, w_down, width=4).saved
    with pytest.raises(ValueError, match="dy_MK"):
        hybrid_gated_mlp_backward_ref(x, w_gate, w_up, w_down, saved, torch.randn(8, 5), 0.0)
    with pytest.raises(ValueError, match="saved.g"):
        hybrid_gated_mlp_backward_ref(x[:4], w_gate, w_up, w_down, saved, torch.randn(4, 4), 0.0)
    with pytest.raises(ValueError, match="w_down_KN"):
        hybrid_gated_mlp_forward_ref(x, w_gate, w_up, w_down.t())
