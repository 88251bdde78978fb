"""Sparse activation formats of the gated feedforward block, in plain torch.

This module is the specification of the two formats, the CPU execution path and the test oracle
that every CUDA kernel is compared against. Everything here is exact up to the documented rounding
points; nothing is ever dropped (rows that do not fit a format are routed to a dense path).

The block (nn.Linear layouts)::

    g_MN = relu(x_MK @ w_gate_NK^T)     u_MN = x_MK @ w_up_NK^T
    h_MN = g_MN * u_MN                  y_MK = h_MN @ w_down_KN^T

Shape-suffix legend
-------------------
    M  tokens (rows of the activations)
    K  model width (hidden size)
    N  feedforward width (intermediate size), at most 65536 (16-bit column indices)
    T  TwELL tiles per token, N / TILE_COLS
    P  TwELL slots (32-bit words) per (token, tile) segment, TILE_COLS / compression
    S  TwELL words per token, T * P
    W  ELL width of the hybrid format
    R  backup (dense) rows of the hybrid format
    E  flattened non-zero entries (an internal list of (row, column, value) triples)

TwELL (inference format)
------------------------
``words_MS`` is int32 holding uint32 bit patterns. Token m owns S consecutive words: T segments of P
words, segment t covering columns [256 t, 256 t + 256). In segment (m, t):

* word 0 is the true number of strictly positive gate values in that 256-column slice (never
  clamped; it may exceed P - 1),
* words 1 .. P-1 hold the first min(count, P - 1) positives, each encoded as
  ``(bf16_bits(value) << 16) | column`` where column is the GLOBAL column index (0 .. N-1) and the
  value is rounded to bf16 (round to nearest even),
* the reference packer writes entries in ascending column order and zeroes unused slots. Kernels
  may write entries in any order and leave garbage in unused slots; :func:`canonicalize_twell`
  brings such output to the reference form so the two can be compared bit for bit.

A segment with count > P - 1 is an *overflow*: its words keep only P - 1 entries, so the token's
row cannot be decoded from the format and must be computed densely (:attr:`TwellPacked.overflow_M`).
Positivity is tested before rounding (a kernel tests its fp32 accumulator); NaN is not positive and
is therefore not packed.

Hybrid (training format)
------------------------
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

TILE_COLS = 256
SUPPORTED_COMPRESSION = (2, 4, 8)
MAX_COLS = 1 << 16  # column indices are stored in 16 bits

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMS = 1 << 22  # bound on the gathered [chunk, K] temporaries of the SDDMM

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_matrix(t: object, name: str) -> Tensor:
    """Raise unless ``t`` is a 2-D floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; pass a floating tensor (bf16, fp16, fp32 or fp64), "
            f"e.g. {name}.to(torch.bfloat16)"
        )
    if t.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D, got shape {tuple(t.shape)}; flatten leading dims first, "
            f"e.g. {name}.reshape(-1, {name}.shape[-1])"
        )
    return t


def _check_same(ref: Tensor, ref_name: str, t: Tensor, name: str) -> None:
    """Raise unless ``t`` has the dtype and device of ``ref``."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; cast them to one dtype")
    if t.device != ref.device:
        raise ValueError(
            f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device"
        )


def _check_n_cols(n: int, name: str, twell: bool) -> None:
    """Raise unless N fits 16-bit column indices (and the TwELL tiling when ``twell``)."""
    if n > MAX_COLS:
        raise ValueError(
            f"{name} has N={n} columns; the formats store 16-bit column indices, so N must be <= {MAX_COLS}"
        )
    if twell and n % TILE_COLS != 0:
        raise ValueError(
            f"{name} has N={n} columns; TwELL needs N to be a multiple of {TILE_COLS} "
            f"(pad the feedforward width or use the dense/hybrid path)"
        )


def _check_compression(compression: object) -> int:
    if isinstance(compression, bool) or compression not in SUPPORTED_COMPRESSION:
        raise ValueError(f"compression={compression!r} is not supported; use one of {SUPPORTED_COMPRESSION}")
    return int(compression)  # type: ignore[call-overload]


def _check_mlp_args(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor
) -> tuple[int, int, int]:
    """Validate the four block operands; returns (M, K, N)."""
    _check_matrix(x_MK, "x_MK")
    for name, w in (("w_gate_NK", w_gate_NK), ("w_up_NK", w_up_NK), ("w_down_KN", w_down_KN)):
        _check_matrix(w, name)
        _check_same(x_MK, "x_MK", w, name)
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    if w_gate_NK.shape[1] != k:
        raise ValueError(
            f"w_gate_NK has shape {tuple(w_gate_NK.shape)} but x_MK has K={k} columns; "
            f"w_gate_NK must be gate_proj.weight in nn.Linear layout [N, K]"
        )
    if tuple(w_up_NK.shape) != (n, k):
        raise ValueError(
            f"w_up_NK has shape {tuple(w_up_NK.shape)}, expected [N, K] = [{n}, {k}] "
            f"(up_proj.weight in nn.Linear layout, same shape as w_gate_NK)"
        )
    if tuple(w_down_KN.shape) != (k, n):
        hint = (
            " (it looks transposed: pass down_proj.weight itself)" if tuple(w_down_KN.shape) == (n, k) else ""
        )
        raise ValueError(
            f"w_down_KN has shape {tuple(w_down_KN.shape)}, expected [K, N] = [{k}, {n}]: "
            f"down_proj.weight in nn.Linear layout{hint}"
        )
    return m, k, n


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the references: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Sparse loops shared by both formats
# --------------------------------------------------------------------------------------------


def _gather_dot(a_AK: Tensor, ia_E: Tensor, b_BK: Tensor, ib_E: Tensor) -> Tensor:
    """out_E[e] = a_AK[ia_E[e]] . b_BK[ib_E[e]] (an SDDMM over an entry list).

    Chunked so the gathered [chunk, K] operands stay bounded.
    """
    out_E = a_AK.new_empty(ia_E.numel())
    step = max(1, _CHUNK_ELEMS // max(a_AK.shape[1], 1))
    for start in range(0, ia_E.numel(), step):
        s = slice(start, start + step)
        out_E[s] = (a_AK[ia_E[s]] * b_BK[ib_E[s]]).sum(-1)
    return out_E


def _spmm(n_out: int, dst_E: Tensor, src_E: Tensor, value_E: Tensor, src_SK: Tensor) -> Tensor:
    """[n_out, K] with out[dst_E[e]] += value_E[e] * src_SK[src_E[e]] (an SpMM over an entry list).

    Runs as a COO [n_out, S] @ dense [S, K] product: the same sum as a scatter-add loop, many
    times faster on CPU than index_add_ over gathered rows.
    """
    coo = torch.sparse_coo_tensor(
        torch.stack([dst_E, src_E]), value_E, (n_out, src_SK.shape[0]), check_invariants=True
    )
    return torch.sparse.mm(coo, src_SK)


# --------------------------------------------------------------------------------------------
# Dense reference
# --------------------------------------------------------------------------------------------


def gated_mlp_ref(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, upcast: bool = False
) -> tuple[Tensor, Tensor]:
    """Dense gated feedforward block; autograd friendly.

    Args:
        x_MK: tokens [M, K].
        w_gate_NK, w_up_NK: gate_proj / up_proj weights [N, K].
        w_down_KN: down_proj weight [K, N].
        upcast: compute (and return) in fp32 (fp64 inputs stay fp64) instead of the input dtype.

    Returns:
        (y_MK [M, K], h_MN [M, N]) with h = relu(x w_gate^T) * (x w_up^T).
    """
    _check_mlp_args(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    if upcast:
        dtype = _acc_dtype(x_MK.dtype)
        x_MK, w_gate_NK, w_up_NK, w_down_KN = (t.to(dtype) for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN))
    h_MN = F.relu(F.linear(x_MK, w_gate_NK)) * F.linear(x_MK, w_up_NK)
    return F.linear(h_MN, w_down_KN), h_MN


# --------------------------------------------------------------------------------------------
# TwELL
# --------------------------------------------------------------------------------------------


def _bf16_bits(values: Tensor) -> Tensor:
    """bf16 bit patterns (round to nearest even) as int64 in [0, 65535]."""
    return values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _bits_to_bf16(bits: Tensor) -> Tensor:
    """Inverse of :func:`_bf16_bits` for int64 bit patterns in [0, 65535]."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def _u32_to_i32(words: Tensor) -> Tensor:
    """int64 values in [0, 2^32) to int32 with the same 32 bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass
class TwellPacked:
    """TwELL-packed gate activations (layout in the module docstring).

    Attributes:
        words_MS: int32 [M, S] holding uint32 words, S = n_tiles * slots_per_tile.
        n_cols: N, the unpacked width (a multiple of TILE_COLS).
        compression: C in SUPPORTED_COMPRESSION; slots_per_tile = TILE_COLS // C.
    """

    words_MS: Tensor
    n_cols: int
    compression: int

    def __post_init__(self) -> None:
        _check_compression(self.compression)
        _check_n_cols(self.n_cols, "TwellPacked.n_cols", twell=True)
        if self.words_MS.dtype != torch.int32 or self.words_MS.dim() != 2:
            raise TypeError(
                f"words_MS must be a 2-D int32 tensor, got {self.words_MS.dtype} {tuple(self.words_MS.shape)}"
            )
        if self.words_MS.shape[1] != self.n_tiles * self.slots_per_tile:
            raise ValueError(
                f"words_MS has {self.words_MS.shape[1]} words per row; N={self.n_cols} with "
                f"compression={self.compression} needs {self.n_tiles * self.slots_per_tile}"
            )

    @property
    def n_rows(self) -> int:
        return self.words_MS.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.n_cols // TILE_COLS

    @property
    def slots_per_tile(self) -> int:
        return TILE_COLS // self.compression

    @property
    def segments_MTP(self) -> Tensor:
        """The words viewed as [M, T, P] segments."""
        return self.words_MS.view(self.n_rows, self.n_tiles, self.slots_per_tile)

    @property
    def counts_MT(self) -> Tensor:
        """True positive counts per (token, tile), int32 [M, T]; may exceed slots_per_tile - 1."""
        return self.segments_MTP[..., 0]

    @property
    def overflow_M(self) -> Tensor:
        """bool [M]: the token has a tile with more positives than slots_per_tile - 1."""
        return (self.counts_MT > self.slots_per_tile - 1).any(dim=1)

    def select_rows(self, rows_R: Tensor) -> TwellPacked:
        """The packed rows ``rows_R`` (int64 [R]) as a new TwellPacked."""
        return TwellPacked(self.words_MS[rows_R], self.n_cols, self.compression)


def pack_twell(gate_MN: Tensor, compression: int = 8) -> TwellPacked:
    """Pack the strictly positive values of a gate pre-activation into TwELL (ReLU implied).

    Args:
        gate_MN: gate values [M, N] (any float dtype; values are rounded to bf16), N % 256 == 0.
        compression: C in SUPPORTED_COMPRESSION; each (token, tile) gets 256 // C words.

    Returns:
        TwellPacked whose overflowing segments keep their first slots-1 positives (ascending
        columns) and their true count.
    """
    _check_matrix(gate_MN, "gate_MN")
    compression = _check_compression(compression)
    m, n = gate_MN.shape
    _check_n_cols(n, "gate_MN", twell=True)
    n_tiles, slots = n // TILE_COLS, TILE_COLS // compression

    pos_MTC = (gate_MN > 0).reshape(m, n_tiles, TILE_COLS)
    rank_MTC = pos_MTC.cumsum(dim=-1) - 1  # rank of each positive inside its tile
    seg_m, seg_t, col_in_tile = (pos_MTC & (rank_MTC < slots - 1)).nonzero(as_tuple=True)
    col_E = seg_t * TILE_COLS + col_in_tile
    word_E = (_bf16_bits(gate_MN[seg_m, col_E]) << 16) | col_E

    words_MTP = torch.zeros(m, n_tiles, slots, dtype=torch.int64, device=gate_MN.device)
    words_MTP[..., 0] = pos_MTC.sum(dim=-1)
    words_MTP[seg_m, seg_t, rank_MTC[seg_m, seg_t, col_in_tile] + 1] = word_E
    return TwellPacked(_u32_to_i32(words_MTP).reshape(m, n_tiles * slots), n, compression)


def _twell_entries(packed: TwellPacked) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stored entries of every segment: (row_E, tile_E, col_E, value_E bf16), row-major order."""
    seg_MTP = packed.segments_MTP
    slot_P1 = torch.arange(1, packed.slots_per_tile, device=seg_MTP.device)
    stored_MTP1 = slot_P1 <= seg_MTP[..., :1]  # slot j is used iff j <= count
    row_E, tile_E, slot_E = stored_MTP1.nonzero(as_tuple=True)
    word_E = seg_MTP[row_E, tile_E, slot_E + 1].to(torch.int64) & 0xFFFFFFFF
    return row_E, tile_E, word_E & 0xFFFF, _bits_to_bf16(word_E >> 16)


def validate_twell(packed: TwellPacked) -> None:
    """Raise ValueError if the stored entries are malformed.

    Checks: counts in [0, 256]; every stored column lies in its segment's tile; no column is
    stored twice in a row; no stored value is negative. Meant for checking kernel output.
    """
    counts_MT = packed.counts_MT
    if bool(((counts_MT < 0) | (counts_MT > TILE_COLS)).any()):
        bad = ((counts_MT < 0) | (counts_MT > TILE_COLS)).nonzero()[:8].tolist()
        raise ValueError(f"TwELL counts outside [0, {TILE_COLS}] at (row, tile) {bad}")
    row_E, tile_E, col_E, value_E = _twell_entries(packed)
    outside_E = col_E // TILE_COLS != tile_E
    if bool(outside_E.any()):
        e = outside_E.nonzero()[:8, 0]
        found = list(zip(row_E[e].tolist(), tile_E[e].tolist(), col_E[e].tolist(), strict=True))
        raise ValueError(f"TwELL entries stored outside their tile, as (row, tile, column): {found}")
    hits_MN = torch.zeros(packed.n_rows * packed.n_cols, dtype=torch.int32, device=col_E.device)
    hits_MN.index_add_(0, row_E * packed.n_cols + col_E, torch.ones_like(col_E, dtype=torch.int32))
    if bool((hits_MN > 1).any()):
        dup = (hits_MN > 1).nonzero()[:8, 0]
        found = list(zip((dup // packed.n_cols).tolist(), (dup % packed.n_cols).tolist(), strict=True))
        raise ValueError(f"TwELL columns stored twice, as (row, column): {found}")
    if bool(value_E.signbit().any()):
        raise ValueError("TwELL holds negative values; only strictly positive gate values may be packed")


def canonicalize_twell(packed: TwellPacked) -> TwellPacked:
    """Reference form of kernel output: stored entries sorted by column, unused slots zeroed.

    For segments that do not overflow the result equals :func:`pack_twell` of the same gate bit
    for bit. An overflowing segment keeps whichever P - 1 entries were stored (sorted).
    """
    seg_MTP = packed.segments_MTP.to(torch.int64) & 0xFFFFFFFF
    payload_MTQ = seg_MTP[..., 1:]  # Q = P - 1 payload slots
    n_stored_MT = seg_MTP[..., 0].clamp(max=packed.slots_per_tile - 1)
    stored_MTQ = torch.arange(payload_MTQ.shape[-1], device=seg_MTP.device) < n_stored_MT[..., None]
    key_MTQ = torch.where(stored_MTQ, payload_MTQ & 0xFFFF, MAX_COLS)  # unused slots sort last
    payload_MTQ = payload_MTQ.gather(-1, key_MTQ.argsort(dim=-1, stable=True))
    canon_MTP = torch.cat([seg_MTP[..., :1], torch.where(stored_MTQ, payload_MTQ, 0)], dim=-1)
    return TwellPacked(_u32_to_i32(canon_MTP).reshape(packed.n_rows, -1), packed.n_cols, packed.compression)


def _overflow_message(packed: TwellPacked) -> str:
    over_MT = packed.counts_MT > packed.slots_per_tile - 1
    rows = packed.overflow_M.nonzero()[:, 0].tolist()
    cells = over_MT.nonzero()[:8].tolist()
    counts = [int(packed.counts_MT[r, t]) for r, t in cells]
    return (
        f"TwELL rows {rows[:16]}{' ...' if len(rows) > 16 else ''} ({len(rows)} in all) overflow: "
        f"(row, tile) -> count {[(r, t, c) for (r, t), c in zip(cells, counts, strict=True)]} exceed "
        f"{packed.slots_per_tile - 1} slots at compression={packed.compression}. Compute those rows densely "
        f"and decode the others with unpack_twell(packed, rows_R=(~packed.overflow_M).nonzero()[:, 0]), "
        f"or pack with a smaller compression"
    )


def unpack_twell(packed: TwellPacked, rows_R: Tensor | None = None) -> Tensor:
    """Decode TwELL to dense bf16.

    Args:
        packed: the packed gate.
        rows_R: int64 [R] token rows to decode; None decodes all M rows.

    Returns:
        bf16 [R, N] (or [M, N]): relu(gate) rounded to bf16 at the decoded rows.

    Raises:
        ValueError naming the rows and tiles if a requested row overflowed (its values are not
        all in the format), or if the entries are malformed (see :func:`validate_twell`).
    """
    if rows_R is not None:
        packed = packed.select_rows(rows_R)
    if bool(packed.overflow_M.any()):
        raise ValueError(_overflow_message(packed))
    validate_twell(packed)
    row_E, _, col_E, value_E = _twell_entries(packed)
    dense_MN = torch.zeros(packed.n_rows, packed.n_cols, dtype=torch.bfloat16, device=value_E.device)
    dense_MN[row_E, col_E] = value_E
    return dense_MN


@dataclass
class TwellStats:
    """What the TwELL path did.

    Attributes:
        overflow_rows_R: int64 [R] tokens computed by the dense path because a tile overflowed.
        nnz_M: int64 [M] true count of positive gate values per token.
    """

    overflow_rows_R: Tensor
    nnz_M: Tensor

    @property
    def n_overflow_rows(self) -> int:
        return self.overflow_rows_R.numel()


def twell_gated_mlp_ref(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, compression: int = 8
) -> tuple[Tensor, TwellStats]:
    """Inference block through TwELL, as the two inference kernels compute it.

    1. gate_MN = x w_gate^T (fp32 accumulation), packed to TwELL (bf16 values).
    2. For every packed entry (m, n, g): u = x[m] . w_up[n] (fp32), h = g * u, and
       y[m] += h * w_down[:, n] (fp32 accumulation). u is never formed densely.
    3. Rows with an overflowing tile are computed by the dense fp32 path, never dropped.

    Args:
        x_MK: [M, K]; w_gate_NK, w_up_NK: [N, K]; w_down_KN: [K, N]; all one float dtype, N % 256 == 0.
        compression: TwELL compression factor C.

    Returns:
        (y_MK in x's dtype, TwellStats).
    """
    m, k, n = _check_mlp_args(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    _check_n_cols(n, "w_gate_NK", twell=True)
    compression = _check_compression(compression)
    acc = _acc_dtype(x_MK.dtype)
    x_acc_MK, w_gate_acc_NK, w_up_acc_NK = (t.to(acc) for t in (x_MK, w_gate_NK, w_up_NK))
    w_down_acc_NK = w_down_KN.to(acc).t()  # row n = the down-projection column of neuron n

    packed = pack_twell(F.linear(x_acc_MK, w_gate_acc_NK), compression)
    overflow_M = packed.overflow_M
    sparse_rows_R = (~overflow_M).nonzero()[:, 0]
    row_E, _, col_E, g_E = _twell_entries(packed.select_rows(sparse_rows_R))
    row_E = sparse_rows_R[row_E]
    h_E = g_E.to(acc) * _gather_dot(x_acc_MK, row_E, w_up_acc_NK, col_E)

    y_MK = _spmm(m, row_E, col_E, h_E, w_down_acc_NK)
    dense_rows_R = overflow_M.nonzero()[:, 0]
    if dense_rows_R.numel():
        y_MK[dense_rows_R] = gated_mlp_ref(x_MK[dense_rows_R], w_gate_NK, w_up_NK, w_down_KN, upcast=True)[0]
    stats = TwellStats(overflow_rows_R=dense_rows_R, nnz_M=packed.counts_MT.sum(dim=1, dtype=torch.int64))
    return y_MK.to(x_MK.dtype), stats


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
    dense_MN = torch.zeros(
        packed.n_rows, packed.n_cols, dtype=packed.dtype, device=packed.ell_values_MW.device
    )
    row_E, col_E, value_E = _ell_entries(packed)
    dense_MN[row_E, col_E] = value_E
    dense_MN[packed.backup_rows_R] = packed.backup_values_RN
    return dense_MN


def _check_rows(t: Tensor, name: str, packed: HybridPacked, packed_name: str) -> None:
    if t.shape[0] != packed.n_rows:
        raise ValueError(
            f"{name} has {t.shape[0]} rows but {packed_name} has M={packed.n_rows}; they must match"
        )


def _same_structure(a: HybridPacked, b: HybridPacked) -> None:
    if (
        a.ell_cols_MW is b.ell_cols_MW
        and a.ell_count_M is b.ell_count_M
        and a.backup_rows_R is b.backup_rows_R
    ):
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
        raise ValueError(
            "hybrid operands have different structures; derive both from one support (hybrid_sddmm)"
        )


def _zip_values(a: HybridPacked, b: HybridPacked, fn: Callable[[Tensor, Tensor], Tensor]) -> HybridPacked:
    """Combine the values of two hybrids with one structure; fn(0, 0) must be 0 (padding stays 0)."""
    _same_structure(a, b)
    return a.with_values(fn(a.ell_values_MW, b.ell_values_MW), fn(a.backup_values_RN, b.backup_values_RN))


def hybrid_mul(a: HybridPacked, b: HybridPacked) -> HybridPacked:
    """Elementwise product of two hybrids with one structure (e.g. h = g * u)."""
    return _zip_values(a, b, torch.mul)


def hybrid_abs_sum(packed: HybridPacked) -> Tensor:
    """sum |values| over all stored entries, as an fp32 (fp64 for fp64) scalar."""
    acc = _acc_dtype(packed.dtype)
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
    acc = _acc_dtype(x_MK.dtype)
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
        raise ValueError(
            f"w_KN has shape {tuple(w_KN.shape)} but h has N={h.n_cols} columns; w_KN must be [K, N]"
        )
    out_dtype = torch.promote_types(h.dtype, w_KN.dtype)
    acc = _acc_dtype(out_dtype)
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
    acc = _acc_dtype(out_dtype)
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
    acc = _acc_dtype(x_MK.dtype)
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
    acc = _acc_dtype(x_MK.dtype)
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
