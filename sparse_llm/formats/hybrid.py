"""Hybrid, the training format: compact ELL rows for typical tokens, dense backup rows for heavy ones.

Shape suffixes (M, K, N, T, P, S, W, R, E) are explained in `sparse_llm/formats/__init__.py`.

Layout
------
Per token, the structural non-zeros (``!= 0``) are stored either

* in a compact ELL row of width W (``count <= W``): ``ell_values_MW[m, :count]`` and
  ``ell_cols_MW[m, :count]`` in ascending column order, padding slots hold value 0 and column 0
  (so a kernel may run over all W slots without masking), or
* whole in a dense backup row (``count > W``, a "heavy" row): ``backup_values_RN[r]`` is the full
  row of token ``backup_rows_R[r]``; its ELL slots are all padding and must not be read.

``ell_count_M`` always holds the true count, so ``ell_count_M > width`` marks the heavy rows. A
kernel pre-allocates ``capacity`` backup rows; when more rows are heavy the capacity grows and
``capacity_grown`` records it (the caller must log it). Derived structures (the up projection on
the gate's support, the products, the gradients) share the gate's structure tensors and carry new
values; for backup rows the structure is the support row's non-zero pattern.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_llm.formats.common import (
    Tensor,
    _check_matrix,
    _check_mlp_args,
    _check_n_cols,
    _check_same,
    _gather_dot,
    _spmm,
    accumulation_dtype,
)

# --------------------------------------------------------------------------------------------
# Hybrid
# --------------------------------------------------------------------------------------------


@dataclass
class HybridPacked:
    """Hybrid ELL + dense-backup activations (layout in the module docstring).

    Attributes:
        ell_values_MW: [M, W] values of light rows, ascending columns, padding value 0.
        ell_cols_MW: int32 [M, W] column of each ELL value, padding column 0.
        ell_count_M: int32 [M] true structural non-zeros per row (> width marks a heavy row).
        backup_rows_R: int64 [R] ascending indices of the heavy rows.
        backup_values_RN: [R, N] the heavy rows, dense.
        n_cols: N.
        width: W.
        capacity: backup rows a kernel allocates (>= R); grown past the request when needed.
        capacity_grown: True if the requested capacity was too small and had to grow.
    """

    ell_values_MW: Tensor
    ell_cols_MW: Tensor
    ell_count_M: Tensor
    backup_rows_R: Tensor
    backup_values_RN: Tensor
    n_cols: int
    width: int
    capacity: int
    capacity_grown: bool

    def __post_init__(self) -> None:
        """Check dtypes and shapes (cheap, no data-dependent checks)."""
        m, w, r = self.ell_count_M.shape[0], self.width, self.backup_rows_R.shape[0]
        expected = {
            "ell_values_MW": (self.ell_values_MW, None, (m, w)),
            "ell_cols_MW": (self.ell_cols_MW, torch.int32, (m, w)),
            "ell_count_M": (self.ell_count_M, torch.int32, (m,)),
            "backup_rows_R": (self.backup_rows_R, torch.int64, (r,)),
            "backup_values_RN": (self.backup_values_RN, self.ell_values_MW.dtype, (r, self.n_cols)),
        }
        for name, (t, dtype, shape) in expected.items():
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise ValueError(
                    f"HybridPacked.{name} is {t.dtype} {tuple(t.shape)}; expected "
                    f"{dtype or 'a float dtype'} {shape} (M={m}, W={w}, R={r}, N={self.n_cols})"
                )
        if self.capacity < r:
            raise ValueError(f"HybridPacked.capacity={self.capacity} is below the {r} backup rows it holds")

    @property
    def n_rows(self) -> int:
        return self.ell_count_M.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.ell_values_MW.dtype

    @property
    def heavy_M(self) -> Tensor:
        """bool [M]: the row lives in the dense backup."""
        return self.ell_count_M > self.width

    def with_values(self, ell_values_MW: Tensor, backup_values_RN: Tensor) -> HybridPacked:
        """Same structure (shared tensors), new values."""
        return dataclasses.replace(self, ell_values_MW=ell_values_MW, backup_values_RN=backup_values_RN)


def _grown_capacity(n_rows: int, n_heavy: int, requested: int | None) -> tuple[int, bool]:
    capacity = max(1, n_rows // 8) if requested is None else requested
    if n_heavy <= capacity:
        return capacity, False
    next_pow2 = 1 << (n_heavy - 1).bit_length()
    return max(n_heavy, min(next_pow2, n_rows)), True


def pack_hybrid(h_MN: Tensor, width: int = 128, backup_capacity: int | None = None) -> HybridPacked:
    """Pack the non-zeros of ``h_MN`` into the hybrid format.

    Args:
        h_MN: [M, N] activations (any float dtype, kept as is), N <= 65536.
        width: ELL width W >= 1; rows with more non-zeros go whole into the backup.
        backup_capacity: backup rows to plan for; None = max(1, M // 8). If more rows are heavy,
            the capacity grows to the next power of two >= the heavy count (at most M) and
            ``capacity_grown`` is set. No row is ever dropped.
    """
    _check_matrix(h_MN, "h_MN")
    m, n = h_MN.shape
    _check_n_cols(n, "h_MN", twell=False)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r} must be a positive int (the ELL row width, default 128)")
    if backup_capacity is not None and (
        isinstance(backup_capacity, bool) or not isinstance(backup_capacity, int) or backup_capacity < 1
    ):
        raise ValueError(f"backup_capacity={backup_capacity!r} must be a positive int, or None for M // 8")

    nz_MN = h_MN != 0
    count_M = nz_MN.sum(dim=1, dtype=torch.int32)
    heavy_M = count_M > width
    rank_MN = nz_MN.cumsum(dim=1) - 1
    row_E, col_E = (nz_MN & ~heavy_M[:, None]).nonzero(as_tuple=True)
    slot_E = rank_MN[row_E, col_E]

    ell_values_MW = torch.zeros(m, width, dtype=h_MN.dtype, device=h_MN.device)
    ell_values_MW[row_E, slot_E] = h_MN[row_E, col_E]
    ell_cols_MW = torch.zeros(m, width, dtype=torch.int32, device=h_MN.device)
    ell_cols_MW[row_E, slot_E] = col_E.to(torch.int32)
    backup_rows_R = heavy_M.nonzero()[:, 0]
    capacity, grown = _grown_capacity(m, backup_rows_R.numel(), backup_capacity)
    return HybridPacked(
        ell_values_MW=ell_values_MW,
        ell_cols_MW=ell_cols_MW,
        ell_count_M=count_M,
        backup_rows_R=backup_rows_R,
        backup_values_RN=h_MN[backup_rows_R].clone(),
        n_cols=n,
        width=width,
        capacity=capacity,
        capacity_grown=grown,
    )


def _ell_slots(packed: HybridPacked) -> tuple[Tensor, Tensor]:
    """(row_E, slot_E) of the used ELL slots of light rows, row-major."""
    used_MW = torch.arange(packed.width, device=packed.ell_count_M.device) < packed.ell_count_M[:, None]
    return (used_MW & ~packed.heavy_M[:, None]).nonzero(as_tuple=True)


def _ell_entries(packed: HybridPacked) -> tuple[Tensor, Tensor, Tensor]:
    """(row_E, col_E int64, value_E) of the used ELL slots."""
    row_E, slot_E = _ell_slots(packed)
    return row_E, packed.ell_cols_MW[row_E, slot_E].to(torch.int64), packed.ell_values_MW[row_E, slot_E]


def unpack_hybrid(packed: HybridPacked) -> Tensor:
    """Dense [M, N] in the packed dtype."""
    dense_MN = torch.zeros(packed.n_rows, packed.n_cols, dtype=packed.dtype, device=packed.ell_values_MW.device)
    row_E, col_E, value_E = _ell_entries(packed)
    dense_MN[row_E, col_E] = value_E
    dense_MN[packed.backup_rows_R] = packed.backup_values_RN
    return dense_MN


def _check_rows(t: Tensor, name: str, packed: HybridPacked, packed_name: str) -> None:
    if t.shape[0] != packed.n_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows but {packed_name} has M={packed.n_rows}; they must match")


def _same_structure(a: HybridPacked, b: HybridPacked) -> None:
    if a.ell_cols_MW is b.ell_cols_MW and a.ell_count_M is b.ell_count_M and a.backup_rows_R is b.backup_rows_R:
        return  # derived from one support: the structure tensors are shared
    same = (
        a.n_cols == b.n_cols
        and a.width == b.width
        and a.ell_cols_MW.shape == b.ell_cols_MW.shape
        and a.backup_rows_R.shape == b.backup_rows_R.shape
        and torch.equal(a.ell_count_M, b.ell_count_M)
        and torch.equal(a.ell_cols_MW, b.ell_cols_MW)
        and torch.equal(a.backup_rows_R, b.backup_rows_R)
    )
    if not same:
        raise ValueError("hybrid operands have different structures; derive both from one support (hybrid_sddmm)")


def _zip_values(a: HybridPacked, b: HybridPacked, fn: Callable[[Tensor, Tensor], Tensor]) -> HybridPacked:
    """Combine the values of two hybrids with one structure; fn(0, 0) must be 0 (padding stays 0)."""
    _same_structure(a, b)
    return a.with_values(fn(a.ell_values_MW, b.ell_values_MW), fn(a.backup_values_RN, b.backup_values_RN))


def hybrid_mul(a: HybridPacked, b: HybridPacked) -> HybridPacked:
    """Elementwise product of two hybrids with one structure (e.g. h = g * u)."""
    return _zip_values(a, b, torch.mul)


def hybrid_abs_sum(packed: HybridPacked) -> Tensor:
    """sum |values| over all stored entries, as an fp32 (fp64 for fp64) scalar."""
    acc = accumulation_dtype(packed.dtype)
    return packed.ell_values_MW.to(acc).abs().sum() + packed.backup_values_RN.to(acc).abs().sum()


def hybrid_sddmm(x_MK: Tensor, w_NK: Tensor, support: HybridPacked) -> HybridPacked:
    """(x w^T) sampled at the support's structural non-zeros, fp32 accumulation.

    ELL entries are dot products x[m] . w[n]; backup rows are a dense GEMM masked by the support
    row's non-zeros. The result shares the support's structure and has x's dtype.

    Args:
        x_MK: [M, K]; w_NK: [N, K] (same dtype as x); support: hybrid with M rows and N columns.
    """
    _check_matrix(x_MK, "x_MK")
    _check_matrix(w_NK, "w_NK")
    _check_same(x_MK, "x_MK", w_NK, "w_NK")
    _check_rows(x_MK, "x_MK", support, "support")
    if w_NK.shape != (support.n_cols, x_MK.shape[1]):
        raise ValueError(
            f"w_NK has shape {tuple(w_NK.shape)}, expected [N, K] = [{support.n_cols}, {x_MK.shape[1]}] "
            f"(N from support, K from x_MK)"
        )
    acc = accumulation_dtype(x_MK.dtype)
    x_acc_MK, w_acc_NK = x_MK.to(acc), w_NK.to(acc)
    row_E, slot_E = _ell_slots(support)
    col_E = support.ell_cols_MW[row_E, slot_E].to(torch.int64)
    ell_values_MW = torch.zeros(support.ell_cols_MW.shape, dtype=x_MK.dtype, device=x_MK.device)
    ell_values_MW[row_E, slot_E] = _gather_dot(x_acc_MK, row_E, w_acc_NK, col_E).to(x_MK.dtype)
    dense_RN = F.linear(x_acc_MK[support.backup_rows_R], w_acc_NK)
    backup_RN = torch.where(support.backup_values_RN != 0, dense_RN, 0).to(x_MK.dtype)
    return support.with_values(ell_values_MW, backup_RN)


def hybrid_matmul(h: HybridPacked, w_KN: Tensor) -> Tensor:
    """h w^T (sparse x dense, e.g. the down projection y = h w_down^T), fp32 accumulation.

    Args:
        h: hybrid [M, N]; w_KN: [K, N].

    Returns:
        [M, K] in the promoted dtype of h and w.
    """
    _check_matrix(w_KN, "w_KN")
    if w_KN.shape[1] != h.n_cols:
        raise ValueError(f"w_KN has shape {tuple(w_KN.shape)} but h has N={h.n_cols} columns; w_KN must be [K, N]")
    out_dtype = torch.promote_types(h.dtype, w_KN.dtype)
    acc = accumulation_dtype(out_dtype)
    w_acc_KN = w_KN.to(acc)
    row_E, col_E, value_E = _ell_entries(h)
    y_MK = _spmm(h.n_rows, row_E, col_E, value_E.to(acc), w_acc_KN.t())
    y_MK[h.backup_rows_R] = F.linear(h.backup_values_RN.to(acc), w_acc_KN)
    return y_MK.to(out_dtype)


def hybrid_t_matmul(h: HybridPacked, x_MK: Tensor) -> Tensor:
    """h^T x (e.g. weight gradients dW = dh^T x), fp32 accumulation.

    Args:
        h: hybrid [M, N]; x_MK: [M, K].

    Returns:
        [N, K] in the promoted dtype of h and x.
    """
    _check_matrix(x_MK, "x_MK")
    _check_rows(x_MK, "x_MK", h, "h")
    out_dtype = torch.promote_types(h.dtype, x_MK.dtype)
    acc = accumulation_dtype(out_dtype)
    x_acc_MK = x_MK.to(acc)
    row_E, col_E, value_E = _ell_entries(h)
    out_NK = _spmm(h.n_cols, col_E, row_E, value_E.to(acc), x_acc_MK)
    out_NK += h.backup_values_RN.to(acc).t() @ x_acc_MK[h.backup_rows_R]
    return out_NK.to(out_dtype)


@dataclass
class HybridSaved:
    """What the training forward keeps for backward, besides x and the weights the caller owns.

    Attributes:
        g: the gate relu(x w_gate^T) in hybrid form; its structure is the support of everything.
        u: the up projection sampled on g's support (shares g's structure tensors).

    h = g * u is recomputed in backward (one elementwise pass) instead of stored.
    """

    g: HybridPacked
    u: HybridPacked


@dataclass
class HybridForward:
    """Result of :func:`hybrid_gated_mlp_forward_ref`.

    Attributes:
        y_MK: [M, K] block output in x's dtype.
        saved: sparse state for the backward.
        l1_sum: scalar sum over tokens and neurons of |h| (fp32; the loss divides by M itself).
        l0_M: int32 [M] gate non-zeros per token (= non-zeros of h unless u is exactly 0).
    """

    y_MK: Tensor
    saved: HybridSaved
    l1_sum: Tensor
    l0_M: Tensor


@dataclass
class HybridGrads:
    """Gradients of :func:`hybrid_gated_mlp_backward_ref`, in x's dtype and the weights' layouts."""

    dx_MK: Tensor
    dw_gate_NK: Tensor
    dw_up_NK: Tensor
    dw_down_KN: Tensor


def hybrid_gated_mlp_forward_ref(
    x_MK: Tensor,
    w_gate_NK: Tensor,
    w_up_NK: Tensor,
    w_down_KN: Tensor,
    width: int = 128,
    backup_capacity: int | None = None,
) -> HybridForward:
    """Training forward through the hybrid format, as the training kernels compute it.

    g = relu(x w_gate^T) (dense GEMM, rounded to x's dtype) packed hybrid; u = SDDMM of x w_up^T
    on g's support; h = g * u; y = h w_down^T (ELL SpMM + dense GEMM for backup rows).

    Args:
        x_MK: [M, K]; w_gate_NK, w_up_NK: [N, K]; w_down_KN: [K, N]; one float dtype.
        width, backup_capacity: see :func:`pack_hybrid`.
    """
    _, _, n = _check_mlp_args(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    _check_n_cols(n, "w_gate_NK", twell=False)
    acc = accumulation_dtype(x_MK.dtype)
    gate_MN = F.relu(F.linear(x_MK.to(acc), w_gate_NK.to(acc))).to(x_MK.dtype)
    g = pack_hybrid(gate_MN, width, backup_capacity)
    u = hybrid_sddmm(x_MK, w_up_NK, g)
    h = hybrid_mul(g, u)
    y_MK = hybrid_matmul(h, w_down_KN)
    return HybridForward(y_MK=y_MK, saved=HybridSaved(g=g, u=u), l1_sum=hybrid_abs_sum(h), l0_M=g.ell_count_M)


def hybrid_gated_mlp_backward_ref(
    x_MK: Tensor,
    w_gate_NK: Tensor,
    w_up_NK: Tensor,
    w_down_KN: Tensor,
    saved: HybridSaved,
    dy_MK: Tensor,
    dl1: float | Tensor,
) -> HybridGrads:
    """Training backward on the saved sparse state; only backup rows are dense.

    dh = dy w_down sampled on g's support, plus dl1 * sign(h) (the L1 term);
    du = dh * g and dg = dh * u (the ReLU mask is the support); dx = du w_up + dg w_gate;
    dW_up = du^T x; dW_gate = dg^T x; dW_down = dy^T h.

    Args:
        x_MK, w_gate_NK, w_up_NK, w_down_KN: the forward's operands.
        saved: ``HybridForward.saved`` of that forward.
        dy_MK: [M, K] gradient of the loss w.r.t. y (cast to x's dtype, as the kernels take it).
        dl1: gradient of the loss w.r.t. ``l1_sum`` (e.g. l1_coeff / (M * n_layers)), float or
            scalar tensor.
    """
    m, k, n = _check_mlp_args(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    _check_matrix(dy_MK, "dy_MK")
    if tuple(dy_MK.shape) != (m, k):
        raise ValueError(f"dy_MK has shape {tuple(dy_MK.shape)}, expected [M, K] = [{m}, {k}] like x_MK")
    g, u = saved.g, saved.u
    if g.n_rows != m or g.n_cols != n:
        raise ValueError(
            f"saved.g is [{g.n_rows}, {g.n_cols}] but x/w give [M, N] = [{m}, {n}]; "
            f"pass the saved state of this forward"
        )
    dy_MK = dy_MK.to(x_MK.dtype)
    acc = accumulation_dtype(x_MK.dtype)
    dl1_acc = torch.as_tensor(dl1, dtype=acc, device=x_MK.device)

    h = hybrid_mul(g, u)
    dh = hybrid_sddmm(dy_MK, w_down_KN.t(), g)
    # d|h|/dh = sign(h): 0 at padding and off the support, like autograd's abs at 0
    dh = _zip_values(dh, h, lambda d, hv: (d.to(acc) + dl1_acc * hv.to(acc).sign()).to(d.dtype))
    du = hybrid_mul(dh, g)
    dg = hybrid_mul(dh, u)
    dx_MK = hybrid_matmul(du, w_up_NK.t()) + hybrid_matmul(dg, w_gate_NK.t())
    return HybridGrads(
        dx_MK=dx_MK,
        dw_gate_NK=hybrid_t_matmul(dg, x_MK),
        dw_up_NK=hybrid_t_matmul(du, x_MK),
        dw_down_KN=hybrid_t_matmul(h, dy_MK).t().contiguous(),
    )
