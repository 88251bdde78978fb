"""TwELL, the inference format: the gate activation packed per 256-column tile.

Shape suffixes (M, K, N, T, P, S, W, R, E) are explained in `sparse_llm/formats/__init__.py`.

Layout
------
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_llm.formats.common import (
    MAX_N,
    TILE,
    Tensor,
    _check_compression,
    _check_matrix,
    _check_mlp_args,
    _check_n_cols,
    _gather_dot,
    _spmm,
    accumulation_dtype,
    gated_mlp_ref,
)

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
        n_cols: N, the unpacked width (a multiple of TILE).
        compression: C in SUPPORTED_COMPRESSION; slots_per_tile = TILE // C.
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
        return self.n_cols // TILE

    @property
    def slots_per_tile(self) -> int:
        return TILE // self.compression

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
    n_tiles, slots = n // TILE, TILE // compression

    pos_MTC = (gate_MN > 0).reshape(m, n_tiles, TILE)
    rank_MTC = pos_MTC.cumsum(dim=-1) - 1  # rank of each positive inside its tile
    seg_m, seg_t, col_in_tile = (pos_MTC & (rank_MTC < slots - 1)).nonzero(as_tuple=True)
    col_E = seg_t * TILE + col_in_tile
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
    if bool(((counts_MT < 0) | (counts_MT > TILE)).any()):
        bad = ((counts_MT < 0) | (counts_MT > TILE)).nonzero()[:8].tolist()
        raise ValueError(f"TwELL counts outside [0, {TILE}] at (row, tile) {bad}")
    row_E, tile_E, col_E, value_E = _twell_entries(packed)
    outside_E = col_E // TILE != tile_E
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
    key_MTQ = torch.where(stored_MTQ, payload_MTQ & 0xFFFF, MAX_N)  # unused slots sort last
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
    acc = accumulation_dtype(x_MK.dtype)
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
