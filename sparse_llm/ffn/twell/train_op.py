"""Training path of the gated feedforward block on the hybrid sparse format: an autograd-aware op.

Status: the CUDA kernels (kernels/train_forward.cu, kernels/train_backward.cu) run on an H100 80GB SXM:
tests/gpu/test_twell_train.py passes (exact gradients), a 300-step train.py run with kernel=twell stays within
0.032 of the dense run's loss, and one block at M = 16384, K = 2048, N = 5632 trains 2.42x faster than the
trainer's eager dense path at 28 non-zeros per token (1.87x faster than that path compiled) and 1.56x at 56, with
0.28x of its peak memory during forward + backward (the block timed alone, steps issued back to back;
docs/benchmarks.md, 2026-11-26 09:30). `kernel=auto` picks this path only on request (`LayerDispatcher.train_kernels`,
train.py's `train_kernels=true`), because at small micro-batches the host cannot keep up. At M = 8192 the host needs
1.6-2.25 ms (by machine) to issue one forward + backward with the loss around it (a few dozen torch ops and CuPy
launches, and the autograd around them) for 1.7-1.9 ms of kernels (scripts/profile_mlp.py --host). The forward
reads nothing back (see "Host sync"); 2B model end to end at 4 x 2048 tokens per micro-batch with compiled decoder
layers: 1.24x less device time than the dense path with its MLP block compiled too, 1.18-1.25x less wall-clock
time (the step waits for the host), and 1.358x the dense path's throughput when each runs its largest micro-batch
(8 x 2048 tokens against 6; docs/benchmarks.md, 2026-11-25 16:10-16:50). A forced `kernel=twell` calls
`twell_train_ffn` regardless.

The op computes, for tokens x [M, K] and nn.Linear weights w_gate, w_up [N, K], w_down [K, N]:

    g = relu(x w_gate^T),  u = x w_up^T,  h = g * u,  y = h w_down^T,  l1_sum = sum |h|

and the exact gradients of y and l1_sum (the trainer's loss is CE + coeff * mean_layers(l1_sum / M)).
Only the gate GEMM is dense work; everything else runs at the gate's non-zeros.

Format and saved state (sparse only: no dense [M, N] or [R, N] activation is kept)
-------------------------------------------------------------------------------------
A token with at most ``width`` gate non-zeros is *light*: its entries live in an ELL row (column
``ell_cols_MW``, gate value ``ell_g_MW``, up value ``ell_u_MW``; slots past ``ell_count_M`` are unused;
``heavy_M`` is False). Any other token is *heavy* (``heavy_M`` True); R = ``heavy_counts[0]`` of them (a pinned
CPU int32 [1]). Nothing is ever dropped: there is no capacity to run out of. h is recomputed from g * u in the
backward, and the heavy tokens' dense g and u rows are recomputed there by cuBLAS from x. Token indices are
int32/int64 throughout (no 65536-token limit). ``w_compute_RK`` holds the weights as the kernels read them
(`compute_weights`): w_down^T in bf16, and with float32 master weights (autocast) also the bf16 copies of
w_gate and w_up, so the backward neither transposes nor casts them again.

Master weights: under autocast the weights reach the op in float32 (no separate cast before it). The forward
casts them itself (w_down cast and transposed in one pass) and the backward returns float32 weight gradients
straight from its float32 accumulators: the bf16 rounding and the two casts per weight that a bf16 gradient
costs on its way to a float32 parameter are skipped. Inside `step_scope.optimizer_step` (the trainer enters it for each
optimizer step) the eager route casts each layer's weights once per step, not once per micro-batch, and its backward
adds the weight gradients into the parameters' `.grad` where that is allowed (`step_scope.held_grads`): the
weight-gradient kernel and the heavy tokens' GEMMs add in place, and dW_down^T is added transposed.

GPU pipeline (CUDA tensors, sm_90a, bf16)
-----------------------------------------
forward:  cuBLAS gate GEMM  ->  train_fwd_gate (each token's positives listed from its bf16 gate row: ELL
          rows with their zero padding, heavy flags and list; u, h, L1, L0, fired for light tokens, and y by the
          rows walk where the slices walk does not fit)  ->  [slices walk: order_tokens, ell_to_slots (h's entries
          in slot order), entries_down (y from 16 columns of w_down's N rows in shared memory at a time)]  ->
          heavy tokens: the first `dense_rows` of the list through the inference route's dense GEMMs over their
          gathered rows (kernels/dense_rows.cu), the rest through gate_up_down_heavy (its split kernel: each heavy
          token's y, L1, L0, fired straight from its gate row); the list's length is read on the device.
backward: train_bwd_sddmm (dh at the support with the L1 term, du, dg, and the entries' sort keys; light
          tokens)  ->  train_bwd_dx (dx of light tokens; or, where `dx_by_slices`, two passes of the slices walk, w_up's
          then w_gate's) and beside it, on a high-priority stream, a stable
          sort of the ELL entries by column, train_csc_columns and train_csc_chunks (the transposed, CSC view
          and its work chunks; its size is bounded by the ELL, so the transpose can never overflow)  ->
          train_csc_wgrad (dW_gate, dW_up fused; dW_down; written in the weights' dtype: a one-chunk column's
          rows are stored from registers, the chunks of a longer one are summed in fp32 scratch rows and stored
          by the last)  ->  the heavy tokens' rows: cuBLAS GEMMs around one pointwise kernel, train_backup_grads
          (g and u recomputed; with heavy tokens the weight gradients are summed in fp32 by the GEMMs first).
A block whose weight rows outgrow L2 (`walk_column_parts`: more than 48 MiB of rows per walk, e.g. K = 4096, N = 11008)
has train_fwd_gate, train_bwd_sddmm and train_bwd_dx walk it in column parts, one launch per part, each drawing on
its part's rows only; y's and dx's fp32 sums are carried from part to part, so the results are the one-pass bits.

Host sync: none in the forward. The heavy-token count goes to pinned host memory by an asynchronous copy;
the backward reads it (backends.landed) to size the heavy rows' GEMMs. For most layers of a model that copy landed
long before the layer's backward is issued, so the read waits for nothing. Where it has not (the last layer, whose
backward comes first; a backward issued right after its forward; a gradient-checkpointed layer's recompute), the
read waits for the copy alone, after the light tokens' backward kernels are queued, so they run while the host
waits. The host then has nothing queued ahead of them: in a step of several micro-batches its lead is lost once
per micro-batch, and the step follows the host wherever the host's forward is slower than the device's
(docs/benchmarks.md, 2026-11-28, on an H200). Since the forward reads nothing back, graphed training steps capture it as
one CUDA graph per layer (`train_graphs`, `step_scope.optimizer_step(graph_forwards=True)`): the host then issues a 2B
forward in less time than the device runs it (docs/benchmarks.md, 2026-11-29 10:35).
The heavy tokens' forward reads the bf16 gate row and skips the bf16 rounding of u and h that the light
path applies (the inference kernel's arithmetic); the backward recomputes their g from an R-row GEMM.
Both differences are below one bf16 rounding. scripts/bench_train_mlp.py reports host wall-clock per step
beside the CUDA-event time.

Cost bound (why a target may be missed): past the gate GEMM, each light non-zero streams seven K-wide bf16
rows (forward: w_up, w_down; backward: w_down, w_up, w_gate; weight gradients: the token's x and dy rows),
28 KiB at K = 2048, on CUDA cores. Dense training does 9 * 2 * K * N flops per token on tensor cores, so
with the gate GEMM (1/9 of that) paid on both paths the break-even is (8 N / 7) * B / F non-zeros per
token for a row bandwidth of B bytes/s and a tensor-core rate of F flop/s (K cancels): about 49 at
N = 5632, B = 5.5 TB/s, F = 720 TFLOP/s. On an H100 warps stream random 4 KiB rows from L2 at about 7.5 TB/s at
best (a scratch kernel doing nothing else, docs/benchmarks.md 2026-11-25); the kernels' walks reach 5.7-7.2 TB/s, and
the 28-non-zero block reached 2.32x (2.70 ms against 6.25 ms). Reuse of weight rows across tokens (real
activations are correlated, the synthetic ones are not) or tensor-core tiles are the ways past this bound.

Determinism: the weight gradients of columns longer than `csc_whole_column` entries are summed with fp32
atomics, so their summation order varies run to run. The forward's outputs are deterministic (ELL rows in
ascending columns, zero padding, as in formats.py; each heavy token reduced in a fixed order), as
torch.compile and opcheck require: the heavy tokens leave the op as flags, not as the kernel's list (whose
order is that of arrival); the backward lists them with nonzero_static, sized by the landed count.

On CPU (and for opcheck / gradcheck in CI) the same op runs the torch reference built on
`sparse_llm.formats` (`hybrid_gated_mlp_forward_ref` / `hybrid_gated_mlp_backward_ref`), any float dtype.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from sparse_llm.cuda import runtime
from sparse_llm.ffn.backend import FFNResult, Tail, landed
from sparse_llm.formats import (
    HybridPacked,
    HybridSaved,
    hybrid_gated_mlp_backward_ref,
    hybrid_gated_mlp_forward_ref,
    hybrid_mul,
)
from sparse_llm.ffn.step_scope import adding_into_grads, graphing_forwards, held_grads, reused_cast
from sparse_llm.ffn.twell.graphs import graphed_forward
from sparse_llm.ffn.twell.backend import (
    CUBLAS_GEMM_TFLOPS,
    DIRECT_LIST_CAP,
    HBM_GBPS,
    ORDER_GROUP,
    PACK_GBPS,
    SLICES_MIN_M,
    TAIL_FULL_SHARE,
    TILE,
    TOKENS_PER_BLOCK,
    UP_DOWN_GBPS,
    Columns,
    check_inputs,
    column_parts,
    dense_heavy_rows,
    dense_row_capacity,
    dense_row_split,
    flagged_parts,
    heavy_share,
    lognormal_split,
    order_slots,
    row_slowdown,
    shape_unsupported_reason,
    slice_width,
    slices_down,
    slices_down_ms,
    split_token_up_down,
    transposed_copy,
)

Tensor = torch.Tensor

DEFAULT_WIDTH = 128  # ELL width: the paper's robust setting for L1 >= 1.5e-5
MAX_WIDTH = 4096
# Work items of the weight-gradient kernel: a column of up to CSC_WHOLE_COLUMN entries is one item, which stores its
# rows (no zero fill, no atomics); that is above the typical column (M * L0 / N: 81 at 16384 tokens and 28 non-zeros
# of 5632). A longer column is cut into CSC_CHUNK-entry items that add theirs: a hot neuron is spread over many warps
# and no item is long enough to stretch the kernel's tail (docs/benchmarks.md, 2026-11-25: whole columns up to 256
# entries slowed these kernels in a 2B model, whose neurons fire unevenly).
CSC_CHUNK = 64
CSC_WHOLE_COLUMN = 128
# ... and at denser layers up to this many times the mean column (train_csc_chunks reads the mean on the device):
# at 56 non-zeros per token of 16384 tokens the typical column has 163 entries, which a fixed 128 cut into atomically
# added chunks on zeroed rows (docs/benchmarks.md, 2026-11-25 06:40-06:47).
CSC_WHOLE_PER_MEAN = 2
CSC_COLUMNS_THREADS = 256  # threads per block of train_csc_columns (one per sorted entry, grid-stride)
CSC_COLUMNS_MAX_BLOCKS = 4096
CSC_CHUNKS_THREADS = 1024  # the one block of train_csc_chunks
BACKUP_GRADS_THREADS = 256  # BACKUP_GRADS_THREADS in train_backward.cu (train_backup_grads)
# Scratch rows (per value array) in which the weight-gradient kernel sums the columns cut into several chunks: more
# than such columns are ever in flight at once (a few hundred warps' items), so no item waits for a slot.
WGRAD_SLOTS = 512
# The walk of y where "slices" fits (`walk_by_slices`): on an H100 at M = 16384, K = 2048, N = 5632 the slices walk
# (train_fwd_gate without its down half, then ordering, entry copy and entries_down) took 0.53 / 0.89 / 0.46 ms where
# train_fwd_gate's rows walk took 0.66 / 1.17 / 0.55 ms, at 28 / 56 uniform and 60 heavy-tailed non-zeros per token.
FWD_WALK = "slices"
# The walk of the light dx: "auto" takes slices where the caller's hint of the layer's non-zeros (`dx_by_slices`)
# puts the light tokens' mean at DX_SLICES_MIN_LIGHT_MEAN or more with at most DX_SLICES_MAX_HEAVY_SHARE of the
# non-zeros on heavy tokens. Two passes with fp32 sums between cost a fixed ~0.35 ms there, where the rows walk's cost
# grows twice as fast per non-zero: rows took 0.52 / 1.04 ms at 28 / 56 non-zeros, slices 0.62 / 0.89 (same run as
# above), so they tie near 40. Under a heavy tail the light tokens' uneven counts slow the slices passes (60 mean with
# 32% of it on heavy tokens: 0.63 ms against rows' 0.33).
DX_WALK = "auto"
DX_SLICES_MIN_LIGHT_MEAN = 40
DX_SLICES_MAX_HEAVY_SHARE = 0.1
DX_SUMS_BYTES = 32 << 20  # fp32 sums the slices walk of dx holds at once (4096 tokens at K = 2048)
WGRAD_WARPS_PER_BLOCK = 4
WGRAD_BLOCKS_PER_SM = 8  # an upper bound on residency: surplus blocks find the work counter exhausted
WGRAD_PIECES = 4  # 16-byte pieces per lane of one K slice in the weight-gradient kernel (1024 columns)
TRAIN_MS_PER_TOKEN = 0.10 / 16384  # cost-model residual per token, fitted at M = 16384 (train_estimated_ms)
CALIBRATION_MKN = (16384, 2048, 5632)  # the block train_estimated_ms was fitted on
# A heavy-tailed layer's light tokens just under the ELL width make the walks' tail: its light rows cost this much
# more than a uniform layer's (fitted on h60: mean 60, max 1173 non-zeros per token), in proportion to the tail's
# share of the non-zeros up to TAIL_FULL_SHARE, as in the inference price (h60, h79 and h154 hold 0.32-0.74).
TRAIN_TAIL_FACTOR = 1.4
# The host's time per layer call that a model step sees. Issuing one forward + backward with the L1 loss term (a few
# dozen torch ops and CuPy launches, and the autograd around them) took 3.1-3.2 ms, measured with the GPU kept busy
# (`scripts/profile_mlp.py --mode train --m 4096 --host`, H100 machine). In a model the host issues one layer while
# the GPU still runs attention and earlier layers, so only part of it shows: on the 2B shape at 24 non-zeros per
# token, forcing the kernels made the whole training step 0.93x the torch path's at 4096 tokens per micro-batch
# and 1.16x at 8192 (scripts/bench_model.py, docs/benchmarks.md). 2.4 ms puts the switch between the two, at about
# 6400 tokens; below the floor the GPU would wait for the host. Since 2026-11-25 the step issues in about 1.8 ms;
# the floor is kept (not re-measured in a model at 4096 tokens), which errs towards the dense path.
TRAIN_EXPOSED_HOST_MS = 2.4
# Backup rows cost their nine GEMMs three times over: gathers, masks, casts and scatters around them (all tokens
# heavy, u279: 14.7 ms measured against 4.7 ms of GEMMs; docs/benchmarks.md, 2026-11-25 15:05).
BACKUP_FACTOR = 3.0
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The op's outputs after (y_MK, l1_sum, l0_M, fired_N): the saved sparse state, in this order.
STATE_NAMES = (
    "ell_cols_MW",
    "ell_count_M",
    "heavy_M",
    "ell_g_MW",
    "ell_u_MW",
    "heavy_counts",
    "w_compute_RK",
)
COUNTS_OUTPUT = 4 + STATE_NAMES.index("heavy_counts")  # the heavy-token count's place among the op's outputs
_Outputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


# ------------------------------------------------------------------------------------------------
# Cost model
# ------------------------------------------------------------------------------------------------


def _walk_slowdown(footprint_bytes: float, calibration_bytes: float) -> float:
    """`row_slowdown` of a walk over footprint_bytes of rows relative to the same walk at the calibration block (whose
    rate the fitted constants hold), never below 1: narrower blocks are not priced cheaper than the calibration."""
    return max(1.0, row_slowdown(footprint_bytes) / row_slowdown(calibration_bytes))


def train_estimated_ms(m: int, k: int, n: int, l0_mean: float, l0_max: float) -> float | None:
    """Predicted ms of one forward + backward, or None (a shape the kernels cannot take).

    The gate (cuBLAS + packing), weight rows streamed per light non-zero at the inference kernel's row rate (slower
    where a walk's rows outgrow L2 more than at the calibration block: `_walk_slowdown`): forward w_up's, and w_down's
    where y does not take the slices walk; backward w_down's, and w_up's and w_gate's where dx does not take it
    (`dx_by_slices` at this density); two gathered token rows for the weight gradients. The slices walks at the
    inference down kernel's price (`slices_down_ms`; dx: two passes and its fp32 sums through memory). Then the fp32
    weight-gradient buffers, the dense training cost of the backup rows, and TRAIN_MS_PER_TOKEN for what the rest
    does not cover (ELL conversion, CSC sort, casts, launches). Calibrated on the H100 at M = 16384, K = 2048,
    N = 5632 (scripts/bench_train_mlp.py, 2026-11-26 09:55: u28 2.57 ms, u56 3.99, h60 5.04, h79 5.95, u112 7.86,
    h154 8.33, every token heavy (u279) 14.79; the model gives 2.57, 3.98, 5.53, 6.86, 9.67, 10.79 and 14.91: the
    denser and heavy-tailed layers are priced high, which errs towards the dense path) and on K = 4096, N = 11008
    at M = 8192 (rows walks in two column parts: 4.65 and 6.83 ms at 29 and 57 non-zeros; priced 4.58, 7.45).
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


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def check_train_inputs(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, width: int
) -> tuple[int, int, int]:
    """Raise TypeError/ValueError naming the bad argument; returns (M, K, N).

    Any float dtype on CPU (the torch reference); on CUDA the kernels' rules (bf16, contiguous, K % 64,
    N % 256, K <= 4096, N <= 65536, sm_90a) apply. The weights share one dtype: x_MK's, or float32 (master
    weights under autocast: the op computes with copies in x_MK's dtype and returns float32 gradients).
    """
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width={width!r} must be an int in [1, {MAX_WIDTH}] (the ELL row width, default 128)")
    named = (("x_MK", x_MK), ("w_gate_NK", w_gate_NK), ("w_up_NK", w_up_NK), ("w_down_KN", w_down_KN))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}; flatten tokens with x.reshape(-1, K)")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; pass floating tensors (bf16 on the GPU)")
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")
    for name, t in named[2:]:
        if t.dtype != w_gate_NK.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but w_gate_NK has {w_gate_NK.dtype}; pass the weights in one dtype"
            )
    if w_gate_NK.dtype not in (x_MK.dtype, torch.float32):
        raise TypeError(
            f"w_gate_NK has dtype {w_gate_NK.dtype} but x_MK has {x_MK.dtype}; pass the weights in x_MK's dtype "
            "or as float32 master weights"
        )
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    expected = {"w_gate_NK": (n, k), "w_up_NK": (n, k), "w_down_KN": (k, n)}
    for name, t in named[1:]:
        if tuple(t.shape) != expected[name]:
            hint = " (it looks transposed: pass down_proj.weight itself)" if tuple(t.shape) == (n, k) else ""
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {list(expected[name])} in nn.Linear layout "
                f"(K={k} from x_MK, N={n} from w_gate_NK){hint}"
            )
    if n > 1 << 16:
        raise ValueError(f"w_gate_NK has N={n} rows; the formats store 16-bit columns, so N must be <= 65536")
    if x_MK.is_cuda:
        check_inputs(x_MK, w_gate_NK, w_up_NK, w_down_KN, weight_dtypes=(torch.bfloat16, torch.float32))
        for name, t in named:
            if t.data_ptr() % 16:
                raise ValueError(f"{name} is not 16-byte aligned (a view at an odd offset); pass {name}.clone()")
    return m, k, n


# ------------------------------------------------------------------------------------------------
# Torch reference (CPU, CI): formats.py
# ------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_weights(
    w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """The weights as the kernels read them, saved for the backward: w_down^T [N, K] in `dtype`, preceded by
    w_gate and w_up in `dtype` ([3N, K] in all) when the weights are held in another dtype (float32 master
    weights). A new tensor (outputs of a custom op must not alias its inputs), or written into `out`
    (`compute_weights_shape`), which a graphed forward reads at a fixed address."""
    n, k = w_gate_NK.shape
    if out is None:
        out = torch.empty(compute_weights_shape(w_gate_NK, dtype), dtype=dtype, device=w_gate_NK.device)
    if w_gate_NK.dtype == dtype:
        return transposed_copy(w_down_KN, dtype, out=out)
    out[:n].copy_(w_gate_NK)
    out[n : 2 * n].copy_(w_up_NK)
    transposed_copy(w_down_KN, dtype, out=out[2 * n :])
    return out


def compute_weights_shape(w_gate_NK: Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """[N, K] (w_down^T alone) where the weights are in `dtype`, else [3N, K]: `compute_weights`' output."""
    n, k = w_gate_NK.shape
    return (n, k) if w_gate_NK.dtype == dtype else (3 * n, k)


def split_compute_weights(w_RK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(w_gate, w_up, w_down^T) in the compute dtype from `compute_weights`' output (and the op's inputs)."""
    n = w_gate_NK.shape[0]
    if w_RK.shape[0] == 3 * n:
        return w_RK[:n], w_RK[n : 2 * n], w_RK[2 * n :]
    return w_gate_NK, w_up_NK, w_RK


def _reference_forward(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, width: int, dx_slices: bool = False,
    dense_rows: int = 0, w_compute_RK: Tensor | None = None,
) -> _Outputs:  # fmt: skip
    # dx_slices and dense_rows (part of the op's schema) are the CUDA route's: the reference has one dx and computes
    # every heavy token densely. w_compute_RK: the weights' `compute_weights` when the caller has them (reused over an
    # optimizer step's micro-batches).
    if w_compute_RK is None:
        w_compute_RK = compute_weights(w_gate_NK, w_up_NK, w_down_KN, x_MK.dtype)
    w_gate_NK, w_up_NK, w_down_KN = (w.to(x_MK.dtype) for w in (w_gate_NK, w_up_NK, w_down_KN))
    fwd = hybrid_gated_mlp_forward_ref(x_MK, w_gate_NK, w_up_NK, w_down_KN, width=width)
    g, u = fwd.saved.g, fwd.saved.u
    h = hybrid_mul(g, u)
    n = g.n_cols
    nonzero_MW = h.ell_values_MW != 0  # padding slots hold 0
    nonzero_RN = h.backup_values_RN != 0
    l0_M = nonzero_MW.sum(dim=1, dtype=torch.int32)
    l0_M[g.backup_rows_R] = nonzero_RN.sum(dim=1, dtype=torch.int32)
    fired_N = torch.zeros(n, dtype=torch.bool, device=x_MK.device)
    fired_N[g.ell_cols_MW[nonzero_MW].long()] = True
    fired_N |= nonzero_RN.any(dim=0)
    heavy_counts = torch.tensor([g.backup_rows_R.numel()], dtype=torch.int32)
    return (
        fwd.y_MK, fwd.l1_sum, l0_M, fired_N,
        g.ell_cols_MW, g.ell_count_M, g.heavy_M, g.ell_values_MW, u.ell_values_MW, heavy_counts, w_compute_RK,
    )  # fmt: skip


def _reference_backward(
    x_MK, w_gate_NK, w_up_NK, w_down_KN, ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, heavy_counts,
    w_compute_RK, dy_MK, dl1, dx_slices=False, grads_into=None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    # dx_slices picks the CUDA backward's dx walk; the reference has one. grads_into: as in _cuda_backward.
    weight_dtype = w_gate_NK.dtype
    w_gate_NK, w_up_NK, w_down_KN = (w.to(x_MK.dtype) for w in (w_gate_NK, w_up_NK, w_down_KN))
    rows_R = heavy_rows(heavy_M, heavy_counts)
    backup_g_RN, backup_u_RN = _backup_gate_up(x_MK, w_gate_NK, w_up_NK, rows_R)
    g = HybridPacked(
        ell_values_MW=ell_g_MW,
        ell_cols_MW=ell_cols_MW,
        ell_count_M=ell_count_M,
        backup_rows_R=rows_R,
        backup_values_RN=backup_g_RN,
        n_cols=w_gate_NK.shape[0],
        width=ell_cols_MW.shape[1],
        capacity=max(1, rows_R.numel()),
        capacity_grown=False,
    )
    saved = HybridSaved(g=g, u=g.with_values(ell_u_MW, backup_u_RN))
    grads = hybrid_gated_mlp_backward_ref(x_MK, w_gate_NK, w_up_NK, w_down_KN, saved, dy_MK, dl1)
    dw = (grads.dw_gate_NK, grads.dw_up_NK, grads.dw_down_KN)
    if grads_into is not None:
        for into, t in zip(grads_into, dw, strict=True):
            into.add_(t)
        return grads.dx_MK, None, None, None
    return (grads.dx_MK, *(t.to(weight_dtype) for t in dw))


# ------------------------------------------------------------------------------------------------
# CUDA implementation
# ------------------------------------------------------------------------------------------------


def _launch(filename: str, name: str, grid: int, warps: int, args: tuple, device: torch.device, smem: int = 0) -> None:
    kernel = runtime.get_function(filename, name, device)
    runtime.set_dynamic_smem(kernel, smem)
    runtime.launch(kernel, (grid,), (32 * warps,), args, device, shared_mem=smem)


def _pieces(k: int) -> int:
    """KV of the kernels: 16-byte pieces per lane of a K-wide bf16 row (lane owns 8 of every 256 columns)."""
    return math.ceil(k / 256)


def wgrad_slices(k: int) -> tuple[int, int]:
    """(KW, parts) of the weight-gradient kernel: K is cut into `parts` slices of KW pieces per lane."""
    kw = min(_pieces(k), WGRAD_PIECES)
    return kw, math.ceil(_pieces(k) / kw)


def _require_kernels(device: torch.device) -> None:
    reason = runtime.unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(
            f"The twell training kernels cannot run on {device}: {reason} Use kernel=torch (or auto) there."
        )


def heavy_rows(heavy_M: Tensor, heavy_counts: Tensor) -> Tensor:
    """The heavy tokens of a forward, ascending: int64 [R] (R = heavy_counts[0] once its copy has landed).

    nonzero_static, unlike nonzero, is sized by the host and so does not wait for the device.
    """
    return torch.nonzero_static(heavy_M, size=landed(heavy_counts)[0])[:, 0]


def _backup_gate_up(x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, rows_R: Tensor) -> tuple[Tensor, Tensor]:
    """Heavy tokens' dense gate and up rows for the torch reference's backward: (g_RN = relu(x w_gate^T),
    u_RN = x w_up^T masked by g's support), recomputed as the CUDA backward recomputes them (`_backup_backward`).

    torch reference: the backup branch of formats.hybrid_sddmm / pack_hybrid.
    """
    x_RK = x_MK.index_select(0, rows_R)
    g_RN = F.relu(F.linear(x_RK, w_gate_NK))
    return g_RN, torch.where(g_RN != 0, F.linear(x_RK, w_up_NK), 0)


def _cuda_forward(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, width: int, dx_slices: bool = False,
    dense_rows: int = 0, w_compute_RK: Tensor | None = None,
) -> _Outputs:  # fmt: skip
    # dx_slices (part of the op's schema) reaches the backward through the autograd context; w_compute_RK as in
    # _reference_forward
    device = x_MK.device
    _require_kernels(device)  # the operands were checked once, by twell_train_ffn
    with runtime.on_device(device):
        if w_compute_RK is None:
            w_compute_RK = compute_weights(w_gate_NK, w_up_NK, w_down_KN, torch.bfloat16)
        return forward_kernels(x_MK, w_gate_NK, w_up_NK, width, w_compute_RK, counts_host=new_counts_host(),
                               dense_rows=dense_rows)  # fmt: skip


def new_counts_host() -> Tensor:
    """A pinned CPU int32 [1] for the heavy-token count, -1 until its copy lands (`backends.landed`)."""
    return torch.full((1,), -1, dtype=torch.int32, pin_memory=True)


def forward_kernels(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, width: int, w_compute_RK: Tensor,
    counts_host: Tensor | None = None, gate_MN: Tensor | None = None, dense_rows: int = 0,
) -> _Outputs:  # fmt: skip
    """The CUDA forward on the current device and stream: `_cuda_forward`'s outputs, with the heavy-token count
    copied into counts_host (`new_counts_host`) as soon as it is known, or, where counts_host is None (a CUDA graph
    capture, `train_graphs`), left on the device in its place (int32 [1]). gate_MN: where the gate GEMM writes (bf16
    [M, N]), else a new tensor. dense_rows: how many heavy tokens take dense GEMMs over their gathered rows; the rest
    are split over blocks of warps. Issues no host sync."""
    device = x_MK.device
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    i32, bf16 = torch.int32, torch.bfloat16
    w_gate_NK, w_up_NK, w_down_t_NK = split_compute_weights(w_compute_RK, w_gate_NK, w_up_NK)
    # Three allocations, not views of one: outputs of a custom op must not alias each other. The kernel writes
    # their zero padding (value 0, column 0, as in formats.py), so the state is deterministic.
    ell_cols_MW = torch.empty(m, width, dtype=i32, device=device)
    ell_g_MW = torch.empty(m, width, dtype=bf16, device=device)
    ell_u_MW = torch.empty(m, width, dtype=bf16, device=device)
    ell_count_M = torch.empty(m, dtype=i32, device=device)
    heavy_M = torch.empty(m, dtype=torch.bool, device=device)
    l0_M = torch.empty(m, dtype=i32, device=device)
    l1_M = torch.empty(m, dtype=torch.float32, device=device)
    # One fill for the heavy-token counter and the fired flags, and room for the heavy-token list (in the
    # kernel's order of arrival: not an output, so a view is fine).
    zeroed_i32 = torch.zeros(1 + n + m, dtype=i32, device=device)
    heavy_count, fired_N, heavy_list = zeroed_i32.split((1, n, m))
    y_MK = torch.empty(m, k, dtype=bf16, device=device)
    if m:
        gate_MN = torch.mm(x_MK, w_gate_NK.t(), out=gate_MN)
        kv = _pieces(k)
        by_slices = walk_by_slices(FWD_WALK, m, k, n, width)
        columns = [(0, n)] if by_slices else walk_column_parts(k, n)[0]
        # y's fp32 sums carried from one column part to the next
        partial_MK = torch.empty(m, k, dtype=torch.float32, device=device) if len(columns) > 1 else None
        operands = (gate_MN, x_MK, w_up_NK, w_down_t_NK, ell_cols_MW, ell_g_MW, ell_u_MW, ell_count_M, heavy_M,
                    heavy_list, heavy_count, y_MK, l1_M, l0_M, fired_N, partial_MK)  # fmt: skip
        smem = TOKENS_PER_BLOCK * (kv * 32 * 16 + width * 4)  # per warp: the x row, the token's entry list
        blocks = math.ceil(m / TOKENS_PER_BLOCK)
        name = f"train_fwd_gate<{kv},{str(not by_slices).lower()}>"  # without its down half for the slices
        for (begin, end), part in flagged_parts(columns):
            args = (*map(runtime.ptr, operands), *map(np.int32, (m, k, n, width, begin, end, part)))
            _launch("train_forward.cu", name, blocks, TOKENS_PER_BLOCK, args, device, smem)
        if by_slices:
            _y_by_slices(w_down_t_NK, ell_cols_MW, ell_g_MW, ell_u_MW, ell_count_M, heavy_M, y_MK)
    if counts_host is not None:
        counts_host.copy_(heavy_count, non_blocking=True)
    if m:
        # Heavy tokens straight from their gate rows: the first dense_rows of them through dense GEMMs, the others
        # each split over a block of warps, which lasts as long as its token's walk (~0.3 ms for a near-dense one).
        # How many there are is read on the device, so the host goes on without waiting.
        outs = (y_MK, l1_M, l0_M, fired_N)
        rows_M, count_1 = heavy_list, heavy_count
        if dense_rows:
            rows_M, count_1 = dense_heavy_rows(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, None,
                                               min(dense_rows, m))  # fmt: skip
        split_token_up_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs)
    return (
        y_MK, l1_M.sum(), l0_M, fired_N.bool(),
        ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, heavy_count if counts_host is None else counts_host,
        w_compute_RK,
    )  # fmt: skip


def csc_key_dtype(n: int) -> torch.dtype:
    """dtype of the CSC sort keys (values 0..N): int16 where N fits, as the radix sort's passes follow the key's
    width (two over 16 bits, four over 32)."""
    return torch.int16 if n <= torch.iinfo(torch.int16).max else torch.int32


KEY_CTYPES = {torch.int16: "short", torch.int32: "int"}  # template argument `Key` of the kernels reading keys
OUT_CTYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}  # `Out` of the weight-gradient kernel


def csc_keys(ell_cols_MW: Tensor, ell_count_M: Tensor, heavy_M: Tensor, n: int) -> Tensor:
    """[M, W] in csc_key_dtype(n): each light ELL entry's column, N for unused and heavy-token slots (which so
    sort last).

    torch reference of the keys train_bwd_sddmm writes for the transposed (CSC) view.
    """
    width = ell_cols_MW.shape[1]
    used_MW = torch.arange(width, device=ell_cols_MW.device) < ell_count_M[:, None]
    used_MW &= ~heavy_M[:, None]
    return torch.where(used_MW, ell_cols_MW, n).to(csc_key_dtype(n))


def csc_order(key_MW: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The light ELL entries in column-major order: (order_E, col_start) with col_start int64 [N + 1].

    order_E lists positions m * W + s sorted by key (stable: ascending tokens within a column); column n
    owns order_E[col_start[n] : col_start[n + 1]]. torch reference of `csc_index` (and of the transposed
    view: formats.hybrid_t_matmul's entry list).
    """
    sorted_E, order_E = torch.sort(key_MW.flatten(), stable=True)
    col_start = torch.searchsorted(sorted_E, torch.arange(n + 1, dtype=sorted_E.dtype, device=sorted_E.device))
    return order_E, col_start


def csc_whole_column(col_start: Tensor) -> int:
    """The longest column that is one work item: CSC_WHOLE_COLUMN, or CSC_WHOLE_PER_MEAN times the mean column if
    that is more (integer arithmetic, as train_csc_chunks)."""
    n = col_start.numel() - 1
    return max(CSC_WHOLE_COLUMN, CSC_WHOLE_PER_MEAN * int(col_start[-1]) // max(n, 1))


def csc_chunk_starts(col_start: Tensor) -> Tensor:
    """int64 [N + 1]: where column n's work chunks start in the list of all chunks: one for a column of up to
    `csc_whole_column` entries (empty columns included), else one per CSC_CHUNK entries."""
    entries = col_start.diff()
    chunks = torch.where(entries > csc_whole_column(col_start), (entries + CSC_CHUNK - 1) // CSC_CHUNK, 1)
    chunk_start = torch.zeros_like(col_start)
    torch.cumsum(chunks, 0, out=chunk_start[1:])
    return chunk_start


def csc_chunk_columns(chunk_start: Tensor) -> Tensor:
    """int32 [chunk_start[N]]: the column of each work chunk. torch reference of train_csc_chunks' map."""
    n = chunk_start.numel() - 1
    columns = torch.arange(n, dtype=torch.int32, device=chunk_start.device)
    return torch.repeat_interleave(columns, chunk_start.diff())


def csc_shared_ranks(chunk_start: Tensor) -> Tensor:
    """int32 [N]: how many columns before each have more than one work chunk (a many-chunk column's rank, which
    picks its scratch slot). torch reference of train_csc_chunks' ranks."""
    many = (chunk_start.diff() > 1).to(torch.int32)
    return torch.cumsum(many, 0, dtype=torch.int32) - many


def csc_index(key_MW: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(order_E, col_start, chunk_start, chunk_col, shared_rank) of the transposed view from the keys
    train_bwd_sddmm wrote: a stable sort, then column starts by one thread per entry and the chunks' starts,
    columns and many-chunk ranks by one block (int64 [N + 1] offsets; chunk_col int32, valid up to
    chunk_start[N]; shared_rank int32 [N]). No host sync. torch reference: `csc_order`, `csc_chunk_starts`,
    `csc_chunk_columns` and `csc_shared_ranks`."""
    device = key_MW.device
    sorted_E, order_E = torch.sort(key_MW.flatten(), stable=True)
    entries = sorted_E.numel()
    col_start, chunk_start = torch.empty(2, n + 1, dtype=torch.int64, device=device).unbind(0)
    chunk_col = torch.empty(entries // CSC_CHUNK + n + 1, dtype=torch.int32, device=device)  # >= the chunk count
    shared_rank = torch.empty(n, dtype=torch.int32, device=device)
    columns = runtime.get_function("train_backward.cu", f"train_csc_columns<{KEY_CTYPES[key_MW.dtype]}>", device)
    blocks = max(1, min(math.ceil((entries + 1) / CSC_COLUMNS_THREADS), CSC_COLUMNS_MAX_BLOCKS))
    args = (runtime.ptr(sorted_E), runtime.ptr(col_start), np.int64(entries), np.int32(n))
    runtime.launch(columns, (blocks,), (CSC_COLUMNS_THREADS,), args, device)
    chunks = runtime.get_function("train_backward.cu", "train_csc_chunks", device)
    args = (
        runtime.ptr(col_start), runtime.ptr(chunk_start), runtime.ptr(chunk_col), runtime.ptr(shared_rank), np.int32(n),
        np.int32(CSC_CHUNK), np.int32(CSC_WHOLE_COLUMN), np.int32(CSC_WHOLE_PER_MEAN),
    )  # fmt: skip
    runtime.launch(chunks, (1,), (CSC_CHUNKS_THREADS,), args, device)
    return order_E, col_start, chunk_start, chunk_col, shared_rank


def wgrad_scratch(k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(scratch, counters) for two `_csc_wgrad` launches in a row: a zeroed fp32 [WGRAD_SLOTS * 2, K] that each
    launch leaves zeroed, and zeroed int64 [2, 1 + 2 * WGRAD_SLOTS] counters, a row per launch."""
    scratch = torch.zeros(WGRAD_SLOTS * 2, k, dtype=torch.float32, device=device)
    return scratch, torch.zeros(2, 1 + 2 * WGRAD_SLOTS, dtype=torch.int64, device=device)


def _csc_wgrad(
    csc: tuple[Tensor, ...], values: tuple[Tensor, ...], src_MK: Tensor, outs: tuple[Tensor, ...], scratch: Tensor,
    counters: Tensor, width: int, add: bool = False,
) -> None:  # fmt: skip
    """Writes every row of each [N, K] out (fp32 or bf16, one per value array: 1 or 2): row n = the fp32 sum over
    column n's entries of value * src_MK[token], rounded once to the out's dtype; with `add`, adds it to row n.

    csc = `csc_index`'s five tensors; scratch and counters: `wgrad_scratch`'s, the counters one row of them.
    """
    device = src_MK.device
    n, k = outs[0].shape
    sms = runtime.sm_count(device)
    kw, parts = wgrad_slices(k)
    args = (
        *(runtime.ptr(t) for t in csc), runtime.ptr(values[0]), runtime.ptr(values[-1]), runtime.ptr(src_MK),
        runtime.ptr(outs[0]), runtime.ptr(outs[-1]), runtime.ptr(scratch), runtime.ptr(counters),
        np.int32(n), np.int32(k), np.int32(width), np.int32(CSC_CHUNK), np.int32(parts), np.int32(WGRAD_SLOTS),
        np.int32(add),
    )  # fmt: skip
    kernel = f"train_csc_wgrad<{kw},{len(values)},{OUT_CTYPES[outs[0].dtype]}>"
    _launch("train_backward.cu", kernel, sms * WGRAD_BLOCKS_PER_SM, WGRAD_WARPS_PER_BLOCK, args, device)


def walk_column_parts(k: int, n: int) -> tuple[Columns, Columns, Columns]:
    """The column parts (`column_parts`) of the three weight walks: the forward's over w_up and w_down (two rows per
    neuron), sddmm's over w_down (one), dx's over w_up and w_gate (two). One part each while their rows fit L2."""
    return column_parts(k, n), column_parts(k, n, rows_per_neuron=1), column_parts(k, n)


def _light_backward(
    dy_MK, w_gate_NK, w_up_NK, w_down_t_NK, ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, dl1_1, dx_slices,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]]:  # fmt: skip
    """train_bwd_sddmm and train_bwd_dx on the light tokens, and the transposed view of their entries:
    (dx_MK with the heavy rows unwritten, h, du, dg at the ELL entries (bf16 [M, W]), `csc_index`'s tensors, or
    () when M = 0).

    The view (a sort and two small kernels, ~0.13 ms at M = 16384) depends only on the sort keys sddmm writes,
    so it is built on a high-priority side stream while train_bwd_dx runs, in the slots dx's finished blocks
    free; the current stream waits for it before returning.
    """
    device = dy_MK.device
    (m, k), (n, width) = dy_MK.shape, (w_gate_NK.shape[0], ell_cols_MW.shape[1])
    dx_MK = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    ell_h_MW, ell_du_MW, ell_dg_MW = torch.empty(3, m, width, dtype=torch.bfloat16, device=device).unbind(0)
    key_MW = torch.empty(m, width, dtype=csc_key_dtype(n), device=device)
    if m:
        kv = _pieces(k)
        blocks = math.ceil(m / TOKENS_PER_BLOCK)
        _, sddmm_columns, dx_columns = walk_column_parts(k, n)
        operands = (dy_MK, w_down_t_NK, ell_cols_MW, ell_g_MW, ell_u_MW, ell_count_M, heavy_M, dl1_1, ell_h_MW,
                    ell_du_MW, ell_dg_MW, key_MW)  # fmt: skip
        smem = TOKENS_PER_BLOCK * kv * 32 * 16
        sddmm = f"train_bwd_sddmm<{kv},{KEY_CTYPES[key_MW.dtype]}>"
        for (begin, end), part in flagged_parts(sddmm_columns):
            args = (*map(runtime.ptr, operands), *map(np.int32, (m, n, k, width, begin, end, part)))
            _launch("train_backward.cu", sddmm, blocks, TOKENS_PER_BLOCK, args, device, smem)
        main, side = torch.cuda.current_stream(device), runtime.side_stream(device.index)
        side.wait_stream(main)  # the keys are written
        # set_stream, not the torch.cuda.stream context: the device is current (runtime.on_device), and the context took
        # 14 us a call on an H200's host against 2.5
        torch.cuda.set_stream(side)
        try:
            csc = csc_index(key_MW, n)
        finally:
            torch.cuda.set_stream(main)
        key_MW.record_stream(side)  # freed on return, maybe before the side stream is done with it
        if dx_slices:
            _dx_by_slices(w_gate_NK, w_up_NK, ell_cols_MW, ell_du_MW, ell_dg_MW, ell_count_M, heavy_M, dx_MK)
        else:
            # dx's fp32 sums carried from one column part to the next
            partial_MK = torch.empty(m, k, dtype=torch.float32, device=device) if len(dx_columns) > 1 else None
            operands = (w_gate_NK, w_up_NK, ell_cols_MW, ell_du_MW, ell_dg_MW, ell_count_M, heavy_M, dx_MK,
                        partial_MK)  # fmt: skip
            for (begin, end), part in flagged_parts(dx_columns):
                args = (*map(runtime.ptr, operands), *map(np.int32, (m, n, k, width, begin, end, part)))
                _launch("train_backward.cu", f"train_bwd_dx<{kv}>", blocks, TOKENS_PER_BLOCK, args, device)
        main.wait_stream(side)
        for t in csc:  # allocated on the side stream, used and freed on this one
            t.record_stream(main)
    else:
        csc = ()
    return dx_MK, ell_h_MW, ell_du_MW, ell_dg_MW, csc


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


def _slot_entries(
    ell_cols_MW: Tensor, ell_a_MW: Tensor, ell_b_MW: Tensor, ell_count_M: Tensor, heavy_M: Tensor, product: bool,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor]]:  # fmt: skip
    """The light tokens ordered by count (order_slots: (token_slots, slot_counts, slot_tokens)) and their entries in
    slot order (ell_to_slots): h = a * b when `product` (a = g, b = u; returned twice), else a's and b's (du, dg)."""
    (m, width), device = ell_cols_MW.shape, ell_cols_MW.device
    slots = order_slots(ell_count_M, heavy_M)
    arrays = 1 if product else 2
    entries = torch.empty(arrays, math.ceil(m / 32) * DIRECT_LIST_CAP * 32, dtype=torch.int32, device=device)
    operands = (ell_cols_MW, ell_a_MW, ell_b_MW, ell_count_M, heavy_M, slots[0], entries[0], entries[-1])
    args = (*map(runtime.ptr, operands), *map(np.int32, (m, width, 2)))  # 16-column slices: two 16-byte pieces a row
    _launch("gate_up_then_down.cu", f"ell_to_slots<{str(product).lower()}>", math.ceil(m / 4), 4, args, device)
    return slots, (entries[0], entries[-1])


def _y_by_slices(
    w_down_t_NK: Tensor, ell_cols_MW: Tensor, ell_g_MW: Tensor, ell_u_MW: Tensor, ell_count_M: Tensor,
    heavy_M: Tensor, y_MK: Tensor,
) -> None:  # fmt: skip
    """y_MK's light rows = h w_down^T at the ELL entries (h = bf16(g * u), as train_fwd_gate rounds it), through the
    slices walk. Heavy rows are left unwritten."""
    (_, slot_counts_M, slot_tokens_M), (h_entries, _) = _slot_entries(
        ell_cols_MW, ell_g_MW, ell_u_MW, ell_count_M, heavy_M, product=True
    )
    slices_down(h_entries, slot_counts_M, slot_tokens_M, w_down_t_NK, y_MK)


def _dx_by_slices(
    w_gate_NK: Tensor, w_up_NK: Tensor, ell_cols_MW: Tensor, ell_du_MW: Tensor, ell_dg_MW: Tensor, ell_count_M: Tensor,
    heavy_M: Tensor, dx_MK: Tensor,
) -> None:  # fmt: skip
    """dx_MK's light rows = du w_up + dg w_gate at the ELL entries through the slices walk, one pass per weight, the
    fp32 sums carried from the first to the second (rounded once, as train_bwd_dx rounds them). The passes take the
    tokens DX_SUMS_BYTES of fp32 sums at a time, so that the sums add little to the backward's peak memory. Heavy rows
    are left unwritten."""
    m, k = ell_cols_MW.shape[0], w_up_NK.shape[1]
    (_, slot_counts_M, slot_tokens_M), (du_entries, dg_entries) = _slot_entries(
        ell_cols_MW, ell_du_MW, ell_dg_MW, ell_count_M, heavy_M, product=False
    )
    step = max(ORDER_GROUP, DX_SUMS_BYTES // (4 * k) // ORDER_GROUP * ORDER_GROUP)  # slots per pass: whole groups
    sums_SK = torch.empty(min(m, step), k, dtype=torch.float32, device=w_up_NK.device)
    for s0 in range(0, m, step):
        slots = (s0, min(m, s0 + step))
        slices_down(du_entries, slot_counts_M, slot_tokens_M, w_up_NK, None, sums_out_SK=sums_SK, slots=slots)
        slices_down(dg_entries, slot_counts_M, slot_tokens_M, w_gate_NK, dx_MK, sums_in_SK=sums_SK, slots=slots)


def _light_weight_gradients(
    csc: tuple[Tensor, ...], ell_h_MW: Tensor, ell_du_MW: Tensor, ell_dg_MW: Tensor, x_MK: Tensor, dy_MK: Tensor,
    outs: tuple[Tensor, Tensor, Tensor], add_gate_up: bool = False,
) -> None:  # fmt: skip
    """Writes the light tokens' (dW_gate, dW_up, dW_down^T) into outs ([N, K] each) through the transposed view
    csc (`csc_index`); with `add_gate_up`, adds dW_gate and dW_up to theirs."""
    k = outs[0].shape[1]
    width = ell_h_MW.shape[1]
    scratch, counters = wgrad_scratch(k, x_MK.device)
    _csc_wgrad(csc, (ell_dg_MW, ell_du_MW), x_MK, outs[:2], scratch, counters[0], width, add_gate_up)
    _csc_wgrad(csc, (ell_h_MW,), dy_MK, outs[2:], scratch, counters[1], width)


def _cuda_backward(
    x_MK, w_gate_NK, w_up_NK, w_down_KN, ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, heavy_counts,
    w_compute_RK, dy_MK, dl1, dx_slices=False, grads_into=None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    # grads_into: None, or float32 tensors shaped as the three weights (`step_scope.held_grads`) that the weight
    # gradients are added into; then None is returned for them.
    device = x_MK.device
    _require_kernels(device)
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    weight_dtype = w_gate_NK.dtype  # bf16, or fp32 master weights: their gradients skip the bf16 round trip
    w_gate_NK, w_up_NK, w_down_t_NK = split_compute_weights(w_compute_RK, w_gate_NK, w_up_NK)
    with runtime.on_device(device):
        dy_MK = dy_MK.to(torch.bfloat16).contiguous()
        dl1_1 = dl1.detach().to(device=device, dtype=torch.float32).reshape(1).contiguous()
        dx_MK, ell_h_MW, ell_du_MW, ell_dg_MW, csc = _light_backward(
            dy_MK, w_gate_NK, w_up_NK, w_down_t_NK, ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, dl1_1,
            dx_slices,
        )  # fmt: skip
        # The memory peaks are the sort of the transposed view's keys (its temporary buffers), then the weight
        # gradients with the view, then dW_down's transposed copy: the gradients are allocated after the sort, and
        # the view and the ELL values are freed before the copy.
        # dW_gate, dW_up and dW_down^T, each its own buffer (outputs of a custom op must not alias each other), in
        # the weights' dtype: the kernels round each fp32 sum once, so bf16 weights get bf16 gradients with no fp32
        # copy of them. Heavy tokens add their cuBLAS products to fp32 sums, rounded after. The weight-gradient
        # kernels write every row (empty columns included), so only an empty batch needs a fill.
        rows_R = heavy_rows(heavy_M, heavy_counts)
        sum_dtype = torch.float32 if rows_R.numel() else weight_dtype  # float32 wherever grads_into is given
        new = torch.empty if m else torch.zeros
        if grads_into is None:
            dw_gate_NK, dw_up_NK, dw_down_NK = (new(n, k, dtype=sum_dtype, device=device) for _ in range(3))
        else:  # dW_down^T still takes a buffer of its own, added to its gradient transposed
            dw_gate_NK, dw_up_NK, dw_down_NK = (*grads_into[:2], new(n, k, dtype=sum_dtype, device=device))
        if m:
            outs = (dw_gate_NK, dw_up_NK, dw_down_NK)
            _light_weight_gradients(csc, ell_h_MW, ell_du_MW, ell_dg_MW, x_MK, dy_MK, outs, grads_into is not None)
        del csc, ell_h_MW, ell_du_MW, ell_dg_MW
        if rows_R.numel():
            _backup_backward(
                x_MK, w_gate_NK, w_up_NK, w_down_t_NK.t(), rows_R, dy_MK, dl1_1, dx_MK, dw_gate_NK, dw_up_NK,
                dw_down_NK,
            )  # fmt: skip
        if grads_into is not None:
            transposed_copy(dw_down_NK, torch.float32, out=grads_into[2], add=True)
            return dx_MK, None, None, None
        return (
            dx_MK, dw_gate_NK.to(weight_dtype), dw_up_NK.to(weight_dtype), transposed_copy(dw_down_NK, weight_dtype)
        )  # fmt: skip


def backup_pointwise(gate_dg_RN: Tensor, up_du_RN: Tensor, dhd_h_RN: Tensor, dl1_1: Tensor) -> None:
    """The heavy tokens' pointwise backward step (`train_backup_grads`), in place on bf16 [R, N] tensors:
    x w_gate^T becomes dg, x w_up^T becomes du, dy w_down becomes h; dl1_1 is the fp32 [1] L1 gradient."""
    pieces = gate_dg_RN.numel() // 8  # N % 256 == 0
    args = (*map(runtime.ptr, (gate_dg_RN, up_du_RN, dhd_h_RN, dl1_1)), np.int64(pieces))
    kernel = runtime.get_function("train_backward.cu", "train_backup_grads", gate_dg_RN.device)
    runtime.launch(kernel, (math.ceil(pieces / BACKUP_GRADS_THREADS),), (BACKUP_GRADS_THREADS,), args, gate_dg_RN.device)


def _backup_backward(
    x_MK, w_gate_NK, w_up_NK, w_down_KN, rows_R, dy_MK, dl1_1, dx_MK, dw_gate_NK, dw_up_NK, dw_down_NK,
) -> None:  # fmt: skip
    """Heavy tokens' gradients: writes their dx rows, adds to the fp32 weight gradients ([N, K] each).

    g and u are recomputed from the tokens' x rows (the forward keeps no [R, N] rows and never learns R). Between
    cuBLAS GEMMs one kernel (`train_backup_grads`) does the pointwise steps, and the weight gradients are
    accumulated by the GEMMs themselves in fp32: a dozen launches where torch ops took about 35, which the host
    issues for every layer with heavy tokens, on a backward that can be waiting on the host (docs/benchmarks.md,
    2026-11-27).

    torch reference: the backup branch of formats.hybrid_gated_mlp_backward_ref.
    """
    x_RK, dy_RK = x_MK.index_select(0, rows_R), dy_MK.index_select(0, rows_R)
    # Named for what they hold once backup_pointwise has rewritten them.
    dg_RN, du_RN, h_RN = torch.mm(x_RK, w_gate_NK.t()), torch.mm(x_RK, w_up_NK.t()), torch.mm(dy_RK, w_down_KN)
    backup_pointwise(dg_RN, du_RN, h_RN, dl1_1)
    dx_MK.index_copy_(0, rows_R, torch.addmm(torch.mm(du_RN, w_up_NK), dg_RN, w_gate_NK))
    for dw_NK, grad_RN, src_RK in ((dw_gate_NK, dg_RN, x_RK), (dw_up_NK, du_RN, x_RK), (dw_down_NK, h_RN, dy_RK)):
        torch.addmm(dw_NK, grad_RN.t(), src_RK, out_dtype=torch.float32, out=dw_NK)


# ------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------


@torch.library.custom_op("sparsellm::twell_train_forward", mutates_args=())
def twell_train_forward_op(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, width: int, dx_slices: bool = False,
    dense_rows: int = 0,
) -> _Outputs:
    """Forward on the hybrid format: (y_MK, l1_sum, l0_M, fired_N, *state) with state as in STATE_NAMES
    (heavy_counts: a pinned CPU int32 [1]; w_compute_RK: `compute_weights`). `dx_slices` is for the backward:
    whether its light dx takes the slices walk (`dx_by_slices`). `dense_rows`: how many heavy tokens the CUDA forward
    computes through dense GEMMs (`twell_train_ffn`).

    Inputs are validated by `twell_train_ffn`; call that instead. This default implementation is the
    torch reference (any device); CUDA tensors take the kernels.
    """
    return _reference_forward(x_MK, w_gate_NK, w_up_NK, w_down_KN, width)


@torch.library.custom_op("sparsellm::twell_train_backward", mutates_args=())
def twell_train_backward_op(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor,
    ell_cols_MW: Tensor, ell_count_M: Tensor, heavy_M: Tensor, ell_g_MW: Tensor, ell_u_MW: Tensor,
    heavy_counts: Tensor, w_compute_RK: Tensor, dy_MK: Tensor, dl1: Tensor, dx_slices: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dx_MK, dw_gate_NK, dw_up_NK, dw_down_KN) given dy_MK and dl1 = dLoss/dl1_sum (a scalar tensor); the
    weight gradients in the weights' dtype."""
    return _reference_backward(
        x_MK, w_gate_NK, w_up_NK, w_down_KN, ell_cols_MW, ell_count_M, heavy_M, ell_g_MW, ell_u_MW, heavy_counts,
        w_compute_RK, dy_MK, dl1, dx_slices,
    )  # fmt: skip


twell_train_forward_op.register_kernel("cuda")(_cuda_forward)
twell_train_backward_op.register_kernel("cuda")(_cuda_backward)


@twell_train_forward_op.register_fake
def _forward_fake(x_MK, w_gate_NK, w_up_NK, w_down_KN, width, dx_slices=False, dense_rows=0):
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    i32 = torch.int32
    return (
        x_MK.new_empty(m, k), x_MK.new_empty((), dtype=_acc_dtype(x_MK.dtype)),
        x_MK.new_empty(m, dtype=i32), x_MK.new_empty(n, dtype=torch.bool),
        x_MK.new_empty(m, width, dtype=i32), x_MK.new_empty(m, dtype=i32), x_MK.new_empty(m, dtype=torch.bool),
        x_MK.new_empty(m, width), x_MK.new_empty(m, width), torch.empty(1, dtype=i32, device="cpu"),
        x_MK.new_empty(compute_weights_shape(w_gate_NK, x_MK.dtype)),
    )  # fmt: skip


@twell_train_backward_op.register_fake
def _backward_fake(x_MK, w_gate_NK, w_up_NK, w_down_KN, *_):
    return torch.empty_like(x_MK), torch.empty_like(w_gate_NK), torch.empty_like(w_up_NK), torch.empty_like(w_down_KN)


def _setup_context(ctx, inputs, output) -> None:
    x_MK, w_gate_NK, w_up_NK, w_down_KN, _, ctx.dx_slices, _ = inputs
    ctx.save_for_backward(x_MK, w_gate_NK, w_up_NK, w_down_KN, *output[4:])
    ctx.mark_non_differentiable(*output[2:])
    # No zero gradients for the nine state and statistics outputs (a fill and an allocation each per call, up to
    # [3N, K] for w_compute_RK): the backward takes None for them, and for y or l1_sum when the loss skips one.
    ctx.set_materialize_grads(False)


def _gradients(
    ctx, dy_MK, dl1, backward_impl
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, None, None, None]:
    """The op's input gradients through `backward_impl` (the backward custom op, or its implementation)."""
    saved = ctx.saved_tensors  # unpacked once: gradient checkpointing allows no second unpack
    x_MK = saved[0]
    dy_MK = torch.zeros_like(x_MK) if dy_MK is None else dy_MK
    dl1 = x_MK.new_zeros((), dtype=torch.float32) if dl1 is None else dl1
    dx_MK, dw_gate_NK, dw_up_NK, dw_down_KN = backward_impl(*saved, dy_MK, dl1, ctx.dx_slices)
    return dx_MK, dw_gate_NK, dw_up_NK, dw_down_KN, None, None, None


def _backward(ctx, dy_MK, dl1, *_):
    return _gradients(ctx, dy_MK, dl1, twell_train_backward_op)


twell_train_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerTrainFFN(torch.autograd.Function):
    """The op's eager route: the forward and backward implementations and the context of the custom ops above,
    without the custom ops' Python dispatch around them (per op two passes through the dispatcher, its argument
    defaults and its aliasing check: host time that a host-bound layer pays in full). torch.compile traces the
    custom ops instead.

    Inside `step_scope.optimizer_step` it also reuses the weights' casts over a step's micro-batches and adds the weight
    gradients into held `.grad` tensors (see there); the custom ops, whose schema is fixed, do neither."""

    @staticmethod
    def forward(ctx, x_MK, w_gate_NK, w_up_NK, w_down_KN, width, dx_slices, dense_rows):
        weights = (w_gate_NK, w_up_NK, w_down_KN)
        graphed = graphed_forward(w_gate_NK) if x_MK.is_cuda and graphing_forwards() else None
        cast_into = None if graphed is None else graphed.compute_buffer(w_gate_NK, x_MK.dtype)
        w_compute_RK = reused_cast(weights, x_MK.dtype, lambda: compute_weights(*weights, x_MK.dtype, out=cast_into))
        ctx.replay = None
        if graphed is not None:
            _require_kernels(x_MK.device)
            with runtime.on_device(x_MK.device):
                outputs, ctx.replay = graphed.forward(x_MK, w_gate_NK, w_up_NK, width, w_compute_RK, dense_rows)
        else:
            forward_impl = _cuda_forward if x_MK.is_cuda else _reference_forward  # what the forward custom op runs
            outputs = forward_impl(x_MK, *weights, width, dx_slices, dense_rows, w_compute_RK)
        _setup_context(ctx, (x_MK, *weights, width, dx_slices, dense_rows), outputs)
        ctx.add_into_grads = adding_into_grads()
        return outputs

    @staticmethod
    def backward(ctx, dy_MK, dl1, *_):
        if ctx.replay is not None:
            ctx.replay.check()

        def backward_impl(x_MK: Tensor, *args: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
            """What the backward custom op runs for x_MK's device, called directly, adding into held gradients where
            the forward was called to and the weights' gradients allow it. args[:3] are the weights, saved as
            inputs: unpacked, they are the tensors the forward was given."""
            into = held_grads(args[:3]) if ctx.add_into_grads else None
            return (_cuda_backward if x_MK.is_cuda else _reference_backward)(x_MK, *args, grads_into=into)

        return _gradients(ctx, dy_MK, dl1, backward_impl)


# ------------------------------------------------------------------------------------------------
# Public entry
# ------------------------------------------------------------------------------------------------


def twell_train_ffn(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, *, width: int = DEFAULT_WIDTH,
    l0_hint: tuple[float, float] | None = None, tail: Tail | None = None, dense_rows: int | None = None,
) -> FFNResult:
    """The gated FFN block for training on the hybrid sparse format, differentiable through y and l1_sum.

    Args:
        x_MK: tokens [M, K]. w_gate_NK, w_up_NK: [N, K]; w_down_KN: [K, N] (nn.Linear layouts).
            Under autocast x is cast to the autocast dtype; float32 weights (master weights) go in as they
            are, the op computes with its own copies in that dtype and returns float32 weight gradients with no
            rounding to bf16 on the way; weights in another dtype are cast first.
        width: ELL width W; tokens with more gate non-zeros are heavy: the forward splits each over a block
            of warps, the backward computes their gradients with cuBLAS on their rows.
        l0_hint: the layer's recent (mean, max) non-zeros per token, or None: picks the backward's dx walk
            (`dx_by_slices`); the results do not depend on it beyond fp32 summation order.
        tail: the layer's recent shares of heavy tokens (`backends.Tail`), or None.
        dense_rows: how many heavy tokens the forward takes through dense GEMMs over their gathered rows (the rest
            are split over blocks of warps), or None: as many as the inference route reserves from l0_hint and tail
            (`dense_row_capacity`; 0 without a hint). The results do not depend on it beyond rounding. Which heavy
            tokens take the rows follows the order the forward lists them in (atomics), so where they outnumber the
            rows, y's last bits can differ from run to run; with rows for all of them, y is repeatable bit for bit.

    Returns:
        FFNResult with y_MK, l1_sum (fp32 sum |h|), l0_M (int32 non-zeros of h per token), fired_N (bool),
        path "twell-train", overflow_rows = the heavy tokens (more than `width` gate non-zeros), as a pinned
        CPU int32 [1] that fills once the GPU has passed the call (`FFNResult.dense_rows()` reads it).
    """
    device_type = x_MK.device.type if isinstance(x_MK, torch.Tensor) else "cpu"
    tensors = (x_MK, w_gate_NK, w_up_NK, w_down_KN)
    if torch.is_autocast_enabled(device_type) and all(isinstance(t, torch.Tensor) for t in tensors):
        dtype = torch.get_autocast_dtype(device_type)
        tensors = (tensors[0].to(dtype), *(w if w.dtype == torch.float32 else w.to(dtype) for w in tensors[1:]))
    tensors = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in tensors)
    m, k, n = check_train_inputs(*tensors, width)
    dx_slices = dx_by_slices(m, k, n, width, l0_hint)
    if dense_rows is None:
        dense_rows = dense_row_capacity(m, l0_hint, width, tail)
    elif isinstance(dense_rows, bool) or not isinstance(dense_rows, int) or dense_rows < 0:
        raise ValueError(f"dense_rows={dense_rows!r}: give a row count >= 0 (0: every heavy token split over warps)")
    op = twell_train_forward_op if torch.compiler.is_compiling() else _EagerTrainFFN.apply
    with torch.autocast(device_type, enabled=False):
        outputs = op(*tensors, width, dx_slices, dense_rows)
    y_MK, l1_sum, l0_M, fired_N = outputs[:4]
    return FFNResult(y_MK=y_MK, l1_sum=l1_sum, l0_M=l0_M, fired_N=fired_N, path="twell-train",
                     overflow_rows=outputs[COUNTS_OUTPUT][:1])  # fmt: skip
