"""The "twell" FFN backend: the gated feedforward block for inference through sparse CUDA kernels.

Per block (kernels/ holds the CUDA sources), by one of three routes (`twell_gated_mlp(gate_route=...)`):

- "direct" (what "auto" runs): a cuBLAS GEMM gives the bf16 pre-activation gate [M, N]; the up + down
  kernels read each token's gate row, list its positives g and, per positive n, compute u = x . w_up[n],
  h = g * u, y += h * w_down[:, n] with fp32 accumulation (kernels/gate_up_down.cu). A token with more
  than DENSE_ROW_NNZ positives is handed, on the device, to two dense GEMMs over gathered rows (kernels/dense_rows.cu)
  while the rows the host reserved from the layer's recent density last, then to a kernel that splits it over a
  block of warps.
  There is no slot capacity, so no token is ever recomputed, and nothing is read back to the host: the
  call has no device-to-host synchronisation. A block whose w_up + w_down rows outgrow L2 is walked in two
  or three column parts (`column_parts`), each token's fp32 sums carried from one part to the next.
  For many tokens with evenly spread non-zeros the route may split the walk in two ("slices", `direct_walk`,
  kernels/gate_up_then_down.cu): an up kernel writes each token's h values, then each SM holds a slice of
  w_down's columns in shared memory and computes those columns of y for every token from it; `path` says
  "twell-slices". That walk, and the one-pass walk from WORDS_GATE_MIN_M tokens, take the gate from the fused GEMM
  below as TwELL words rather than from cuBLAS as a dense row (`_direct_gate`): the heavy tokens' gate rows are
  rebuilt on the device for the dense paths. Where the price puts slices ahead, one timed trial per shape and density
  settles the walk (`measured_walk`): the call that runs it waits for the GPU once.
- Up to DECODE_MAX_M tokens (decode steps, small batches), "auto" runs one kernel instead
  (kernels/decode_ffn.cu, `decode_ffn`): each warp takes whole neurons (8 at a time with their gates on the tensor
  cores from DECODE_MMA_MIN_M tokens), dots the neuron's gate row with every token and reads its up row and its
  w_down column only if it fires for some token, adding h times that column into fp32 output rows with atomics
  (summed per block in shared memory first where a token may fire many neurons: `decode_block_sums`); more than
  DECODE_GROUP_M tokens are taken in groups whose blocks run side by side, each group reading w_gate. Few tokens
  cannot share weight rows, so the block is bound by the weight bytes it reads: all of w_gate, and of w_up and
  w_down only the firing neurons' rows (the dense block reads all three); `path` says "twell-decode". Issued from
  Python the call is one launch into a workspace its last block leaves zeroed (`decode_workspace`): there each op a
  call issues costs the host more than this kernel costs the GPU.
- "cublas" / "fused": the gate is first packed to TwELL (`sparse_llm.formats` documents the layout),
  by the same GEMM plus a packing kernel or by a wgmma GEMM whose epilogue packs (no dense gate in
  memory; kernels/twell_gate_wgmma.cu: 2-CTA clusters fed by the bulk tensor copy engine, 640-735 TFLOP/s on the
  H100 at the paper's block against cuBLAS's 735-770). The up + down kernel then walks the packed
  words (kernels/twell_up_down.cu). A token whose tile holds more than 31 positives (an overflow), or
  more than DENSE_ROW_NNZ in all, is recomputed by dense torch GEMMs; finding those tokens costs one
  device-to-host sync per call, `overflow_rows` counts them and `path` says "twell+dense-rows". The
  training op (sparse_llm/ffn/twell/train_op.py) builds its sparse format from these TwELL words.

Statistics (same meaning as the torch backend): l0_M = non-zeros of h = g * u per token (the kernel
counts h != 0 in fp32; it differs from the gate's count only where u is exactly 0), fired_N = neurons
with h != 0 for some token, l1_sum = sum |h| in fp32.

Training (`training=True`) goes to the hybrid ELL + dense-backup op of sparse_llm/ffn/twell/train_op.py. `kernel=auto`
considers it only where the layer's dispatcher allows training kernels (train.py's `train_kernels=true`), so it
trains densely by default; `kernel=twell` forces the sparse training kernels.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sparse_llm.cuda import runtime

from sparse_llm.cuda import tensor_map
from sparse_llm.ffn.backend import HEAVY_TOKEN_NNZ, FFNBackend, FFNResult, Tail, TorchFFN, register_backend, with_residual
from sparse_llm.ffn.dispatch import best_times_ms, env_choice, log_bucket

TILE = 256  # gate columns per TwELL tile
SLOTS = 32  # words per (token, tile) segment
CAPACITY = SLOTS - 1  # entries per segment
MAX_N = 1 << 16  # 16-bit column indices
GATE_BLOCK_M = 128  # rows per output tile of the fused gate GEMM
GATE_STAGES = 3
# The fused gate GEMM's shared memory (SMEM_BYTES in kernels/twell_gate_wgmma.cu): its pipeline stages, the finished
# tile as bf16 rows (pitch TILE / 2 + 4 words), its three packer warps' lists, two barriers per stage and alignment
# slack.
GATE_SMEM_BYTES = (
    GATE_STAGES * (128 * 64 + 256 * 64) * 2 + GATE_BLOCK_M * (TILE // 2 + 4) * 4 + 3 * SLOTS * 4 + GATE_STAGES * 16 + 1024
)
GATE_THREADS = 384  # a producer warpgroup and two consumers
GATE_CLUSTER = 2  # CTAs of a cluster, sharing each w_gate tile
MAX_K = 4096  # the up+down kernel keeps a token's x and output row in registers (K <= 256 * 16)
# Warps (one per token) per block of the one-warp-per-token kernels (twell_up_down here, the training
# kernels' walks in twell_train.py): one, so a block's registers are freed with its token rather than with the
# slowest of several.
TOKENS_PER_BLOCK = 1
UP_DOWN_WORD_BATCH = 8  # TwELL tiles whose words a warp fetches at once (WORD_BATCH in twell_up_down.cu)
GATE_ROUTES = ("auto", "fused", "cublas")  # how twell_gate makes TwELL words
MLP_ROUTES = ("auto", "direct", "fused", "cublas")  # twell_gated_mlp; "auto" = "direct", or decode_ffn for few tokens
DECODE_MAX_M = 64  # DECODE_MAX_M in decode_ffn.cu: the most tokens of a decode_ffn call
DECODE_GROUP_M = 16  # DECODE_GROUP_M there: the most tokens a block stages in shared memory (more make groups)
DECODE_WARPS = 16  # DECODE_WARPS there: warps per block
DECODE_BLOCKS_PER_SM = 2
DECODE_FINISH_THREADS = 256  # threads per block of decode_finish (graphed calls)
# decode_ffn's blocks sum their share of y in shared memory first (`decode_block_sums`) where M * ceil(K / 256) <=
# DECODE_BLOCK_SUM_PIECES (97 KiB a block, two blocks an SM) and a token may fire more than DECODE_GLOBAL_MAX_NNZ
# neurons (no hint: it may). One global atomic per firing neuron queues thousands on each output address for a dense
# token: at K x N = 2048 x 5632, one token firing every neuron took 216 us that way, 33 us with block sums (dense
# block 37 us); block sums cost 3-9 us more for 1-8 tokens of ~30 non-zeros (H100, 2026-11-26). Priced per pair of
# (firing neuron, token) at DECODE_MS_PER_PAIR for 2048 columns plus DECODE_BLOCK_SUMS_MS.
DECODE_BLOCK_SUM_PIECES = 64
DECODE_GLOBAL_MAX_NNZ = 512
DECODE_MS_PER_PAIR = 2.3e-6
DECODE_BLOCK_SUMS_MS = 0.004
# From this many tokens decode_ffn computes the gates of 8 neurons at a time on the tensor cores (MMA_GATE in
# decode_ffn.cu) instead of one warp-wide dot product per token and neuron. In CUDA graphs at K x N = 2048 x 5632,
# 28 non-zeros per token (H100, 2026-11-26): 24.6 against 29.1 us at 8 tokens, 27.9 against 48.1 at 16, but 22.8
# against 17.9 at 4 (fewer warps stream w_gate: priced at DECODE_MMA_GBPS, measured 1.1-1.25 TB/s there, ~1.7 TB/s
# at 4096 x 11008).
DECODE_MMA_MIN_M = 8
DECODE_MMA_GBPS = 1100.0
DECODE_MMA_NEURONS = 8  # MMA_NEURONS there
# Each group of tokens past the first adds this share of the gate's priced time (besides its rows and pairs): in CUDA
# graphs at K x N = 2048 x 5632 (H200, 2026-11-29) 16 / 32 / 48 / 64 tokens took 27.2 / 30.1 / 36.4 / 43.8 us at 28
# non-zeros per token and 31.8 / 36.9 / 45.8 / 56.7 at 56, against the dense block's 32-35.
DECODE_GROUP_GATE_SHARE = 0.15
DIRECT_LIST_CAP = 128  # LIST_CAP in gate_up_down.cu: most positives a token keeps on the one-warp path
FIRST_PART, LAST_PART = 1, 2  # `part` flags of the kernels that walk column parts (twell_common.cuh)
# The direct route walks a block whose w_up + w_down rows exceed ONE_PASS_ROW_BYTES in WIDE_BLOCK_PARTS column
# parts, one pass per part, so that more of each part's rows stay in L2 while all tokens go over them (the walk's
# rate falls once its rows outgrow L2; see row_slowdown below). Each part costs the tokens' fixed work again and a
# round trip of their fp32 sums, which more parts pay for only at higher densities. On the H100 (docs/benchmarks.md,
# 2026-11-26), from 66 to 224 MiB of rows, two parts walked 1.08-1.32x faster than one at 56 non-zeros per token
# and 1.00-1.16x at 28; three parts won more at 56 (up to 1.36x) but lost up to 10% at 20 non-zeros.
# Three parts where the rows reach THREE_PART_ROW_BYTES and the layer's recent mean non-zeros per token (known to
# the dispatch, not to the launch) reach THREE_PART_MIN_L0: 1.06-1.13x faster walks than two at 56 non-zeros over
# 132-224 MiB of rows, 0.975-1.01x at 28.
ONE_PASS_ROW_BYTES = 48 * 2**20
WIDE_BLOCK_PARTS = 2
THREE_PART_ROW_BYTES = 128 * 2**20
THREE_PART_MIN_L0 = 45.0

# ------------------------------------------------------------------------------------------------
# Cost model of one call, in ms on an H100 80GB HBM3 (SXM, 132 SMs), from scripts/bench_mlp.py
# --calibrate at K = 2048, N = 5632 (docs/benchmarks.md, "TwELL inference: calibration").
# ------------------------------------------------------------------------------------------------
CUBLAS_GEMM_TFLOPS = 730.0  # torch bf16 GEMM [16384, 2048] x [2048, 5632]: 0.517 ms
PACK_GBPS = 2100.0  # packing kernel, same shape: 0.108 ms for 185 MB read + 46 MB written
# twell_gate's "auto" takes cuBLAS + packing at every M. The fused gate GEMM + packing epilogue was 0.755 ms at that
# shape (500 TFLOP/s) when this was set; rebuilt (2026-11-28) it runs 0.52-0.60 ms against cuBLAS + packing's ~0.60
# and serves the direct route's slices walk (`_direct_gate`), but "auto" is left to a calibration across M.
FUSED_GATE_MIN_M = 1 << 62
# The direct route's "rows" walk lists from the fused GEMM's TwELL words (`_direct_gate`) from this many tokens. Same
# bits as from cuBLAS's gate; same process, as a decoder layer calls it (residual added, next norm written), H100,
# K = 2048, N = 5632 (docs/benchmarks.md, 2026-11-28): at M = 16384, 3-6% faster back to back and 0-2.5% isolated at
# 3-24 non-zeros per token; 1-2% slower isolated at 28-56, equal back to back. At M = 2048 and 8192, 3% slower.
WORDS_GATE_MIN_M = 16384
# Weight-row bytes per ms of the sparse walks (2 rows of K bf16 per non-zero, from L2). The direct route's
# one-warp kernel at M = 16384: 0.611 ms at 28 non-zeros per token, 1.094 ms at 56 (a marginal 7.8 TB/s); whole
# calls 1.20-1.27 and 1.68-1.72 ms (docs/benchmarks.md, 2026-11-25 14:45-15:20). 7.5 TB/s on top of a fixed 0.16 ms
# per 16384 tokens and the gate's read prices both within 5%, on the dear side. The kernel now takes its rows by bulk
# copies, 5-6% faster at that shape (0.595 / 1.054 ms, H100, 2026-11-27): the fit is dearer still, not refitted, so
# `auto` may keep a layer dense that would just win, never the reverse.
UP_DOWN_GBPS = 7500.0
UP_DOWN_MS_PER_TOKEN = 0.16 / 16384
# That rate holds while the walked rows mostly stay in the 50 MB L2 (K = 2048, N = 5632: 44 MiB of w_up + w_down
# rows). Wider blocks walk rows from HBM: one pass of the direct route, H100, 2026-11-26, 28 / 56 non-zeros per token,
# streamed 7.1 / 7.4 TB/s over 22 MiB of rows, 6.1 / 6.9 over 44, 4.6 / 5.3 over 66, 3.9-4.5 / 4.2-5.1 over 86-96,
# 3.2-3.4 / 3.5-3.7 over 132-224 (K x N from 2048 x 2816 to 4096 x 14336; docs/benchmarks.md). Priced as: the share of
# the rows beyond L2_ROW_BYTES comes from HBM at ROW_HBM_GBPS, and the slower of that and the L2 rate sets the pace
# (row_slowdown; within the measurements' spread, on the dear side).
L2_ROW_BYTES = 30 * 2**20
ROW_HBM_GBPS = 2840.0
# With a heavy tail (some token above the dense-row threshold) the tokens just under the threshold
# make the kernel's tail: measured up to 2.2x the uniform cost at mean 28 / max 796. The factor grows with the share
# of the layer's non-zeros held by tokens above DENSE_ROW_NNZ (`heavy_share`) and is whole from TAIL_FULL_SHARE up:
# the heavy tails measured (H100, mean 28-112, max 1353-2631, K x N 2048 x 5632 to 4096 x 11008) hold 0.2-0.6 of
# their non-zeros there and are priced 1.03-1.4x their measured time; a mild tail such as mean 80 / max 142 (0.003
# of the non-zeros above 128) runs at the uniform rate: at 2048 x 11264 2.76 ms, 1.28x faster than dense, and the
# old price of the whole factor for any token above the threshold (4.7 ms) kept it dense.
TAIL_FACTOR = 2.2
TAIL_FULL_SHARE = 0.15
HBM_GBPS = 3000.0
# Python, launches and the overflow sync: a call never took less than this (M = 1 .. 64: 0.22-0.44 ms).
CPU_FLOOR_MS = 0.22
# The decode kernel (`decode_ffn`, up to DECODE_MAX_M tokens) with its gates as warp-wide dot products, device time
# in CUDA graphs on the H100 (2026-11-26, 28 and 56 non-zeros per token): 14.8-14.9 / 17.7-18.4 / 28.6-29.1 /
# 48.1-48.9 us at 1 / 4 / 8 / 16 tokens at K x N = 2048 x 5632; 37-38 / 45-48 / 68-71 / 122-124 us at 4096 x 11008.
# Priced (`decode_ms`): a fixed cost, w_gate and the rows of the neurons some token fires streamed at DECODE_GBPS,
# and the per-token dot products at DECODE_MS_PER_MAC per weight: 0.93-1.22x the measurements at 2048 x 5632,
# 1.3-1.45x at 4096 x 11008 (where its dot products run faster per weight); from DECODE_MMA_MIN_M tokens the gates
# are priced at DECODE_MMA_GBPS instead. Its host time per call was 1.05-1.7x the dense block's on most machines with
# a memset and two launches, and 0.76-0.79x in one launch (H200, 2026-11-29): calls issued from Python are settled by
# a trial (`dispatch.HOST_BOUND_MS`), this price serves CUDA graphs.
DECODE_FIXED_MS = 0.005
DECODE_GBPS = 2500.0
DECODE_MS_PER_MAC = 1.6e-10
# Tokens with more gate non-zeros than this leave the one-warp path: the TwELL routes compute them with
# dense GEMMs (at ~1.5 ns per sparse non-zero, 8 KiB at 5.5 TB/s, vs ~0.1 us per dense GEMM row, the
# break-even is ~70; 128 leaves margin for the gather/scatter around the dense rows), the direct route
# too, over the rows it reserved (DENSE_ROWS_*), and past them splits them over a block of warps so that no single
# warp walks hundreds of non-zeros.
DENSE_ROW_NNZ = HEAVY_TOKEN_NNZ  # 128
# Tokens averaging this many gate non-zeros per tile are assumed to overflow some tile (capacity 31).
OVERFLOW_NNZ_PER_TILE = 20.0
# Below this many tokens the up+down work of each token is split over several warps.
SPLIT_BELOW_M = 2048
# The direct route's heavy tokens (more than its split threshold of positives) go through two dense GEMMs over rows
# gathered on the device (kernels/dense_rows.cu), as many as the host reserved from the layer's recent density;
# heavy tokens past that capacity are split over a block of warps. The reservation: a margin times the expected count
# plus DENSE_ROWS_ALIGN, rounded up to DENSE_ROWS_ALIGN rows; the expected count from the layer's measured share of
# heavy tokens where known, else from the log-normal model of `lognormal_split`, which put it 0.5-1.3x the actual count
# on the synthetic blocks (H200, 2026-11-26). A spare row costs the two GEMMs ~0.07 us; the heavy tokens past the
# reservation are the call's tail, each walked by one block (~0.1 ms for a dozen tokens of ~1000 non-zeros).
DENSE_ROWS_MARGIN = {"measured": 1.25, "modelled": 2.0}
DENSE_ROWS_ALIGN = 128
# Priced on top of the dense rows' GEMMs and passes (`dense_rows_ms`), in full from a heavy share of TAIL_FULL_SHARE of
# the non-zeros: calls with heavy tails took 0.03-0.15 ms more at 16384 tokens than their light non-zeros at the walk's
# rate, the dense rows and the gate GEMM add up to (H100, 2026-11-26, tails of sigma 0.3 and 0.5 at 28-112 non-zeros
# per token holding 47-87% of them: the light tokens' counts spread up to the threshold, and six more launches). With
# this the price lands at 0.98-1.04x the calls measured: on the dear side, as `auto` needs.
DENSE_ROWS_MS_PER_TOKEN = 0.15 / 16384
DENSE_ROWS_THREADS = 256  # DENSE_ROWS_THREADS in dense_rows.cu: one block per reserved row
# The direct route walks the non-zeros in one of two ways (`direct_walk` picks by price):
# - "rows" (kernels/gate_up_down.cu): one pass; per non-zero a warp reads its w_up and w_down rows from L2.
# - "slices" (kernels/gate_up_then_down.cu): an up walk reads one w_up row per non-zero and writes h; then each SM keeps
#   KS columns of w_down (all N rows) in shared memory and its threads, one per token, read KS weights per non-zero
#   from there, KS columns at a time. It pays where many tokens share each slice (large M); the tokens are ordered
#   by count first, so that the 32 a warp walks together take about equally long.
WALKS = ("rows", "slices")
# Where the price puts slices ahead, the price alone cannot tell: it sees only the mean and max non-zeros per token,
# not how unevenly the neurons fire. Rows profit from hot neurons (their rows stay in L2 and L1) and slices do not:
# in the 2B model at 24 non-zeros per token (bench_model.py, H100, 2026-11-26) the layers' sparse kernels took 16.3 ms
# through rows against 22.0 through slices, where on the synthetic block (neurons drawn evenly) slices ran 4-9% ahead.
# So by default ("measured") the first such call at a shape and density times both walks on its own tokens, and calls
# at that shape and density keep the faster (`measured_walk`); SPARSE_LLM_TWELL_WALK=priced trusts the price
# (deterministic: the two walks round h differently).
WALK_CHOICE_ENV = "SPARSE_LLM_TWELL_WALK"
WALK_TRIAL_REPS = 2  # timed calls per walk in a trial, after one untimed call each
WALK_TRIAL_BUCKETS = 2  # densities within a factor 2 ** (1 / this) of mean non-zeros share a trial
_measured_walks: dict[tuple[int, int, int, int], str] = {}
SLICE_SMEM_BYTES = 227 * 1024  # shared memory per block on an H100: the slice's (N + 1) rows of KS bf16
SLICE_WIDTHS = (16, 8)  # KS, widest first (entries_down<KS> instances)
ORDER_GROUP = 1024  # tokens ordered by count together (order_tokens in the kernel)
SLICES_MIN_M = 8192  # at 4096 tokens the two walks tie (0.97-1.01x), from 8192 slices win at 56 non-zeros
# Slices price, from the H100 (2026-11-26, docs/benchmarks.md; K x N from 2048 x 5632 to 4096 x 14336, 8192 to 32768
# tokens, 20 to 112 non-zeros per token). The up walk: one w_up row per light non-zero at UP_GBPS (slower once the
# rows outgrow L2: `row_slowdown` of N rows of K) plus reading the bf16 gate at GATE_READ_GBPS (0.349 / 0.601 ms at
# the paper's block at 28 / 56, priced within -6% .. +9% everywhere). The down kernel: per work item (32 tokens x KS
# columns) a fixed cost plus one per step of the item's densest token (`warp_steps`), per KS: with 8-column slices
# an item writes half of each 32-byte sector of its tokens' output rows, and such items cost ~3x more (the partial
# sectors appear to cost a read-modify-write). 16 columns refitted after the tokens were ordered by count (H200,
# order + down kernels: 0.197 / 0.330 ms at the paper's block at 28 / 56, 0.18-0.19 at 8192 tokens and 56).
# With a heavy tail the heavy tokens cost both walks the same: tails holding 0.15-0.36 of their non-zeros above
# DENSE_ROW_NNZ walked 1.10-1.19x slower in slices than in rows (mean 28 and 56, sigma 0.3 and 0.5) while a down warp
# waited for its densest token; with the tokens ordered by count the two tie (mean 28, sigma 0.3: 0.97-0.98 ms each,
# H200), while the walks' prices (the rows one deliberately dear) rank them apart.
SLICES_MAX_HEAVY_SHARE = 0.05
# The up kernel has since taken its rows and gate row by bulk copies: 0.307 / 0.557 ms (H100, 2026-11-27), the same
# rate per row and a cheaper gate read (~2900 GB/s). The fit below still prices the former kernel, 0.04 ms dear at
# the paper's block: `auto` may pass over the slices walk where it would now just win, never take it where it loses.
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
    TwELL kernel, whose fixed cost per token includes the packed words the direct route does not read: a conservative
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


# ------------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------------


def shape_unsupported_reason(k: int, n: int) -> str | None:
    """None if the kernels handle hidden width K and FFN width N, else why not."""
    if k % 64 != 0:
        return f"hidden width K={k} is not a multiple of 64"
    if k > MAX_K:
        return f"hidden width K={k} exceeds {MAX_K}"
    if n % TILE != 0:
        return f"FFN width N={n} is not a multiple of {TILE}"
    if n > MAX_N:
        return f"FFN width N={n} exceeds {MAX_N} (16-bit column indices)"
    return None


def _check_tensor(
    t: object, name: str, shape: tuple[int, int], layout: str, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; the twell kernels take {allowed}, e.g. {name}.to(torch.bfloat16)")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {list(shape)} ({layout})")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")


def _check_residual(residual_MK: object, x_MK: torch.Tensor) -> bool:
    """Validates a residual to add to the block's output: True where the kernels can add it as they store y (bf16,
    contiguous); the caller adds any other."""
    if not isinstance(residual_MK, torch.Tensor):
        raise TypeError(f"residual_MK must be a torch.Tensor, got {type(residual_MK).__name__}")
    if residual_MK.shape != x_MK.shape or residual_MK.device != x_MK.device:
        raise ValueError(
            f"residual_MK has shape {list(residual_MK.shape)} on {residual_MK.device}; it must match x_MK "
            f"({list(x_MK.shape)} on {x_MK.device}): the residual stream the block's output is added to"
        )
    return residual_MK.dtype == torch.bfloat16 and residual_MK.is_contiguous()


def _check_2d(t: object, name: str, expected: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor {expected}, got {got}")


def _check_operands(
    x_MK: torch.Tensor,
    n: int,
    operands: list[tuple[str, object, tuple[int, int], str]],
    weight_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> None:
    """x_MK (bf16) and each (name, tensor, expected shape, layout) (one of weight_dtypes) must be shaped,
    contiguous, on one CUDA device."""
    m, k = x_MK.shape
    _check_tensor(x_MK, "x_MK", (m, k), "tokens x hidden")
    for name, t, shape, layout in operands:
        _check_tensor(t, name, shape, layout, weight_dtypes)
    reason = shape_unsupported_reason(k, n)
    if reason is not None:
        raise ValueError(
            f"{operands[0][0]}: {reason}; the twell kernels cannot run this layer, use kernel=torch or auto"
        )
    for name, t, _, _ in operands:
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")
    if x_MK.device.type != "cuda":
        raise ValueError(
            f"x_MK is on {x_MK.device}; the twell kernels need CUDA tensors (use kernel=torch on CPU)"
        )


def check_inputs(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    weight_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> None:
    """Raise a ValueError/TypeError naming the bad argument unless the kernels can take these operands (x_MK
    bf16, the weights of one of `weight_dtypes`: the training op also takes float32 master weights)."""
    _check_2d(x_MK, "x_MK", "[M, K]; flatten leading dims with x.reshape(-1, K)")
    _check_2d(w_gate_NK, "w_gate_NK", "[N, K] (gate_proj.weight)")
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    _check_operands(x_MK, n, [
        ("w_gate_NK", w_gate_NK, (n, k), "gate_proj.weight in nn.Linear layout [N, K]"),
        ("w_up_NK", w_up_NK, (n, k), "up_proj.weight in nn.Linear layout [N, K]"),
        ("w_down_KN", w_down_KN, (k, n), "down_proj.weight in nn.Linear layout [K, N]"),
    ], weight_dtypes)  # fmt: skip


def _check_gate_route(route: str, allowed: tuple[str, ...] = GATE_ROUTES) -> None:
    if route not in allowed:
        raise ValueError(f"gate_route={route!r} is not valid; use one of {allowed}")


# ------------------------------------------------------------------------------------------------
# Cached transposed down-projection weight
# ------------------------------------------------------------------------------------------------


def _version(t: torch.Tensor) -> int:
    # Inference tensors have no version counter (reading it raises, and a raised error costs host time every call);
    # they cannot change in place either.
    return -1 if t.is_inference() else t._version


_KERNEL_TYPES = {torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


def transposed_copy(
    w_RC: torch.Tensor, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None, add: bool = False
) -> torch.Tensor:
    """Contiguous copy of w_RC^T [C, R] in `dtype`, for a 2-D bf16 or fp32 tensor and a bf16 or fp32 `dtype`,
    written to `out` (a contiguous [C, R] tensor of `dtype`) when given; with `add`, added to `out` (required).

    On a GPU where the kernels run, with R and C multiples of 32, a tiled transpose kernel
    (kernels/transpose.cu) casts and transposes in one coalesced pass; elsewhere torch's strided copy.
    """
    rows, cols = w_RC.shape
    fast = (
        w_RC.is_cuda
        and w_RC.dtype in _KERNEL_TYPES
        and dtype in _KERNEL_TYPES
        and rows % 32 == 0
        and cols % 32 == 0
        and runtime.unavailable_reason(w_RC.device) is None
    )
    if out is None:
        if add:
            raise ValueError("add=True adds into `out`: pass the tensor to add to")
        out = torch.empty(cols, rows, dtype=dtype, device=w_RC.device)
    elif out.shape != (cols, rows) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {[cols, rows]}")
    if not fast:
        return out.add_(w_RC.detach().t()) if add else out.copy_(w_RC.detach().t())
    src = w_RC.detach().contiguous()
    if src.numel():
        name = f"transpose_cast<{_KERNEL_TYPES[src.dtype]},{_KERNEL_TYPES[dtype]}>"
        kernel = runtime.get_function("transpose.cu", name, src.device)
        args = (runtime.ptr(src), runtime.ptr(out), _i32(rows), _i32(cols), _i32(add))
        runtime.launch(kernel, (cols // 32, rows // 32), (32, 8), args, src.device)
    return out


class TransposeCache:
    """w [K, N] -> contiguous w^T [N, K], rebuilt when the weight tensor changes (new object, storage or version)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}

    def get(self, w_KN: torch.Tensor) -> torch.Tensor:
        key = id(w_KN)
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry[0]() is w_KN
            and entry[1] == _version(w_KN)
            and entry[2] == w_KN.data_ptr()
        ):
            return entry[3]
        w_t_NK = transposed_copy(w_KN, w_KN.dtype)
        ref = weakref.ref(w_KN, lambda _, key=key: self._entries.pop(key, None))
        self._entries[key] = (ref, _version(w_KN), w_KN.data_ptr(), w_t_NK)
        return w_t_NK

    def __len__(self) -> int:
        return len(self._entries)


_DOWN_T = TransposeCache()


# ------------------------------------------------------------------------------------------------
# Ops
# ------------------------------------------------------------------------------------------------


def _i32(value: int) -> np.int32:
    return np.int32(value)


def gate_route_for(m: int) -> str:
    """The gate route "auto" picks for M tokens."""
    return "fused" if m >= FUSED_GATE_MIN_M else "cublas"


def twell_gate(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, route: str = "auto", overflow_gate_MN: torch.Tensor | None = None
) -> torch.Tensor:
    """TwELL-packed relu(x w_gate^T): int32 [M, (N/256) * 32] (layout: sparse_llm.formats).

    Args:
        x_MK: bf16 [M, K] on a Hopper GPU, contiguous, K % 64 == 0.
        w_gate_NK: bf16 [N, K] (gate_proj.weight), N % 256 == 0.
        route: "fused" (wgmma GEMM with packing epilogue), "cublas" (torch GEMM + packing kernel) or
            "auto" (by M, see gate_route_for).
        overflow_gate_MN: bf16 [M, N] or None ("fused" only): the fused GEMM writes there the 256 pre-activation
            values of every (token, tile) whose segment overflows, and nothing else.
    """
    _check_gate_route(route)
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    if route == "auto":
        route = gate_route_for(m)
    device = x_MK.device
    packed_MS = torch.empty(m, n // TILE * SLOTS, dtype=torch.int32, device=device)
    if m == 0:
        return packed_MS
    if route == "fused":
        kernel = runtime.get_function("twell_gate_wgmma.cu", "twell_gate_wgmma", device)
        runtime.set_dynamic_smem(kernel, GATE_SMEM_BYTES)
        items = math.ceil(m / (GATE_CLUSTER * GATE_BLOCK_M)) * (n // TILE)
        w_map = tensor_map.bf16_box_map(w_gate_NK, TILE // GATE_CLUSTER)
        operands = (runtime.ptr(packed_MS), runtime.ptr(overflow_gate_MN))
        args = (tensor_map.bf16_box_map(x_MK, GATE_BLOCK_M), w_map, *operands, _i32(m), _i32(n), _i32(k))
        grid = (GATE_CLUSTER * min(items, runtime.sm_count(device) // GATE_CLUSTER),)  # persistent: clusters walk items
        runtime.launch(kernel, grid, (GATE_THREADS,), args, device, shared_mem=GATE_SMEM_BYTES)
    else:
        gate_MN = F.linear(x_MK, w_gate_NK)
        twell_pack(gate_MN, out=packed_MS)
    return packed_MS


def twell_pack(gate_MN: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the positives of a bf16 pre-activation gate [M, N] into TwELL int32 [M, (N/256) * 32] on the GPU."""
    if gate_MN.dtype != torch.bfloat16 or gate_MN.dim() != 2 or not gate_MN.is_contiguous():
        raise ValueError(
            f"gate_MN must be a contiguous 2-D bf16 tensor, got {gate_MN.dtype} {tuple(gate_MN.shape)}"
        )
    m, n = gate_MN.shape
    if n % TILE != 0 or n > MAX_N:
        raise ValueError(f"gate_MN has N={n} columns; TwELL needs a multiple of {TILE} up to {MAX_N}")
    if out is None:
        out = torch.empty(m, n // TILE * SLOTS, dtype=torch.int32, device=gate_MN.device)
    segments = m * (n // TILE)
    if segments:
        kernel = runtime.get_function("twell_pack.cu", "twell_pack_dense", gate_MN.device)
        args = (runtime.ptr(gate_MN), runtime.ptr(out), _i32(m), _i32(n))
        runtime.launch(kernel, (math.ceil(segments / 8),), (256,), args, gate_MN.device)
    return out


@dataclass
class UpDownResult:
    """Output of `twell_up_down`.

    Attributes:
        y_MK: bf16 [M, K]; rows with overflow_M set are zeros (the caller recomputes them).
        l1_M: fp32 [M] sum |h| per token (0 on overflow rows).
        l0_M: int32 [M] non-zeros of h per token (0 on overflow rows).
        fired_N: int32 [N] 1 for neurons with h != 0 in some non-overflow row, else 0.
        dense_M: int32 [M] tokens left for the dense path: 1 = a tile holds more than 31 positives
            (overflow), 2 = more than `dense_row_nnz` non-zeros (heavy token), else 0.
    """

    y_MK: torch.Tensor
    l1_M: torch.Tensor
    l0_M: torch.Tensor
    fired_N: torch.Tensor
    dense_M: torch.Tensor


def splits_for(m: int, n_tiles: int) -> int:
    """Warps per token in the up+down kernel: 1 for large M, more for decode-sized M to fill the GPU."""
    if m >= SPLIT_BELOW_M:
        return 1
    return max(1, min(n_tiles, math.ceil(SPLIT_BELOW_M / max(m, 1))))


def twell_up_down(
    x_MK: torch.Tensor,
    packed_MS: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    dense_row_nnz: int = DENSE_ROW_NNZ,
) -> UpDownResult:
    """h = g * (x w_up^T) at the packed non-zeros of g, and y = h w_down^T, without a dense hidden.

    Args:
        x_MK: bf16 [M, K]. packed_MS: int32 [M, (N/256) * 32] from `twell_gate`.
        w_up_NK: bf16 [N, K] (up_proj.weight). w_down_t_NK: bf16 [N, K], the transpose of down_proj.weight.
        dense_row_nnz: tokens with more gate non-zeros than this are left to the dense path.
    """
    m, k = x_MK.shape
    n = w_up_NK.shape[0]
    n_tiles = n // TILE
    device = x_MK.device
    splits = splits_for(m, n_tiles)
    # One zeroed int32 workspace for all statistics (one fill instead of four): l0 | l1 (fp32 bits) | dense | fired.
    stats = torch.zeros(3 * m + n, dtype=torch.int32, device=device)
    l0_M, l1_M, dense_M, fired_N = (
        stats[:m],
        stats[m : 2 * m].view(torch.float32),
        stats[2 * m : 3 * m],
        stats[3 * m :],
    )
    y_MK = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    if m:
        y_partial = torch.empty((splits, m, k) if splits > 1 else (1,), dtype=torch.float32, device=device)
        kv = math.ceil(k / 256)
        kernel = runtime.get_function("twell_up_down.cu", f"twell_up_down<{kv}>", device)
        args = (
            runtime.ptr(packed_MS), runtime.ptr(x_MK), runtime.ptr(w_up_NK), runtime.ptr(w_down_t_NK),
            runtime.ptr(y_MK), runtime.ptr(y_partial), runtime.ptr(l1_M), runtime.ptr(l0_M),
            runtime.ptr(fired_N), runtime.ptr(dense_M), _i32(m), _i32(k), _i32(n_tiles), _i32(dense_row_nnz),
        )  # fmt: skip
        grid = (math.ceil(m / TOKENS_PER_BLOCK), splits)
        smem = TOKENS_PER_BLOCK * (kv * 32 * 16 + UP_DOWN_WORD_BATCH * SLOTS * 4)  # x row + packed words
        runtime.launch(kernel, grid, (32 * TOKENS_PER_BLOCK,), args, device, shared_mem=smem)
        if splits > 1:
            reduce = runtime.get_function("twell_up_down.cu", "twell_reduce_splits", device)
            mk = m * k
            args = (runtime.ptr(y_partial), runtime.ptr(y_MK), _i32(splits), np.int64(mk))
            runtime.launch(reduce, (math.ceil(mk / 1024),), (256,), args, device)
    return UpDownResult(y_MK=y_MK, l1_M=l1_M, l0_M=l0_M, fired_N=fired_N, dense_M=dense_M)


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


def flagged_parts(columns: Columns) -> list[tuple[tuple[int, int], int]]:
    """Each column range of a walk in parts with its FIRST_PART / LAST_PART flags, in walking order."""
    last = len(columns) - 1
    return [(c, (FIRST_PART if i == 0 else 0) | (LAST_PART if i == last else 0)) for i, c in enumerate(columns)]


@dataclass(frozen=True)
class OutputNorm:
    """An RMSNorm that the "rows" walk applies to the y rows as it stores them: out_MK = F.rms_norm(y_MK, (K,),
    weight_K, eps) (bf16 [M, K]; weight_K bf16 [K]), as close to it as one rounding. A decoder layer hands its FFN the
    next layer's input norm this way, so that norm does not read the residual stream back (FusedDecoderLayer)."""

    weight_K: torch.Tensor
    eps: float
    out_MK: torch.Tensor


def norm_args(norm: OutputNorm | None) -> tuple[np.uint64, np.uint64, np.float32]:
    """The kernels' (norm_weight, normed, norm_eps) arguments: null pointers without a norm."""
    if norm is None:
        return runtime.ptr(None), runtime.ptr(None), np.float32(0.0)
    return runtime.ptr(norm.weight_K), runtime.ptr(norm.out_MK), np.float32(norm.eps)


def direct_up_down(
    x_MK: torch.Tensor,
    gate_MN: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    split_nnz: int = DENSE_ROW_NNZ,
    residual_MK: torch.Tensor | None = None,
    parts: int | None = None,
    walk: str = "rows",
    dense_rows: int = 0,
    norm: OutputNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = g * (x w_up^T) at the positives g of the pre-activation gate, and y = h w_down^T.

    Args:
        x_MK: bf16 [M, K]. gate_MN: bf16 [M, N] = x w_gate^T (before ReLU).
        w_up_NK: bf16 [N, K] (up_proj.weight). w_down_t_NK: bf16 [N, K], the transpose of down_proj.weight.
        split_nnz: tokens with more positives than this (capped at DIRECT_LIST_CAP) are heavy: computed by the
            dense rows (`dense_rows`), past them split over a block of warps. Below SPLIT_BELOW_M tokens every token
            with a positive is split, to fill the GPU.
        residual_MK: bf16 [M, K] added to y by the kernels (a decoder layer's residual stream), or None.
        parts: column parts the "rows" walk takes one after the other (`column_parts`; None: by the weights'
            size). A token that stays on the one-warp path gets the same bits whatever the parts.
        walk: "rows" (kernels/gate_up_down.cu) or "slices" (kernels/gate_up_then_down.cu; needs `slice_width(N)`),
            see WALKS. "slices" rounds each h to bf16 between its two kernels, as the dense bf16 block does.
        dense_rows: rows reserved for the split tokens' dense GEMMs (`dense_heavy_rows`; `dense_row_capacity` sizes
            it from a layer's density); split tokens past it, and all of them at 0, are split over warps. A walk in
            several column parts splits them over warps whatever this says. With more split tokens than rows, which
            of them get the rows follows the order the walk lists them in, which varies from call to call: their
            y rows may then differ between calls in the last bits (the dense and the split arithmetic round apart).
        norm: an RMSNorm of the y rows written into norm.out_MK as they are stored ("rows" walk only).

    Returns:
        (y_MK bf16, l1_M fp32 sum |h|, l0_M int32 #(h != 0), fired_N int32 0/1), with no host sync. With a
        residual, y_MK = residual_MK + y rounded as the two unfused bf16 steps (bit for bit).

    Raises TypeError/ValueError naming the bad argument, as `check_inputs` does.
    """
    if walk not in WALKS:
        raise ValueError(f"walk={walk!r} is not valid; use one of {WALKS}")
    _check_2d(x_MK, "x_MK", "[M, K]; flatten leading dims with x.reshape(-1, K)")
    _check_2d(gate_MN, "gate_MN", "[M, N], the pre-activation gate x w_gate^T")
    m, k = x_MK.shape
    n = gate_MN.shape[1]
    if norm is not None:
        _check_output_norm(norm, x_MK, walk)
    _check_operands(x_MK, n, [
        ("gate_MN", gate_MN, (m, n), "the pre-activation gate x w_gate^T [M, N]"),
        ("w_up_NK", w_up_NK, (n, k), "up_proj.weight in nn.Linear layout [N, K]"),
        ("w_down_t_NK", w_down_t_NK, (n, k), "down_proj.weight transposed to [N, K], contiguous"),
        *([("residual_MK", residual_MK, (m, k), "the residual stream [M, K], bf16, contiguous")]
          if residual_MK is not None else []),
    ])  # fmt: skip
    columns = column_parts(k, n, parts)  # checks `parts`
    if walk == "slices" and slice_width(n) is None:
        raise ValueError(f"walk='slices': a slice of w_down's N={n} rows does not fit shared memory; use walk='rows'")
    if isinstance(dense_rows, bool) or not isinstance(dense_rows, int) or dense_rows < 0:
        raise ValueError(f"dense_rows={dense_rows!r}: give a row count >= 0 (0: no dense rows)")
    return _direct_up_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, split_nnz, residual_MK, columns, walk, dense_rows,
                           norm)  # fmt: skip


def _check_output_norm(norm: OutputNorm, x_MK: torch.Tensor, walk: str) -> None:
    if walk != "rows":
        raise ValueError(f"norm: walk={walk!r} stores y in column slices, a row at a time only walk='rows' can norm it")
    m, k = x_MK.shape
    _check_tensor(norm.weight_K, "norm.weight_K", (k,), "the RMSNorm weight [K]")
    _check_tensor(norm.out_MK, "norm.out_MK", (m, k), "the normed rows [M, K]")
    for name, t in (("norm.weight_K", norm.weight_K), ("norm.out_MK", norm.out_MK)):
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")


def _direct_up_down(
    x_MK: torch.Tensor, gate_MN: torch.Tensor, w_up_NK: torch.Tensor, w_down_t_NK: torch.Tensor, split_nnz: int,
    residual_MK: torch.Tensor | None = None, columns: Columns | None = None, walk: str = "rows", dense_rows: int = 0,
    norm: OutputNorm | None = None, packed_MS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`direct_up_down` on operands already validated (the block op checks its inputs once); columns: the
    "rows" walk's column parts (`column_parts`; None: by the weights' size); norm: "rows" only. packed_MS: the gate's
    TwELL words from the fused GEMM (`twell_gate` with gate_MN as its overflow_gate_MN), which either walk then lists
    from; gate_MN is then only a buffer the walk completes its heavy tokens' rows in, for the dense paths."""
    m, k = x_MK.shape
    n = gate_MN.shape[1]
    if walk == "slices":
        columns = [(0, n)]  # one pass: the slices hold every row of w_down
    elif columns is None:
        columns = column_parts(k, n)
    device = x_MK.device
    y_MK = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    l1_M = torch.empty(m, dtype=torch.float32, device=device)
    l0_M = torch.empty(m, dtype=torch.int32, device=device)
    zeroed = torch.zeros(n + len(columns), dtype=torch.int32, device=device)  # one fill: fired_N | heavy counts
    fired_N, heavy_counts = zeroed[:n], zeroed[n:]
    if m == 0:
        return y_MK, l1_M, l0_M, fired_N
    heavy_rows_M = torch.empty(m, dtype=torch.int32, device=device)
    outs = (y_MK, l1_M, l0_M, fired_N)
    dense_rows = min(dense_rows, m) if len(columns) == 1 else 0

    def split_tokens(count_1: torch.Tensor, **part: object) -> None:
        rows_M = heavy_rows_M
        if dense_rows:
            rows_M, count_1 = dense_heavy_rows(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, residual_MK,
                                               dense_rows, norm)  # fmt: skip
        split_token_up_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, residual_MK, norm=norm,
                            **part)  # fmt: skip

    if walk == "slices":
        _up_then_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, split_nnz, residual_MK, outs, heavy_rows_M, heavy_counts,
                      packed_MS)  # fmt: skip
        split_tokens(heavy_counts)
        return outs
    # the y sums carried from one part to the next
    partial_MK = torch.empty(m, k, dtype=torch.float32, device=device) if len(columns) > 1 else None
    split = 0 if m < SPLIT_BELOW_M else max(0, min(split_nnz, DIRECT_LIST_CAP))
    kv = math.ceil(k / 256)
    packed, gate, heavy_gate = _listed_gate(gate_MN, packed_MS)
    light = runtime.get_function("gate_up_down.cu", f"gate_up_down_light<{kv},{packed}>", device)
    smem = light_smem_bytes(kv, residual_MK is not None)
    runtime.set_dynamic_smem(light, smem)
    for i, ((begin, end), part) in enumerate(flagged_parts(columns)):
        count_1 = heavy_counts[i : i + 1]
        operands = (gate, heavy_gate, x_MK, w_up_NK, w_down_t_NK, y_MK, residual_MK, l1_M, l0_M, fired_N, heavy_rows_M,
                    count_1, partial_MK)  # fmt: skip
        args = (*(runtime.ptr(t) for t in operands), *map(_i32, (m, k, n, split, begin, end, part)), *norm_args(norm))
        runtime.launch(light, (m,), (32,), args, device, shared_mem=smem)
        split_tokens(count_1, partial_MK=partial_MK, columns=(begin, end), part=part)
    return outs


def _listed_gate(
    gate_MN: torch.Tensor, packed_MS: torch.Tensor | None
) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """A walk kernel's PACKED template argument, the gate it lists positives from and its heavy tokens' gate buffer:
    ("false", gate_MN, None) for cuBLAS's bf16 gate, ("true", packed_MS, gate_MN) for the fused GEMM's TwELL words."""
    return ("false", gate_MN, None) if packed_MS is None else ("true", packed_MS, gate_MN)


def light_smem_bytes(kv: int, residual: bool) -> int:
    """Shared memory of one gate_up_down_light warp (light_list_offset / light_residual_offset in gate_up_down.cu):
    its ring's slots and the x row (KV * 512 bytes each; 2 slots up to KV = 8, else 3), the list, the barriers padded
    to 128 bytes, and with a residual its row."""
    slots = 2 if kv <= 8 else 3
    return (slots + 1 + residual) * kv * 512 + DIRECT_LIST_CAP * 4 + 128


def _up_then_down(
    x_MK: torch.Tensor, gate_MN: torch.Tensor, w_up_NK: torch.Tensor, w_down_t_NK: torch.Tensor, split_nnz: int,
    residual_MK: torch.Tensor | None, outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    heavy_rows_M: torch.Tensor, count_1: torch.Tensor, packed_MS: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The light tokens of the "slices" walk (kernels/gate_up_then_down.cu) into outs = (y_MK, l1_M, l0_M, fired_N) as
    `_direct_up_down` allocates them: the up walk lists each token's positives and writes its h entries (a token with
    more than split_nnz goes to heavy_rows_M, counted in count_1, for the caller), the tokens are ordered by count in
    groups of ORDER_GROUP, then one block per SM computes slices of y from the ordered entries. The up walk lists the
    positives from the bf16 pre-activation gate_MN, or where given from its TwELL words packed_MS (int32 [M, (N/256) *
    32], `twell_gate` with gate_MN as its overflow_gate_MN): tokens with an overflowed segment are heavy too, and the
    walk completes every heavy token's row of gate_MN for the dense paths that read it."""
    m, k = x_MK.shape
    n = w_up_NK.shape[0]
    device = x_MK.device
    ks = slice_width(n)
    y_MK, l1_M, l0_M, fired_N = outs
    chunks = math.ceil(m / 32)
    # h entries, [chunk][slot / 4][token][slot % 4] (entry_slot in the kernel), in token order then in slot order
    entries, slot_entries = torch.empty(2, chunks * DIRECT_LIST_CAP * 32, dtype=torch.int32, device=device)
    counts_M = torch.empty(m, dtype=torch.int32, device=device)
    kv = math.ceil(k / 256)
    packed, gate, heavy_gate = _listed_gate(gate_MN, packed_MS)
    up = runtime.get_function("gate_up_then_down.cu", f"gate_up_entries<{kv},{packed}>", device)
    split = max(0, min(split_nnz, DIRECT_LIST_CAP))
    operands = (gate, heavy_gate, x_MK, w_up_NK, entries, counts_M, l1_M, l0_M, fired_N, heavy_rows_M, count_1)
    args = (*(runtime.ptr(t) for t in operands), *map(_i32, (m, k, n, split, ks // 8)))
    # two row slots, the list, two barriers (up_barriers_offset in the kernel)
    runtime.launch(up, (m,), (32,), args, device, shared_mem=2 * kv * 512 + DIRECT_LIST_CAP * 4 + 16)
    token_slots_M, slot_counts_M, slot_tokens_M = order_slots(counts_M)
    to_slots = runtime.get_function("gate_up_then_down.cu", "entries_to_slots", device)
    operands = (entries, counts_M, token_slots_M, slot_entries)
    fours = chunks * 32 * DIRECT_LIST_CAP // 4  # one thread per 16 bytes of entries; a multiple of 256
    runtime.launch(to_slots, (fours // 256,), (256,), (*map(runtime.ptr, operands), _i32(m)), device)
    slices_down(slot_entries, slot_counts_M, slot_tokens_M, w_down_t_NK, y_MK, residual_MK)


def order_slots(counts_M: torch.Tensor, heavy_M: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(token_slots_M, slot_counts_M, slot_tokens_M), int32 [M] each: order_tokens's places for the tokens of
    counts_M (int32 [M] entries per token, -1 or heavy_M (bool [M]) for a token with none on the slices walk), by
    descending count within groups of ORDER_GROUP."""
    m = counts_M.shape[0]
    token_slots_M, slot_counts_M, slot_tokens_M = torch.empty(3, m, dtype=torch.int32, device=counts_M.device)
    order = runtime.get_function("gate_up_then_down.cu", "order_tokens", counts_M.device)
    operands = (counts_M, heavy_M, token_slots_M, slot_counts_M, slot_tokens_M)
    runtime.launch(order, (math.ceil(m / ORDER_GROUP),), (ORDER_GROUP,), (*map(runtime.ptr, operands), _i32(m)),
                counts_M.device)  # fmt: skip
    return token_slots_M, slot_counts_M, slot_tokens_M


def slices_down(
    slot_entries: torch.Tensor, slot_counts_M: torch.Tensor, slot_tokens_M: torch.Tensor, w_NK: torch.Tensor,
    out_MK: torch.Tensor | None, residual_MK: torch.Tensor | None = None, sums_in_SK: torch.Tensor | None = None,
    sums_out_SK: torch.Tensor | None = None, slots: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """entries_down: out_MK[t] (bf16 [M, K]; residual_MK's row added) = sum over slot entries (value, n) of token t of
    value * w_NK[n] (bf16 [N, K]), one block per SM holding slice_width(N) columns of w_NK at a time. Tokens whose
    slot count is -1 are left unwritten. With fp32 sums (the training backward's two passes), over the slots
    slots = (s0, s1) (multiples of ORDER_GROUP, or s1 = M; they hold tokens s0 .. s1 - 1): the rows start from
    sums_in_SK's and go to sums_out_SK (fp32 [s1 - s0, K], row t - s0 for token t) in place of out_MK."""
    m, (n, k), device = slot_counts_M.shape[0], w_NK.shape, w_NK.device
    s0, s1 = (0, m) if slots is None else slots
    ks = slice_width(n)
    sums = sums_in_SK is not None or sums_out_SK is not None
    down = runtime.get_function("gate_up_then_down.cu", f"entries_down<{ks},{str(sums).lower()}>", device)
    smem = (n + 1) * ks * 2  # the slice and its zero row
    runtime.set_dynamic_smem(down, smem)
    blocks = min(runtime.sm_count(device), k // ks * math.ceil((s1 - s0) / 32))
    entries = slot_entries[s0 * DIRECT_LIST_CAP :]  # chunks of 32 slots, DIRECT_LIST_CAP entries each
    operands = (entries, slot_counts_M[s0:s1], slot_tokens_M[s0:s1], w_NK, out_MK, residual_MK, sums_in_SK,
                sums_out_SK)  # fmt: skip
    args = (*map(runtime.ptr, operands), *map(_i32, (s1 - s0, k, n, s0)))
    runtime.launch(down, (blocks,), (1024,), args, device, shared_mem=smem)


def split_token_up_down(
    x_MK: torch.Tensor, gate_MN: torch.Tensor, w_up_NK: torch.Tensor, w_down_t_NK: torch.Tensor,
    rows_M: torch.Tensor, count_1: torch.Tensor, outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    residual_MK: torch.Tensor | None = None, partial_MK: torch.Tensor | None = None,
    columns: tuple[int, int] | None = None, part: int = FIRST_PART | LAST_PART, norm: OutputNorm | None = None,
) -> None:  # fmt: skip
    """Writes the y, l1 and l0 rows of the tokens rows_M[: count_1[0]] and sets their fired neurons, each token
    split over a block of warps (gate_up_down_heavy). rows_M: int32 [M]; count_1: int32 [1], read on the device,
    so the host never learns it. outs = (y_MK, l1_M, l0_M, fired_N) as `_direct_up_down` allocates them; y rows
    include residual_MK's (bf16 [M, K]) when given. For one column part of several (`_direct_up_down`): columns
    = (begin, end), part = its FIRST_PART / LAST_PART flags, partial_MK = the fp32 y sums carried between parts.
    norm: the RMSNorm of the y rows the last part stores, written beside them."""
    m, k = x_MK.shape
    n = gate_MN.shape[1]
    device = x_MK.device
    kv = math.ceil(k / 256)
    heavy = runtime.get_function("gate_up_down.cu", f"gate_up_down_heavy<{kv}>", device)
    warps = 16 if kv <= 8 else 8  # heavy_warps<KV>() in gate_up_down.cu: warps sharing one heavy token
    # x row | partial fp32 rows for half the warps | a 256-entry list per warp | per-warp l1 and l0
    smem = kv * 32 * 16 + warps // 2 * kv * 256 * 4 + warps * (256 * 4 + 8)
    runtime.set_dynamic_smem(heavy, smem)
    blocks = min(m, runtime.sm_count(device))  # one block per SM
    y_MK, *stats = outs
    begin, end = (0, n) if columns is None else columns
    operands = (gate_MN, x_MK, w_up_NK, w_down_t_NK, y_MK, residual_MK, *stats, rows_M, count_1, partial_MK)
    args = (*(runtime.ptr(t) for t in operands), *map(_i32, (k, n, begin, end, part)), *norm_args(norm))
    runtime.launch(heavy, (blocks,), (32 * warps,), args, device, shared_mem=smem)


def decode_kernel_name(kv: int, block_sums: bool, mma_gate: bool, finish: bool) -> str:
    """decode_ffn's instantiation for rows of kv 256-column pieces, summing y per block or not, gates on the tensor
    cores or not, its last block writing y or not (decode_finish does then)."""
    flags = ",".join(str(flag).lower() for flag in (block_sums, mma_gate, finish))
    return f"decode_ffn<{kv},{flags}>"


def decode_workspace_words(k: int, tokens: int = DECODE_MAX_M) -> tuple[int, int, int, int]:
    """Where the decode workspace for up to `tokens` rows of K columns (kernels/decode_ffn.cu) keeps l1, l0 and the
    counts of blocks done (one per group of tokens), in fp32 words from its start, and its size; its rows of y sums
    come first, the counts last."""
    done_at = tokens * (k + 2)
    return tokens * k, tokens * (k + 1), done_at, done_at + math.ceil(tokens / DECODE_GROUP_M)


def decode_workspace(device: torch.device, k: int) -> torch.Tensor:
    """On CUDA `device` (with its index), the zeroed fp32 workspace of `decode_ffn` calls issued from Python, for rows
    of K columns (`decode_workspace_words`), which each such call leaves zeroed. One per device, stream and K, made on
    first use: calls on one stream run in turn, so they can share it."""
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), k)
    workspace = _DECODE_WORKSPACES.get(key)
    if workspace is None:
        size = decode_workspace_words(k)[-1]
        workspace = _DECODE_WORKSPACES[key] = torch.zeros(size, dtype=torch.float32, device=device)
    return workspace


_DECODE_WORKSPACES: dict[tuple[int, int, int], torch.Tensor] = {}


def decode_ffn(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, w_up_NK: torch.Tensor, w_down_t_NK: torch.Tensor,
    residual_MK: torch.Tensor | None = None, l0_max: float | None = None, statistics: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The block for M <= DECODE_MAX_M tokens in one pass over the neurons per group of up to DECODE_GROUP_M tokens
    (kernels/decode_ffn.cu): (y_MK bf16 [M, K], plus residual_MK (bf16, contiguous) when given; l1_M fp32 [M]; l0_M
    int32 [M]; fired_N int32 [N]), the last three None without `statistics`. w_down_t_NK: bf16 [N, K], the transpose
    of down_proj.weight. l0_max: the most non-zeros a token of the layer has had recently (None: unknown), which sets
    how the kernel sums y (`decode_block_sums`).

    Issued from Python the call is one launch, whose last block writes y (see the kernel's header); captured in a CUDA
    graph, decode_finish writes it."""
    (m, k), n, device = x_MK.shape, w_gate_NK.shape[0], x_MK.device
    if not 1 <= m <= DECODE_MAX_M:
        raise ValueError(f"decode_ffn takes 1 to {DECODE_MAX_M} tokens, got M={m}")
    groups = math.ceil(m / DECODE_GROUP_M)
    graphed = torch._C._cuda_isCurrentStreamCapturing()
    # A graph being captured zeroes a workspace of its own, for its M tokens: the graph owns it, and may be replayed on
    # any stream.
    l1_at, l0_at, done_at, size = decode_workspace_words(k, m if graphed else DECODE_MAX_M)
    workspace = torch.zeros(size, dtype=torch.float32, device=device) if graphed else decode_workspace(device, k)
    y_MK = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    # The kernel writes each neuron's flag for one group; for more, it sets the firing ones in flags zeroed here.
    flags = torch.empty if groups == 1 else torch.zeros
    l1_M = l0_M = fired_N = None
    if statistics and graphed:  # l1 and l0 stay in the graph's own workspace
        fired_N = flags(n, dtype=torch.int32, device=device)
        l1_M, l0_M = workspace[l1_at : l1_at + m], workspace[l0_at : l0_at + m].view(torch.int32)
    elif statistics:  # one allocation for the three
        stats = flags(2 * m + n, dtype=torch.int32, device=device)
        l1_M, l0_M, fired_N = stats[:m].view(torch.float32), stats[m : 2 * m], stats[2 * m :]
    kv = math.ceil(k / 256)
    block_sums, mma_gate = decode_block_sums(m, k, l0_max), decode_mma_gate(m)
    kernel = runtime.get_function("decode_ffn.cu", decode_kernel_name(kv, block_sums, mma_gate, not graphed), device)
    # A group's x rows, each warp's g / h values (of 8 neurons at a time with the tensor-core gate) and, with block
    # sums, the block's fp32 rows of y.
    staged = min(m, DECODE_GROUP_M)
    values = DECODE_WARPS * DECODE_GROUP_M * 4 * (DECODE_MMA_NEURONS if mma_gate else 1)
    smem = staged * kv * 512 + values + (staged * kv * 1024 if block_sums else 0)
    runtime.set_dynamic_smem(kernel, smem)
    # the groups share the GPU's blocks: each still has more warps than a layer of 5632 neurons has 8-neuron tiles
    blocks = max(1, min(math.ceil(n / DECODE_WARPS), DECODE_BLOCKS_PER_SM * runtime.sm_count(device) // groups))
    outs = (None, None, None) if graphed else (y_MK, l1_M, l0_M)
    base = workspace.data_ptr()
    parts = (np.uint64(base + 4 * words) for words in (0, l1_at, l0_at, done_at))  # y sums, l1, l0, counts
    operands = (x_MK, w_gate_NK, w_up_NK, w_down_t_NK)
    args = (*map(runtime.ptr, operands), *parts, *map(runtime.ptr, (residual_MK, *outs, fired_N)), _i32(m), _i32(k), _i32(n))
    runtime.launch(kernel, (blocks, groups), (DECODE_WARPS * 32,), args, device, shared_mem=smem)
    if graphed:
        pieces = m * k // 8
        blocks = min(math.ceil(pieces / DECODE_FINISH_THREADS), runtime.sm_count(device))
        args = (runtime.ptr(workspace), runtime.ptr(residual_MK), runtime.ptr(y_MK), _i32(pieces))
        finish = runtime.get_function("decode_ffn.cu", "decode_finish", device)
        runtime.launch(finish, (blocks,), (DECODE_FINISH_THREADS,), args, device)
    return y_MK, l1_M, l0_M, fired_N


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


def dense_heavy_rows(
    x_MK: torch.Tensor, gate_MN: torch.Tensor, w_up_NK: torch.Tensor, w_down_t_NK: torch.Tensor,
    rows_M: torch.Tensor, count_1: torch.Tensor, outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    residual_MK: torch.Tensor | None, capacity: int, norm: OutputNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The first min(count_1[0], capacity) heavy tokens rows_M lists (gate_up_down_light's list; the count stays on the
    device) through dense GEMMs: their y rows (with residual_MK's row when given), l1, l0 and fired neurons go into
    outs = (y_MK, l1_M, l0_M, fired_N) with the dense bf16 block's rounding (kernels/dense_rows.cu), and their norm's
    rows into norm.out_MK when given.

    Returns (rows, count_1) of the heavy tokens past the capacity, for `split_token_up_down`."""
    k, n, device = x_MK.shape[1], gate_MN.shape[1], x_MK.device
    y_MK, l1_M, l0_M, fired_N = outs
    x_CK = torch.empty(capacity, k, dtype=torch.bfloat16, device=device)
    rest_1 = torch.empty(1, dtype=torch.int32, device=device)
    grid, block = (capacity,), (DENSE_ROWS_THREADS,)
    gather = runtime.get_function("dense_rows.cu", "gather_dense_rows", device)
    operands = (x_MK, rows_M, count_1, x_CK, rest_1)
    runtime.launch(gather, grid, block, (*map(runtime.ptr, operands), _i32(capacity), _i32(k)), device)
    h_CN = F.linear(x_CK, w_up_NK)  # u, made h in place
    hidden = runtime.get_function("dense_rows.cu", "dense_rows_h", device)
    operands = (gate_MN, rows_M, count_1, h_CN, l1_M, l0_M, fired_N)
    runtime.launch(hidden, grid, block, (*map(runtime.ptr, operands), _i32(capacity), _i32(n)), device)
    y_CK = torch.mm(h_CN, w_down_t_NK)
    scatter = runtime.get_function("dense_rows.cu", "scatter_dense_rows", device)
    operands = (y_CK, rows_M, count_1, residual_MK, y_MK)
    runtime.launch(scatter, grid, block, (*map(runtime.ptr, operands), _i32(capacity), _i32(k), *norm_args(norm)), device)
    return rows_M[capacity:], rest_1


def dense_row_stats(h_RN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum |h| per row in fp32 [R], non-zeros per row int32 [R], fired neurons bool [N]) of a dense h [R, N]."""
    nonzero_RN = h_RN != 0
    return h_RN.float().abs().sum(dim=1), nonzero_RN.sum(dim=1, dtype=torch.int32), nonzero_RN.any(dim=0)


def twell_gated_mlp(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    gate_route: str = "auto",
    dense_row_nnz: int = DENSE_ROW_NNZ,
    residual_MK: torch.Tensor | None = None,
    l0_hint: tuple[float, float] | None = None,
    statistics: bool = True,
    tail: Tail | None = None,
    output_norm: tuple[torch.Tensor, float] | None = None,
) -> FFNResult:
    """The gated FFN block for inference through TwELL kernels; exact at any sparsity.

    Args:
        x_MK: bf16 [M, K] tokens. w_gate_NK, w_up_NK: bf16 [N, K]; w_down_KN: bf16 [K, N] (nn.Linear layouts).
        gate_route: "auto" (= "direct", or for up to DECODE_MAX_M tokens `decode_ffn`), "direct", "cublas" or "fused"
            (see the module docstring).
        dense_row_nnz: tokens with more gate non-zeros than this are computed by dense GEMMs ("direct": as many as
            `dense_row_capacity` reserves, the others split over a block of warps; TwELL routes: all of them).
        residual_MK: [M, K] added to the output (a decoder layer's residual stream), or None. The "direct"
            kernels add a contiguous bf16 one as they store y (the same bits as adding it after).
        l0_hint: the layer's recent (mean, max) non-zeros per token, or None: sets the "direct" route's walk
            (`direct_walk`; where it prices slices ahead, `measured_walk` settles it unless `walk_choice` is "priced"),
            how many column parts a "rows" walk of a block that outgrows L2 takes (`column_parts`), and how many
            heavy tokens it computes by dense GEMMs (`dense_row_capacity`).
        tail: the layer's recent heavy tokens' shares (tokens above HEAVY_TOKEN_NNZ non-zeros), or None: sizes the
            "direct" route's dense rows (`dense_row_capacity`) and prices its walk more closely than `l0_hint` alone.
        statistics: False leaves l1_sum and fired_N None (the kernels write per-token sums and int32 flags; their
            reduction and conversion are two more kernels). l0_M is returned too, which the kernels write anyway,
            except by the decode kernel, whose call then allocates nothing but y.
        output_norm: (weight_K, eps) of an RMSNorm of the output rows (the next decoder layer's input norm): the
            "rows" walk writes it as it stores them, into the result's normed_MK (`OutputNorm`). Other walks and
            routes leave normed_MK None, as does a weight other than a contiguous bf16 [K] on x_MK's device.

    Returns:
        FFNResult. "direct": path "twell-direct" ("twell-slices" where it took the slices walk), overflow_rows 0
        (no token is recomputed). TwELL routes:
        tokens with an overflowed tile (counted in `overflow_rows`) and heavy tokens were computed by
        dense torch GEMMs; `path` is "twell+dense-rows" when there were any.
    """
    check_inputs(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    _check_gate_route(gate_route, MLP_ROUTES)
    fusable = residual_MK is not None and _check_residual(residual_MK, x_MK)
    fused = residual_MK if fusable else None
    if gate_route == "auto" and 0 < x_MK.shape[0] <= DECODE_MAX_M:
        y_MK, l1_M, l0_M, fired_N = decode_ffn(
            x_MK, w_gate_NK, w_up_NK, _DOWN_T.get(w_down_KN), fused, None if l0_hint is None else l0_hint[1], statistics
        )
        return _finished(y_MK, l1_M, l0_M, fired_N, residual_MK if fused is None else None, statistics, "twell-decode")
    if gate_route in ("auto", "direct"):
        (m, k), n = x_MK.shape, w_gate_NK.shape[0]
        walk = direct_walk(m, k, n, l0_hint, tail)
        trial = (m, k, n, _mean_bucket(l0_hint[0])) if walk == "slices" and walk_choice() == "measured" else None
        if trial in _measured_walks:
            walk, trial = _measured_walks[trial], None
        # Once the walk is known, its gate GEMM goes out before the host's other work for the call: an isolated call's
        # GPU idles until its first kernel.
        gate = None if trial is not None else _direct_gate(x_MK, w_gate_NK, walk)
        # the gate and the cached transpose are well formed by construction: no second validation
        w_down_t_NK = _DOWN_T.get(w_down_KN)
        dense_rows = dense_row_capacity(m, l0_hint, dense_row_nnz, tail)
        # the norm of the rows as the kernels store them: not where the caller adds the residual afterwards
        norm = _output_norm(output_norm, x_MK) if fused is not None or residual_MK is None else None

        def walk_through(
            walk: str, gate: tuple[torch.Tensor, torch.Tensor | None] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            """The block through `walk`, from `gate` (`_direct_gate`'s for that walk) where it was issued already."""
            columns = None if walk == "slices" else column_parts(k, n, l0_mean=None if l0_hint is None else l0_hint[0])
            gate_MN, packed_MS = _direct_gate(x_MK, w_gate_NK, walk) if gate is None else gate
            return _direct_up_down(
                x_MK, gate_MN, w_up_NK, w_down_t_NK, dense_row_nnz, fused, columns, walk=walk, dense_rows=dense_rows,
                norm=norm if walk == "rows" else None, packed_MS=packed_MS,
            )  # fmt: skip

        if trial is not None:
            walk = measured_walk(trial, walk_through)
        path = "twell-slices" if walk == "slices" else "twell-direct"
        result = _finished(*walk_through(walk, gate), residual_MK if fused is None else None, statistics, path)
        if norm is not None and walk == "rows":
            result.normed_MK = norm.out_MK
        return result
    packed_MS = twell_gate(x_MK, w_gate_NK, gate_route)
    result = twell_up_down(x_MK, packed_MS, w_up_NK, _DOWN_T.get(w_down_KN), dense_row_nnz)
    dense_rows_R = result.dense_M.nonzero()[:, 0]  # the call's one device-to-host sync
    overflow_rows = 0
    y_MK, l1_M, l0_M, fired_N = result.y_MK, result.l1_M, result.l0_M, result.fired_N.bool()
    if dense_rows_R.numel():
        overflow_rows = int((result.dense_M.index_select(0, dense_rows_R) == 1).sum())
        x_RK = x_MK.index_select(0, dense_rows_R)
        h_RN = F.relu(F.linear(x_RK, w_gate_NK)) * F.linear(x_RK, w_up_NK)
        y_MK.index_copy_(0, dense_rows_R, F.linear(h_RN, w_down_KN))
        l1_R, l0_R, fired_rows_N = dense_row_stats(h_RN)
        l1_M.index_copy_(0, dense_rows_R, l1_R)
        l0_M.index_copy_(0, dense_rows_R, l0_R)
        fired_N |= fired_rows_N
    return FFNResult(
        y_MK=y_MK if residual_MK is None else residual_MK + y_MK,
        l1_sum=l1_M.sum() if statistics else None,
        l0_M=l0_M,
        fired_N=fired_N if statistics else None,
        path="twell+dense-rows" if dense_rows_R.numel() else "twell",
        overflow_rows=overflow_rows,
    )


def _direct_gate(x_MK: torch.Tensor, w_gate_NK: torch.Tensor, walk: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The direct route's gate for its walk: (gate_MN, packed_MS). The walks list from the fused GEMM's TwELL words
    (the "slices" walk always, the "rows" walk from WORDS_GATE_MIN_M tokens), which spare them the dense row's read and
    the GEMM its write (the slices block 0-5% faster at 28 and 56 non-zeros with the same bits, H100, docs/benchmarks.md
    2026-11-28); gate_MN is then only a buffer for the heavy tokens' rows, written on the device. Otherwise, and for
    operands the copy engine cannot read (not `tensor_map.mappable`, e.g. not 16-byte aligned), the walk reads
    cuBLAS's bf16 pre-activation [M, N] (packed_MS None)."""
    words = walk == "slices" or x_MK.shape[0] >= WORDS_GATE_MIN_M
    if words and tensor_map.mappable(x_MK) and tensor_map.mappable(w_gate_NK):
        gate_MN = torch.empty(x_MK.shape[0], w_gate_NK.shape[0], dtype=torch.bfloat16, device=x_MK.device)
        return gate_MN, twell_gate(x_MK, w_gate_NK, "fused", overflow_gate_MN=gate_MN)
    return F.linear(x_MK, w_gate_NK), None


def _output_norm(output_norm: tuple[torch.Tensor, float] | None, x_MK: torch.Tensor) -> OutputNorm | None:
    """The OutputNorm the kernels can write for twell_gated_mlp's `output_norm`, or None (the caller norms)."""
    if output_norm is None:
        return None
    weight_K, eps = output_norm
    norm = OutputNorm(weight_K, float(eps), torch.empty_like(x_MK))
    try:
        _check_output_norm(norm, x_MK, "rows")
    except (TypeError, ValueError):  # a weight the kernels cannot read (dtype, shape, layout, device)
        return None
    return norm


def _finished(
    y_MK: torch.Tensor, l1_M: torch.Tensor, l0_M: torch.Tensor, fired_N: torch.Tensor,
    unfused_residual_MK: torch.Tensor | None, statistics: bool, path: str,
) -> FFNResult:
    """The result of a route whose kernels returned (y_MK, l1_M, l0_M, fired_N): the residual they could not fuse
    added to y, and the L1 sum and fired flags only where statistics were asked for."""
    if unfused_residual_MK is not None:
        y_MK = unfused_residual_MK + y_MK
    l1_sum, fired_N = (l1_M.sum(), fired_N.bool()) if statistics else (None, None)
    return FFNResult(y_MK=y_MK, l1_sum=l1_sum, l0_M=l0_M, fired_N=fired_N, path=path)


def walk_choice() -> str:
    """How a walk priced for slices is settled: SPARSE_LLM_TWELL_WALK, "measured" (default) or "priced"."""
    return env_choice(
        WALK_CHOICE_ENV,
        "measured: time both walks once per shape and density; priced: the cost model's choice, bit-reproducible",
    )


def _mean_bucket(l0_mean: float) -> int:
    return log_bucket(l0_mean, WALK_TRIAL_BUCKETS)


def measured_walk(key: tuple[int, int, int, int], walk_through: Callable[[str], object]) -> str:
    """The faster of the two walks for `key` (M, K, N, the density bucket): timed once per key (`best_times_ms`
    around `walk_through(walk)`, which runs the block through that walk on the calling layer's inputs), then
    remembered for every layer of that shape and density (a model's layers fire alike). The trial waits for the GPU
    once; while a CUDA graph is being captured it cannot, and the price's choice ("slices") stands."""
    if key in _measured_walks:
        return _measured_walks[key]
    if torch.cuda.is_current_stream_capturing():
        return "slices"
    best_ms = best_times_ms({walk: functools.partial(walk_through, walk) for walk in WALKS}, WALK_TRIAL_REPS)
    if len(_measured_walks) >= 4096:  # shapes x densities: a bound that one model never reaches
        _measured_walks.clear()
    _measured_walks[key] = min(best_ms, key=best_ms.get)
    return _measured_walks[key]


# ------------------------------------------------------------------------------------------------
# Backend
# ------------------------------------------------------------------------------------------------


def _bf16_autocast(device_type: str) -> bool:
    """Whether bf16 autocast is on for ``device_type`` (then dense GEMMs would run in bf16 too)."""
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


class TwellFFN(FFNBackend):
    """Inference through the TwELL kernels on Hopper GPUs (sm_90a) with bf16 tensors.

    Under bf16 autocast (e.g. validation of fp32 weights during training) the tensors are cast to bf16
    first, as autocast casts the dense GEMMs' inputs. Otherwise non-bf16 inference tensors are an error,
    not a silent dense fallback: `kernel=twell` promises the sparse kernels, and `kernel=auto` never sends
    them here (`accepts`). Where the GPU cannot run the kernels (CPU, other GPUs) a direct call runs the
    torch path instead, with one warning per reason and a `path` that says so; the dispatcher refuses a
    forced `kernel=twell` there before calling. Training casts under autocast (sparse_llm/ffn/twell/train_op.py).
    """

    name = "twell"

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return runtime.unavailable_reason(device)

    def accepts(self, x_MK: torch.Tensor, w_gate_NK: torch.Tensor, training: bool) -> bool:
        """Inference takes bf16 tokens and weights, or any under bf16 autocast; training casts by itself."""
        bf16 = x_MK.dtype == w_gate_NK.dtype == torch.bfloat16
        return training or bf16 or _bf16_autocast(x_MK.device.type)

    def forward(
        self, x_MK, w_gate_NK, w_up_NK, w_down_KN, *, training, statistics=True, compile_backend=None, residual_MK=None,
        residual_writable=False, l0=None, tail=None, output_norm=None,
    ):  # fmt: skip
        # The kernels add the residual as they write a fresh y: residual_writable only serves the torch fallback.
        if training:
            # The training op (sparse_llm/ffn/twell/train_op.py) imports this module's kernels: import it here.
            from sparse_llm.ffn.twell.train_op import twell_train_ffn

            result = twell_train_ffn(x_MK, w_gate_NK, w_up_NK, w_down_KN, l0_hint=l0, tail=tail)
            return with_residual(result, residual_MK)
        reason = self.unavailable_reason(x_MK.device)
        if reason is not None:
            if reason not in self._warned:
                warnings.warn(f"twell kernels not used ({reason}); using the dense torch path.", stacklevel=2)
                self._warned.add(reason)
            result = TorchFFN().forward(
                x_MK, w_gate_NK, w_up_NK, w_down_KN, training=False, statistics=statistics, residual_MK=residual_MK,
                residual_writable=residual_writable,
            )  # fmt: skip
            result.path = "torch (twell unavailable)"
            return result
        if _bf16_autocast(x_MK.device.type):
            x_MK, w_gate_NK, w_up_NK, w_down_KN = (
                t.to(torch.bfloat16) for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN)
            )
        weights = (w_gate_NK, w_up_NK, w_down_KN)
        if x_MK.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
            weight_dtypes = "/".join(sorted({str(w.dtype).removeprefix("torch.") for w in weights}))
            raise ValueError(
                f"kernel=twell: the TwELL inference kernels take bf16 tensors, got x "
                f"{str(x_MK.dtype).removeprefix('torch.')} and weights {weight_dtypes}. Load the model with "
                "dtype=bfloat16, or use kernel=auto (which runs such layers on the torch path)."
            )
        return twell_gated_mlp(
            x_MK, w_gate_NK, w_up_NK, w_down_KN, residual_MK=residual_MK, l0_hint=l0, statistics=statistics,
            tail=tail, output_norm=output_norm,
        )

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        if shape_unsupported_reason(k, n) is not None:  # (the kernels are the same whether the layer is compiled)
            return None
        if training:
            from sparse_llm.ffn.twell.train_op import train_estimated_ms

            return train_estimated_ms(m, k, n, l0_mean, l0_max)
        return twell_estimated_ms(m, k, n, l0_mean, l0_max, tail)


register_backend(TwellFFN())


# ------------------------------------------------------------------------------------------------
# Synthetic inputs with controlled gate sparsity (tests, benchmarks, the doctor)
# ------------------------------------------------------------------------------------------------


def synthetic_block(
    m: int,
    k: int,
    n: int,
    nnz_mean: float,
    sigma: float = 0.0,
    *,
    device: torch.device | str = "cuda",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 block operands (x_MK, w_gate_NK, w_up_NK, w_down_KN) whose gate has ~nnz_mean positives per token.

    Input feature 0 is the constant 1 and every gate row's weight on it is -t: that shifts all gate
    pre-activations by -t, and t is solved for the target mean density. Token m's other features are
    N(0, 1) scaled by exp(sigma * xi_m), xi_m ~ N(0, 1), so sigma > 0 gives heavy-tailed non-zeros per
    token (a token's density grows with its scale).
    """
    gen = torch.Generator().manual_seed(seed)
    scale_M = torch.exp(sigma * torch.randn(m, generator=gen, dtype=torch.float64))
    rho = math.sqrt((k - 1) / k)  # std of z . w over the K-1 random features
    target = min(max(nnz_mean / n, 1e-9), 0.5)
    lo, hi = 0.0, 50.0
    for _ in range(100):  # bisection on the shift t for the mean density over the sampled scales
        t = (lo + hi) / 2
        density = 0.5 * torch.special.erfc(t / (scale_M * rho * math.sqrt(2))).mean().item()
        lo, hi = (t, hi) if density > target else (lo, t)
    x_MK = torch.randn(m, k, generator=gen) * scale_M[:, None].float()
    x_MK[:, 0] = 1.0
    w_gate_NK = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_gate_NK[:, 0] = -t
    w_up_NK = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_down_KN = torch.randn(k, n, generator=gen) / math.sqrt(n)
    return tuple(
        t.to(device=device, dtype=torch.bfloat16).contiguous() for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN)
    )
