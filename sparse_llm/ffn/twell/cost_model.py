"""Prices of the sparse kernels' calls and the choices they drive.

`twell_estimated_ms` / `train_estimated_ms` price one inference / training call of a gated block from its shape and
the layer's measured density, so that `sparse_llm.ffn.dispatch` runs a layer sparse only where that is faster than
dense. The same prices pick the direct route's walk (`direct_walk`), the column parts a wide block is walked in
(`column_parts`), the dense rows reserved for heavy tokens (`dense_row_capacity`) and the training walks
(`walk_by_slices`, `dx_by_slices`). Prices are device milliseconds fitted on an H100; where a fit is uncertain it
errs on the dear side, so `auto` may keep a layer dense that would just win, never the reverse. docs/kernels.md lists
every tuned constant with the measurement and command behind it.
"""

from __future__ import annotations

import functools
import math

from sparse_llm.cuda.kernel_constants import DECODE_GROUP_M, DECODE_MAX_M, DIRECT_LIST_CAP
from sparse_llm.ffn.backend import HEAVY_TOKEN_NNZ, Tail
from sparse_llm.ffn.twell.validation import shape_unsupported_reason
from sparse_llm.formats.constants import TILE

# decode_ffn's blocks sum their share of y in shared memory first (`decode_block_sums`) where M * ceil(K / 256) <=
# DECODE_BLOCK_SUM_PIECES (97 KiB a block, two blocks an SM) and a token may fire more than DECODE_GLOBAL_MAX_NNZ
# neurons (no hint: it may): one global atomic per firing neuron would queue thousands on each output address for a
# dense token, while block sums cost sparse tokens only a few us. Priced per pair of (firing neuron, token) at
# DECODE_MS_PER_PAIR for 2048 columns plus DECODE_BLOCK_SUMS_MS (docs/kernels.md, tuned constants).
DECODE_BLOCK_SUM_PIECES = 64

DECODE_GLOBAL_MAX_NNZ = 512

DECODE_MS_PER_PAIR = 2.3e-6

DECODE_BLOCK_SUMS_MS = 0.004

# From this many tokens decode_ffn computes the gates of 8 neurons at a time on the tensor cores (MMA_GATE in
# decode_ffn.cu) instead of one warp-wide dot product per token and neuron: faster from 8 tokens, slower below, where
# its fewer warps stream w_gate at DECODE_MMA_GBPS (docs/kernels.md, tuned constants).
DECODE_MMA_MIN_M = 8

DECODE_MMA_GBPS = 1100.0

# Each group of tokens past the first adds this share of the gate's priced time (besides its rows and pairs): the
# groups' blocks run side by side, so a further group's pass over w_gate costs a fraction of the first's (fitted on
# 16-64 tokens in CUDA graphs; docs/kernels.md, tuned constants).
DECODE_GROUP_GATE_SHARE = 0.15


# The direct route walks a block whose w_up + w_down rows exceed ONE_PASS_ROW_BYTES in WIDE_BLOCK_PARTS column
# parts, one pass per part, so that more of each part's rows stay in L2 while all tokens go over them (the walk's
# rate falls once its rows outgrow L2; see row_slowdown below). Each part costs the tokens' fixed work again and a
# round trip of their fp32 sums, which a third part repays only at higher densities: three parts where the rows reach
# THREE_PART_ROW_BYTES and the layer's recent mean non-zeros per token (known to the dispatch, not to the launch)
# reach THREE_PART_MIN_L0 (docs/kernels.md, tuned constants).
ONE_PASS_ROW_BYTES = 48 * 2**20

WIDE_BLOCK_PARTS = 2

THREE_PART_ROW_BYTES = 128 * 2**20

THREE_PART_MIN_L0 = 45.0

# ------------------------------------------------------------------------------------------------
# Cost model of one call, in ms on an H100 80GB HBM3 (SXM, 132 SMs), fitted at K = 2048, N = 5632
# (`python scripts/bench_mlp.py --mode infer --calibrate`; docs/kernels.md, tuned constants).
# ------------------------------------------------------------------------------------------------
CUBLAS_GEMM_TFLOPS = 730.0  # torch bf16 GEMM [16384, 2048] x [2048, 5632]: 0.517 ms

PACK_GBPS = 2100.0  # one pass that reads the bf16 gate and writes its positives: the training op's gate pass

# Weight-row bytes per ms of the sparse walks (2 rows of K bf16 per non-zero, from L2): with a fixed cost per token
# and the gate's read, this prices the one-warp walk and whole calls on the dear side. The walk by bulk copies runs a
# few percent faster than the fit, which was kept: `auto` may keep a layer dense that would just win, never the
# reverse (docs/kernels.md, tuned constants).
UP_DOWN_GBPS = 7500.0

UP_DOWN_MS_PER_TOKEN = 0.16 / 16384

# That rate holds while the walked rows mostly stay in the 50 MB L2 (K = 2048, N = 5632: 44 MiB of w_up + w_down
# rows); wider blocks draw more of their rows from HBM, and the walk slows with the share that misses. Priced as: the
# share of the rows beyond L2_ROW_BYTES comes from HBM at ROW_HBM_GBPS, and the slower of that and the L2 rate sets
# the pace (row_slowdown; on the dear side of the rates in docs/kernels.md, tuned constants).
L2_ROW_BYTES = 30 * 2**20

ROW_HBM_GBPS = 2840.0

# With a heavy tail (some token above the dense-row threshold) the tokens just under the threshold make the kernel's
# tail, up to TAIL_FACTOR times the even cost. The factor grows with the share of the layer's non-zeros held by tokens
# above DENSE_ROW_NNZ (`heavy_share`) and is whole from TAIL_FULL_SHARE up, so that a mild tail (a few tokens just past
# the threshold, which run at the even rate) does not keep a layer dense (docs/kernels.md, tuned constants).
TAIL_FACTOR = 2.2

TAIL_FULL_SHARE = 0.15

HBM_GBPS = 3000.0

# The host's time of a direct-route call (Python and launches): no call was measured to take less.
CPU_FLOOR_MS = 0.22

# The decode kernel's device time (`decode_ms`, up to DECODE_MAX_M tokens): a fixed cost, w_gate and the rows of the
# neurons some token fires streamed at DECODE_GBPS, and the per-token gate dot products at DECODE_MS_PER_MAC per weight
# (from DECODE_MMA_MIN_M tokens the gates at DECODE_MMA_GBPS instead). Fitted in CUDA graphs, dear at wider blocks.
# Calls issued from Python are host-bound and settled by a trial (`dispatch.HOST_BOUND_MS`): this price serves CUDA
# graphs (docs/kernels.md, tuned constants).
DECODE_FIXED_MS = 0.005

DECODE_GBPS = 2500.0

DECODE_MS_PER_MAC = 1.6e-10

# Tokens with more gate non-zeros than this leave the one-warp path (a dense GEMM row costs about as much as 70 sparse
# non-zeros' weight rows; 128 leaves margin for the gather and scatter): the direct route computes them by dense GEMMs
# over the rows it reserved (DENSE_ROWS_*), and past them splits them over a block of warps so that no single warp
# walks hundreds of non-zeros (docs/kernels.md, tuned constants).
DENSE_ROW_NNZ = HEAVY_TOKEN_NNZ  # 128

# Tokens averaging this many gate non-zeros per tile are assumed to overflow some tile (capacity 31).
OVERFLOW_NNZ_PER_TILE = 20.0

# Below this many tokens the up+down work of each token is split over several warps.
SPLIT_BELOW_M = 2048

# The direct route's heavy tokens (more than its split threshold of positives) go through two dense GEMMs over rows
# gathered on the device (kernels/dense_rows.cu), as many as the host reserved from the layer's recent density;
# heavy tokens past that capacity are split over a block of warps. The reservation: a margin times the expected count
# plus DENSE_ROWS_ALIGN, rounded up to DENSE_ROWS_ALIGN rows; the expected count from the layer's measured share of
# heavy tokens where known, else from the log-normal model of `lognormal_split`, which can miss the count by half (hence
# its wider margin). A spare row costs the GEMMs far less than a heavy token past the reservation, which the call's
# tail walks on one block (docs/kernels.md, tuned constants).
DENSE_ROWS_MARGIN = {"measured": 1.25, "modelled": 2.0}

DENSE_ROWS_ALIGN = 128

# Priced on top of the dense rows' GEMMs and passes (`dense_rows_ms`), in full from a heavy share of TAIL_FULL_SHARE of
# the non-zeros: heavy-tailed calls take longer than their light non-zeros, dense rows and gate GEMM add up to (the
# light tokens' counts spread up to the threshold, and more launches); this keeps their price on the dear side
# (docs/kernels.md, tuned constants).
DENSE_ROWS_MS_PER_TOKEN = 0.15 / 16384

SLICE_SMEM_BYTES = 227 * 1024  # shared memory per block on an H100: the slice's (N + 1) rows of KS bf16

SLICE_WIDTHS = (16, 8)  # KS, widest first (entries_down<KS> instances)

SLICES_MIN_M = 8192  # at 4096 tokens the two walks tie (0.97-1.01x), from 8192 slices win at 56 non-zeros

# Slices price. The up walk: one w_up row per light non-zero at UP_GBPS (slower once the rows outgrow L2:
# `row_slowdown` of N rows of K) plus reading the bf16 gate at GATE_READ_GBPS. The down kernel: per work item (32
# tokens x KS columns) a fixed cost plus one per step of the item's densest token (`warp_steps`), per KS: with 8-column
# slices an item writes half of each 32-byte sector of its tokens' output rows, and such items cost ~3x more (the
# partial sectors appear to cost a read-modify-write). A heavy tail gives the slices walk no edge (a down warp waits
# for its densest token), while the prices, the rows one deliberately dear, would rank the walks apart: slices only up
# to SLICES_MAX_HEAVY_SHARE (docs/kernels.md, tuned constants).
SLICES_MAX_HEAVY_SHARE = 0.05

# The up kernel by bulk copies reads the gate faster than this fit, which was kept: `auto` may pass over the slices
# walk where it would just win, never take it where it loses (docs/kernels.md, tuned constants).
UP_GBPS = 7700.0

GATE_READ_GBPS = 1800.0

DOWN_MS_PER_ITEM = {16: 8.3e-7, 8: 3.2e-6}

DOWN_MS_PER_ITEM_STEP = {16: 7.3e-8, 8: 1.4e-8}


def _gemm_ms(m: int, k: int, n: int, tflops: float) -> float:
    """A GEMM's time: the larger of its flop time and the time to stream its [N, K] weight from HBM."""
    return max(2.0 * m * k * n / (tflops * 1e9), 2 * k * n / (HBM_GBPS * 1e6))


def row_slowdown(footprint_bytes: float) -> float:
    """How many times longer than at UP_DOWN_GBPS a walk takes to stream rows drawn at random from footprint_bytes
    of distinct rows: 1 while most of them stay in L2, then the time of the share beyond L2_ROW_BYTES at
    ROW_HBM_GBPS (the constants above)."""
    miss = max(0.0, 1.0 - L2_ROW_BYTES / footprint_bytes) if footprint_bytes > 0 else 0.0
    return max(1.0, miss * UP_DOWN_GBPS / ROW_HBM_GBPS)


def dense_ms(m: int, k: int, n: int) -> float:
    """The dense bf16 block (three cuBLAS GEMMs) on the same GPU, for pricing the dense rows."""
    return 3 * _gemm_ms(m, k, n, CUBLAS_GEMM_TFLOPS) if m > 0 else 0.0


def dense_row_split(n_tiles: int, l0_mean: float, l0_max: float) -> tuple[float, float]:
    """(fraction of tokens sent to the dense path, mean non-zeros of the other tokens).

    Models non-zeros per token as log-normal with the given mean whose batch maximum lies ~3.5 sigma
    above the median. A token goes dense above DENSE_ROW_NNZ non-zeros, or when it averages
    OVERFLOW_NNZ_PER_TILE per tile (likely overflow). A heuristic: it only has to be right enough to
    price heavy-tailed layers.
    """
    return lognormal_split(min(DENSE_ROW_NNZ, OVERFLOW_NNZ_PER_TILE * n_tiles), l0_mean, l0_max)


def heavy_share(l0_mean: float, l0_max: float, threshold: float = DENSE_ROW_NNZ) -> float:
    """The share of a layer's non-zeros held by tokens with more than `threshold` of them, under dense_row_split's
    log-normal model (0 when no token exceeds it)."""
    if l0_mean <= 0:
        return 0.0
    heavy_fraction, light_mean = lognormal_split(threshold, l0_mean, l0_max)
    return max(0.0, 1.0 - light_mean * (1.0 - heavy_fraction) / l0_mean)


def lognormal_split(threshold: float, l0_mean: float, l0_max: float) -> tuple[float, float]:
    """(fraction of tokens above threshold, mean non-zeros of the others) for log-normal non-zeros per token."""
    if l0_mean <= 0:
        return 0.0, 0.0
    if l0_max <= threshold:
        return 0.0, l0_mean
    sigma = max(math.log(max(l0_max, l0_mean) / l0_mean) / 3.5, 1e-3)
    mu = math.log(l0_mean) - sigma * sigma / 2
    z = (math.log(threshold) - mu) / sigma
    above = 0.5 * math.erfc(z / math.sqrt(2))
    light_mass = l0_mean * 0.5 * math.erfc(-(z - sigma) / math.sqrt(2))  # E[L; L <= threshold]
    return above, light_mass / max(1.0 - above, 1e-9)


def decode_block_sums(m: int, k: int, l0_max: float | None) -> bool:
    """Whether decode_ffn's blocks sum in shared memory for M tokens of K columns whose busiest token fires l0_max
    neurons (None: unknown)."""
    fits = min(m, DECODE_GROUP_M) * math.ceil(k / 256) <= DECODE_BLOCK_SUM_PIECES
    return fits and (l0_max is None or l0_max > DECODE_GLOBAL_MAX_NNZ)


def decode_mma_gate(m: int) -> bool:
    """Whether decode_ffn computes the gates of M tokens on the tensor cores: from DECODE_MMA_MIN_M tokens, and always
    for more than one group of tokens (the kernel's other variant keeps its pointers in kernel parameters)."""
    return m >= DECODE_MMA_MIN_M or m > DECODE_GROUP_M


def twell_estimated_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float, tail: Tail | None = None) -> float:
    """Predicted time of one inference call of the twell backend: for up to DECODE_MAX_M tokens the decode kernel's
    (`decode_ms`), else the "direct" route's: the cuBLAS gate GEMM and the walk `direct_walk` takes (`rows_walk_ms`,
    `slices_walk_ms`). `tail`: the layer's heavy tokens' shares, where known."""
    if 0 < m <= DECODE_MAX_M:
        return decode_ms(m, k, n, l0_mean, l0_max)
    walk_ms = _priced_walk(m, k, n, l0_mean, l0_max, tail)[1]
    return max(_gemm_ms(m, k, n, CUBLAS_GEMM_TFLOPS) + walk_ms, CPU_FLOOR_MS)


def decode_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float) -> float:
    """Predicted device time of `decode_ffn` for M tokens of l0_mean (at most l0_max) non-zeros: for a group of up to
    DECODE_GROUP_M tokens, w_gate, plus the up and down rows of the neurons some token of the group fires (spread
    evenly; a dense token fires all), the tokens' gate dot products, and the additions into y per (firing neuron,
    token) pair. Further groups run beside the first: each adds its rows and pairs and DECODE_GROUP_GATE_SHARE of the
    gate's time."""
    groups = math.ceil(m / DECODE_GROUP_M)
    sizes = [DECODE_GROUP_M] * (groups - 1) + [m - DECODE_GROUP_M * (groups - 1)]  # tokens per group, the first full
    mma_gate = decode_mma_gate(m)
    gate_ms, rest_ms = _decode_group_ms(sizes[0], k, n, l0_mean, mma_gate)
    for size in sizes[1:]:
        rest_ms += DECODE_GROUP_GATE_SHARE * gate_ms + _decode_group_ms(size, k, n, l0_mean, mma_gate)[1]
    block_sums_ms = DECODE_BLOCK_SUMS_MS if decode_block_sums(m, k, l0_max) else 0.0
    return DECODE_FIXED_MS + gate_ms + rest_ms + block_sums_ms


def _decode_group_ms(m: int, k: int, n: int, l0_mean: float, mma_gate: bool) -> tuple[float, float]:
    """`decode_ms`'s price of one group of M tokens alone: (its gates, its rows and pairs)."""
    fired = n * (1.0 - (1.0 - min(1.0, l0_mean / n)) ** m)
    rows_ms = 2 * fired * k * 2 / (DECODE_GBPS * 1e6)
    if mma_gate:  # the gates on the tensor cores
        gate_ms = n * k * 2 / (DECODE_MMA_GBPS * 1e6)
    else:  # w_gate streamed, one warp-wide dot product per token and neuron
        gate_ms = n * k * 2 / (DECODE_GBPS * 1e6) + m * k * n * DECODE_MS_PER_MAC
    return gate_ms, rows_ms + m * l0_mean * k / 2048 * DECODE_MS_PER_PAIR


def _heavy_share(l0_mean: float, l0_max: float, tail: Tail | None) -> float:
    """The share of the layer's non-zeros on tokens above DENSE_ROW_NNZ: measured where known, else modelled."""
    return heavy_share(l0_mean, l0_max) if tail is None else tail.nonzeros


def _tail_factor(l0_mean: float, l0_max: float, tail: Tail | None = None) -> float:
    """How much longer than at an even spread a one-warp-per-token walk takes when some tokens pass DENSE_ROW_NNZ:
    the tokens just under it make the kernel's tail, as much as the tail holds of the non-zeros (TAIL_FACTOR)."""
    return 1.0 + (TAIL_FACTOR - 1.0) * min(1.0, _heavy_share(l0_mean, l0_max, tail) / TAIL_FULL_SHARE)


def dense_rows_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float, tail: Tail | None = None) -> float:
    """The direct route's dense rows for a layer of M tokens (as many as `dense_row_capacity` reserves): the two GEMMs,
    the gather, h and scatter passes over the rows, and DENSE_ROWS_MS_PER_TOKEN as far as the tail goes."""
    rows = dense_row_capacity(m, (l0_mean, l0_max), tail=tail)
    if not rows:
        return 0.0
    passes = rows * (8 * k + 6 * n) / (HBM_GBPS * 1e6)
    spread = m * DENSE_ROWS_MS_PER_TOKEN * min(1.0, _heavy_share(l0_mean, l0_max, tail) / TAIL_FULL_SHARE)
    return 2 * _gemm_ms(rows, k, n, CUBLAS_GEMM_TFLOPS) + passes + spread


def rows_walk_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float, tail: Tail | None = None) -> float:
    """The "rows" walk (one read of the bf16 gate, two weight rows per non-zero at the up + down rate, slower once a
    column part's rows outgrow L2: `row_slowdown`, `column_parts`). In one pass the heavy tokens' non-zeros (`tail`'s
    share where measured; else the log-normal model's, an underestimate on the heavy tails measured) go to the dense
    rows; in parts they are split over warps and slow the walk (`_tail_factor`). The constants were measured on the
    walk over TwELL words, whose fixed cost per token includes words the direct route does not read: a conservative
    price. From WORDS_GATE_MIN_M tokens the walk lists from TwELL words and no longer reads the gate, which this still
    prices (and so stays on the dear side)."""
    row_bytes = 2 * 2 * k  # one w_up row and one w_down row per non-zero
    nonzeros = m * l0_mean
    parts = len(column_parts(k, n))  # the denser layers' third part walks faster than this prices: kept dear
    dense_rows = parts == 1 and dense_row_capacity(m, (l0_mean, l0_max), tail=tail) > 0
    walked = nonzeros * (1.0 - _heavy_share(l0_mean, l0_max, tail)) if dense_rows else nonzeros
    up_down = walked * row_bytes / (UP_DOWN_GBPS * 1e6) * row_slowdown(n * row_bytes / parts)
    up_down *= 1.0 if dense_rows else _tail_factor(l0_mean, l0_max, tail)
    up_down += dense_rows_ms(m, k, n, l0_mean, l0_max, tail) if dense_rows else 0.0
    up_down += parts * m * UP_DOWN_MS_PER_TOKEN + m * n * 2 / (HBM_GBPS * 1e6)
    up_down += (parts - 1) * 2 * m * k * 4 / (HBM_GBPS * 1e6)  # the fp32 sums carried from part to part
    return max(up_down, min(nonzeros, n) * row_bytes / (HBM_GBPS * 1e6))  # rows read once


def slice_width(n: int) -> int | None:
    """KS, the w_down columns per slice of the "slices" walk for FFN width N (its N + 1 rows must fit a block's
    shared memory), or None where even the narrowest slice does not fit."""
    return next((ks for ks in SLICE_WIDTHS if (n + 1) * ks * 2 <= SLICE_SMEM_BYTES), None)


def warp_steps(l0_mean: float, l0_max: float) -> float:
    """Mean steps of a down warp: the tokens a warp walks together were ordered by count (order_tokens), so a warp
    takes about its tokens' count, rounded up to 4; over the warps, the mean non-zeros of the tokens on the one-warp
    path (dense_row_split's log-normal model) plus ~2."""
    light_mean = lognormal_split(DENSE_ROW_NNZ, l0_mean, l0_max)[1]
    return min(DIRECT_LIST_CAP, light_mean + 2.0)


def slices_walk_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float, tail: Tail | None = None) -> float | None:
    """The "slices" walk (see WALKS), or None where it does not run (N too wide for a slice, fewer than
    SLICES_MIN_M tokens): the up walk at one row per light non-zero (the one-warp walk's tail and L2 terms as in
    rows_walk_ms), the heavy tokens through the dense rows (`dense_rows_ms`), and the down kernel by warp steps."""
    ks = slice_width(n)
    if ks is None or m < SLICES_MIN_M:
        return None
    light = m * l0_mean * (1.0 - _heavy_share(l0_mean, l0_max, tail))
    up = light * 2 * k / (UP_GBPS * 1e6) * row_slowdown(n * 2 * k) * _tail_factor(l0_mean, l0_max, tail)
    up += m * n * 2 / (GATE_READ_GBPS * 1e6) + dense_rows_ms(m, k, n, l0_mean, l0_max, tail)
    return up + slices_down_ms(m, k, n, l0_mean, l0_max)


def slices_down_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float) -> float:
    """One entries_down pass over M tokens' slot entries into K columns from N rows (slice_width(N) must fit): per
    work item (32 tokens x KS columns) a fixed cost plus one per step of its densest token (`warp_steps`)."""
    ks = slice_width(n)
    items = math.ceil(m / 32) * (k // ks)
    return items * (DOWN_MS_PER_ITEM[ks] + DOWN_MS_PER_ITEM_STEP[ks] * warp_steps(l0_mean, l0_max))


def direct_walk(m: int, k: int, n: int, l0: tuple[float, float] | None, tail: Tail | None = None) -> str:
    """The walk the direct route takes for M tokens: "slices" where it is priced cheaper than "rows" for the layer's
    recent (mean, max) non-zeros per token `l0` (and heavy tokens' shares `tail`, where known) and the layer has no
    heavy tail (`SLICES_MAX_HEAVY_SHARE`); "rows" while those are unknown (None)."""
    return "rows" if l0 is None else _priced_walk(m, k, n, *l0, tail)[0]


@functools.lru_cache(maxsize=1024)
def _priced_walk(m: int, k: int, n: int, l0_mean: float, l0_max: float, tail: Tail | None = None) -> tuple[str, float]:
    """(the walk `direct_walk` takes at a known density, its price in ms). Cached: a layer's dispatch prices it and
    the block op then picks it on every call, with the same density until the layer's next observation."""
    rows = rows_walk_ms(m, k, n, l0_mean, l0_max, tail)
    if l0_mean <= 0 or _heavy_share(l0_mean, l0_max, tail) > SLICES_MAX_HEAVY_SHARE:
        return "rows", rows
    slices = slices_walk_ms(m, k, n, l0_mean, l0_max, tail)
    return ("slices", slices) if slices is not None and slices < rows else ("rows", rows)


Columns = list[tuple[int, int]]  # column ranges [begin, end) of a walk in parts


def column_parts(
    k: int, n: int, parts: int | None = None, l0_mean: float | None = None, rows_per_neuron: int = 2
) -> Columns:
    """The gate column ranges [begin, end), multiples of TILE, that a walk over the block's weight rows takes one after
    the other (the direct route's w_up + w_down; the training backward's w_down, then w_up + w_gate).

    parts=None: one range while the walk's rows (rows_per_neuron bf16 rows of K per neuron) fit ONE_PASS_ROW_BYTES,
    else WIDE_BLOCK_PARTS, or three for rows of THREE_PART_ROW_BYTES and more at a known l0_mean (the layer's recent
    mean non-zeros per token) of THREE_PART_MIN_L0 and more. An int asks for that many (1 .. N / TILE).
    """
    tiles = n // TILE
    if parts is None:
        rows_bytes = rows_per_neuron * 2 * k * n
        dense_enough = l0_mean is not None and l0_mean >= THREE_PART_MIN_L0
        if rows_bytes <= ONE_PASS_ROW_BYTES:
            parts = 1
        elif rows_bytes >= THREE_PART_ROW_BYTES and dense_enough:
            parts = min(tiles, 3)
        else:
            parts = min(tiles, WIDE_BLOCK_PARTS)
    elif not 1 <= parts <= max(tiles, 1):
        raise ValueError(f"parts={parts}: the gate's {n} columns split into 1 to {max(tiles, 1)} parts of {TILE}")
    bounds = [TILE * (tiles * i // parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def dense_row_capacity(
    m: int, l0_hint: tuple[float, float] | None, split_nnz: int = DENSE_ROW_NNZ, tail: Tail | None = None
) -> int:
    """Rows the direct route reserves for dense GEMMs over its heavy tokens (those with more than split_nnz positives,
    capped at DIRECT_LIST_CAP) at M tokens, from the layer's recent (mean, max) non-zeros per token `l0_hint` and its
    heavy tokens' shares `tail` (None: modelled from l0_hint). 0 without a hint, below SPLIT_BELOW_M tokens (every
    token is split over warps there) or when no token passed the threshold."""
    threshold = min(split_nnz, DIRECT_LIST_CAP)
    if l0_hint is None or m < SPLIT_BELOW_M or threshold <= 0 or l0_hint[1] <= threshold:
        return 0
    if tail is not None and threshold == HEAVY_TOKEN_NNZ:
        rows = DENSE_ROWS_MARGIN["measured"] * tail.tokens * m
    else:
        rows = DENSE_ROWS_MARGIN["modelled"] * lognormal_split(threshold, *l0_hint)[0] * m
    return min(m, DENSE_ROWS_ALIGN * math.ceil((rows + DENSE_ROWS_ALIGN) / DENSE_ROWS_ALIGN))


DEFAULT_WIDTH = 128  # ELL width: the paper's robust setting for L1 >= 1.5e-5

# The walk of y where "slices" fits (`walk_by_slices`): train_fwd_gate without its down half, then ordering, entry
# copy and entries_down beat train_fwd_gate's rows walk at every density measured, even or heavy-tailed
# (docs/kernels.md, tuned constants).
FWD_WALK = "slices"

# The walk of the light dx: "auto" takes slices where the caller's hint of the layer's non-zeros (`dx_by_slices`)
# puts the light tokens' mean at DX_SLICES_MIN_LIGHT_MEAN or more with at most DX_SLICES_MAX_HEAVY_SHARE of the
# non-zeros on heavy tokens. Two passes with fp32 sums between cost a fixed amount, where the rows walk's cost grows
# twice as fast per non-zero, so the two tie near 40; under a heavy tail the light tokens' uneven counts slow the
# slices passes (docs/kernels.md, tuned constants).
DX_WALK = "auto"

DX_SLICES_MIN_LIGHT_MEAN = 40

DX_SLICES_MAX_HEAVY_SHARE = 0.1

TRAIN_MS_PER_TOKEN = 0.10 / 16384  # cost-model residual per token, fitted at M = 16384 (train_estimated_ms)

CALIBRATION_MKN = (16384, 2048, 5632)  # the block train_estimated_ms was fitted on

# A heavy-tailed layer's light tokens just under the ELL width make the walks' tail: its light rows cost this much
# more than a uniform layer's (fitted on h60: mean 60, max 1173 non-zeros per token), in proportion to the tail's
# share of the non-zeros up to TAIL_FULL_SHARE, as in the inference price (h60, h79 and h154 hold 0.32-0.74).
TRAIN_TAIL_FACTOR = 1.4

# The host's time per layer call that a model step sees. Issuing one forward + backward with the L1 loss term (a few
# dozen torch ops and CuPy launches, and the autograd around them) takes the host a few ms, but in a model the host
# issues one layer while the GPU still runs attention and earlier layers, so only part of it shows. This floor puts
# the switch to the sparse op near 6400 tokens per micro-batch, between the 2B step's loss at 4096 and gain at 8192;
# below it the GPU would wait for the host. It errs towards the dense path (docs/kernels.md, tuned constants).
TRAIN_EXPOSED_HOST_MS = 2.4

# Backup rows cost their nine GEMMs three times over: gathers, masks, casts and scatters around them (fitted with every
# token heavy; docs/kernels.md, tuned constants).
BACKUP_FACTOR = 3.0


def _walk_slowdown(footprint_bytes: float, calibration_bytes: float) -> float:
    """`row_slowdown` of a walk over footprint_bytes of rows relative to the same walk at the calibration block (whose
    rate the fitted constants hold), never below 1: narrower blocks are not priced cheaper than the calibration."""
    return max(1.0, row_slowdown(footprint_bytes) / row_slowdown(calibration_bytes))


def train_estimated_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float) -> float | None:
    """Predicted ms of one forward + backward, or None (a shape the kernels cannot take).

    The gate (the cuBLAS GEMM and a pass over it), weight rows streamed per light non-zero at the inference kernel's
    row rate (slower where a walk's rows outgrow L2 more than at the calibration block: `_walk_slowdown`): forward
    w_up's, and w_down's where y does not take the slices walk; backward w_down's, and w_up's and w_gate's where dx
    does not take it (`dx_by_slices` at this density); two gathered token rows for the weight gradients. The slices
    walks at the inference down kernel's price (`slices_down_ms`; dx: two passes and its fp32 sums through memory).
    Then the fp32 weight-gradient buffers, the dense training cost of the backup rows, and TRAIN_MS_PER_TOKEN for what
    the rest does not cover (ELL conversion, CSC sort, casts, launches). Calibrated on the H100 at M = 16384,
    K = 2048, N = 5632 and at M = 8192, K = 4096, N = 11008 (scripts/bench_train_mlp.py): the denser and heavy-tailed
    layers are priced high, which errs towards the dense path (docs/kernels.md, tuned constants).
    A call never costs less than TRAIN_EXPOSED_HOST_MS, the part of the host's time to issue it that a model step
    sees: below that the GPU waits.
    """
    if shape_unsupported_reason(k, n) is not None:
        return None
    y_slices = walk_by_slices(FWD_WALK, m, k, n, DEFAULT_WIDTH)
    dx_slices = dx_by_slices(m, k, n, DEFAULT_WIDTH, (l0_mean, l0_max))
    return max(_train_device_ms(m, k, n, l0_mean, l0_max, y_slices, dx_slices), TRAIN_EXPOSED_HOST_MS)


@functools.lru_cache(maxsize=1024)
def _train_device_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float, y_slices: bool, dx_slices: bool) -> float:
    """train_estimated_ms's device time, given the walks y and dx take. Cached: the dispatcher prices every layer call,
    with the same (mean, max) until the layer's next observation (~30 us a price otherwise)."""
    gate = 2.0 * m * k * n / (CUBLAS_GEMM_TFLOPS * 1e9) + m * n * 2.5 / (PACK_GBPS * 1e6)
    heavy_fraction, light_mean = dense_row_split(n // TILE, l0_mean, l0_max)
    light_entries = m * (1.0 - heavy_fraction) * light_mean
    cal_m, cal_k, cal_n = CALIBRATION_MKN
    rows_per_entry = (
        (1 if y_slices else 2) * _walk_slowdown(4 * n * k, 4 * cal_n * cal_k)  # forward: w_up [and w_down] rows
        + (1 if dx_slices else 3) * _walk_slowdown(6 * n * k, 6 * cal_n * cal_k)  # backward: w_down [w_up, w_gate]
        + 2 * _walk_slowdown(4 * m * k, 4 * cal_m * cal_k)  # weight gradients: the tokens' x and dy rows
    )
    rows = light_entries * rows_per_entry * 2 * k / (UP_DOWN_GBPS * 1e6)
    rows *= 1.0 + (TRAIN_TAIL_FACTOR - 1.0) * min(1.0, heavy_share(l0_mean, l0_max) / TAIL_FULL_SHARE)
    down = slices_down_ms(m, k, n, l0_mean, l0_max) if y_slices or dx_slices else 0.0
    dx_sums = m * k * (4 + 4 + 2) / (HBM_GBPS * 1e6)  # fp32 sums written, read back, bf16 dx written
    slices = (down if y_slices else 0.0) + (2 * down + dx_sums if dx_slices else 0.0)
    wgrad_buffers = 3 * n * k * 4 * 3 / (HBM_GBPS * 1e6)  # zero, accumulate, convert
    backup = BACKUP_FACTOR * 9 * 2.0 * math.ceil(heavy_fraction * m) * k * n / (CUBLAS_GEMM_TFLOPS * 1e9)
    return gate + rows + slices + wgrad_buffers + backup + m * TRAIN_MS_PER_TOKEN


def walk_column_parts(k: int, n: int) -> tuple[Columns, Columns, Columns]:
    """The column parts (`column_parts`) of the three weight walks: the forward's over w_up and w_down (two rows per
    neuron), sddmm's over w_down (one), dx's over w_up and w_gate (two). One part each while their rows fit L2."""
    return column_parts(k, n), column_parts(k, n, rows_per_neuron=1), column_parts(k, n)


def dx_by_slices(m: int, k: int, n: int, width: int, l0_hint: tuple[float, float] | None) -> bool:
    """Whether the light dx takes the slices walk: DX_WALK "slices" wherever it fits, "auto" where it fits and the
    layer's recent (mean, max) non-zeros per token (`l0_hint`; None: unknown, rows) say that it is faster."""
    if DX_WALK == "auto":
        return l0_hint is not None and _dx_slices_faster(width, *l0_hint) and walk_by_slices("slices", m, k, n, width)
    return walk_by_slices(DX_WALK, m, k, n, width)


@functools.lru_cache(maxsize=1024)
def _dx_slices_faster(width: int, l0_mean: float, l0_max: float) -> bool:
    """Whether the light tokens are dense enough and the heavy ones few enough for dx's slices walk (DX_WALK "auto").
    Cached: every training layer call asks, with the same (mean, max) until the layer's next observation."""
    light_mean = lognormal_split(width, l0_mean, l0_max)[1]
    return light_mean >= DX_SLICES_MIN_LIGHT_MEAN and heavy_share(l0_mean, l0_max, width) <= DX_SLICES_MAX_HEAVY_SHARE


def walk_by_slices(walk: str, m: int, k: int, n: int, width: int) -> bool:
    """Whether a walk of the training op set to `walk` (FWD_WALK: y = h w_down^T; DX_WALK: dx = du w_up + dg w_gate)
    takes the slices walk: "rows" reads a K-wide weight row from L2 per entry; "slices" runs the inference route's
    down kernel (entries_down), which holds 16 columns of the weight's N rows in shared memory at a time. Slices need
    those 16 columns to fit shared memory, ELL rows within the slices walk's lists, and SLICES_MIN_M tokens."""
    fits = slice_width(n) == 16 and k % 16 == 0 and width <= DIRECT_LIST_CAP and m >= SLICES_MIN_M
    return walk == "slices" and fits
