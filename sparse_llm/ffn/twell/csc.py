"""The column-major (CSC) view of the ELL entries, which the weight-gradient kernel walks.

The backward sorts the light tokens' entries by column (a stable sort of packed keys), finds each column's run and
cuts long columns into work chunks; its size is bounded by the ELL, so the transpose never overflows.
`csc_weight_gradients` then sums dW_gate, dW_up and dW_down column by column.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparse_llm.cuda import runtime
from sparse_llm.ffn.twell.train_launch import launch_train_kernel, wgrad_slices

# Work items of the weight-gradient kernel: a column of up to CSC_WHOLE_COLUMN entries is one item, which stores its
# rows (no zero fill, no atomics); that is above the typical column (M * L0 / N: 81 at 16384 tokens and 28 non-zeros
# of 5632). A longer column is cut into CSC_CHUNK-entry items that add theirs: a hot neuron is spread over many warps
# and no item is long enough to stretch the kernel's tail, which matters in a model, whose neurons fire unevenly
# (docs/kernels.md, tuned constants).
CSC_CHUNK = 64

CSC_WHOLE_COLUMN = 128

# ... and at denser layers up to this many times the mean column (train_csc_chunks reads the mean on the device):
# at 56 non-zeros per token of 16384 tokens the typical column has 163 entries, which a fixed 128 would cut into
# atomically added chunks on zeroed rows.
CSC_WHOLE_PER_MEAN = 2

CSC_COLUMNS_THREADS = 256  # threads per block of train_csc_columns (one per sorted entry, grid-stride)

CSC_COLUMNS_MAX_BLOCKS = 4096

CSC_CHUNKS_THREADS = 1024  # the one block of train_csc_chunks

# Scratch rows (per value array) in which the weight-gradient kernel sums the columns cut into several chunks: more
# than such columns are ever in flight at once (a few hundred warps' items), so no item waits for a slot.
WGRAD_SLOTS = 512

WGRAD_WARPS_PER_BLOCK = 4

WGRAD_BLOCKS_PER_SM = 8  # an upper bound on residency: surplus blocks find the work counter exhausted


def csc_key_dtype(n: int) -> torch.dtype:
    """dtype of the CSC sort keys (values 0..N): int16 where N fits, as the radix sort's passes follow the key's
    width (two over 16 bits, four over 32)."""
    return torch.int16 if n <= torch.iinfo(torch.int16).max else torch.int32


KEY_CTYPES = {torch.int16: "short", torch.int32: "int"}  # template argument `Key` of the kernels reading keys

OUT_CTYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16"}  # `Out` of the weight-gradient kernel


def csc_keys(ell_cols_MW: torch.Tensor, ell_count_M: torch.Tensor, heavy_M: torch.Tensor, n: int) -> torch.Tensor:
    """[M, W] in csc_key_dtype(n): each light ELL entry's column, N for unused and heavy-token slots (which so
    sort last).

    torch reference of the keys train_bwd_sddmm writes for the transposed (CSC) view.
    """
    width = ell_cols_MW.shape[1]
    used_MW = torch.arange(width, device=ell_cols_MW.device) < ell_count_M[:, None]
    used_MW &= ~heavy_M[:, None]
    return torch.where(used_MW, ell_cols_MW, n).to(csc_key_dtype(n))


def csc_order(key_MW: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The light ELL entries in column-major order: (order_E, col_start) with col_start int64 [N + 1].

    order_E lists positions m * W + s sorted by key (stable: ascending tokens within a column); column n
    owns order_E[col_start[n] : col_start[n + 1]]. torch reference of `csc_index` (and of the transposed
    view: formats.hybrid_t_matmul's entry list).
    """
    sorted_E, order_E = torch.sort(key_MW.flatten(), stable=True)
    col_start = torch.searchsorted(sorted_E, torch.arange(n + 1, dtype=sorted_E.dtype, device=sorted_E.device))
    return order_E, col_start


def csc_whole_column(col_start: torch.Tensor) -> int:
    """The longest column that is one work item: CSC_WHOLE_COLUMN, or CSC_WHOLE_PER_MEAN times the mean column if
    that is more (integer arithmetic, as train_csc_chunks)."""
    n = col_start.numel() - 1
    return max(CSC_WHOLE_COLUMN, CSC_WHOLE_PER_MEAN * int(col_start[-1]) // max(n, 1))


def csc_chunk_starts(col_start: torch.Tensor) -> torch.Tensor:
    """int64 [N + 1]: where column n's work chunks start in the list of all chunks: one for a column of up to
    `csc_whole_column` entries (empty columns included), else one per CSC_CHUNK entries."""
    entries = col_start.diff()
    chunks = torch.where(entries > csc_whole_column(col_start), (entries + CSC_CHUNK - 1) // CSC_CHUNK, 1)
    chunk_start = torch.zeros_like(col_start)
    torch.cumsum(chunks, 0, out=chunk_start[1:])
    return chunk_start


def csc_chunk_columns(chunk_start: torch.Tensor) -> torch.Tensor:
    """int32 [chunk_start[N]]: the column of each work chunk. torch reference of train_csc_chunks' map."""
    n = chunk_start.numel() - 1
    columns = torch.arange(n, dtype=torch.int32, device=chunk_start.device)
    return torch.repeat_interleave(columns, chunk_start.diff())


def csc_shared_ranks(chunk_start: torch.Tensor) -> torch.Tensor:
    """int32 [N]: how many columns before each have more than one work chunk (a many-chunk column's rank, which
    picks its scratch slot). torch reference of train_csc_chunks' ranks."""
    many = (chunk_start.diff() > 1).to(torch.int32)
    return torch.cumsum(many, 0, dtype=torch.int32) - many


def csc_index(
    key_MW: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        runtime.ptr(col_start),
        runtime.ptr(chunk_start),
        runtime.ptr(chunk_col),
        runtime.ptr(shared_rank),
        np.int32(n),
        np.int32(CSC_CHUNK),
        np.int32(CSC_WHOLE_COLUMN),
        np.int32(CSC_WHOLE_PER_MEAN),
    )
    runtime.launch(chunks, (1,), (CSC_CHUNKS_THREADS,), args, device)
    return order_E, col_start, chunk_start, chunk_col, shared_rank


def wgrad_scratch(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scratch, counters) for two `csc_weight_gradients` launches in a row: a zeroed fp32 [WGRAD_SLOTS * 2, K] that
    each
    launch leaves zeroed, and zeroed int64 [2, 1 + 2 * WGRAD_SLOTS] counters, a row per launch."""
    scratch = torch.zeros(WGRAD_SLOTS * 2, k, dtype=torch.float32, device=device)
    return scratch, torch.zeros(2, 1 + 2 * WGRAD_SLOTS, dtype=torch.int64, device=device)


def csc_weight_gradients(
    csc: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    src_MK: torch.Tensor,
    outs: tuple[torch.Tensor, ...],
    scratch: torch.Tensor,
    counters: torch.Tensor,
    width: int,
    add: bool = False,
) -> None:
    """Writes every row of each [N, K] out (fp32 or bf16, one per value array: 1 or 2): row n = the fp32 sum over
    column n's entries of value * src_MK[token], rounded once to the out's dtype; with `add`, adds it to row n.

    csc = `csc_index`'s five tensors; scratch and counters: `wgrad_scratch`'s, the counters one row of them.
    """
    device = src_MK.device
    n, k = outs[0].shape
    sms = runtime.sm_count(device)
    kw, parts = wgrad_slices(k)
    args = (
        *(runtime.ptr(t) for t in csc),
        runtime.ptr(values[0]),
        runtime.ptr(values[-1]),
        runtime.ptr(src_MK),
        runtime.ptr(outs[0]),
        runtime.ptr(outs[-1]),
        runtime.ptr(scratch),
        runtime.ptr(counters),
        np.int32(n),
        np.int32(k),
        np.int32(width),
        np.int32(CSC_CHUNK),
        np.int32(parts),
        np.int32(WGRAD_SLOTS),
        np.int32(add),
    )
    kernel = f"train_csc_wgrad<{kw},{len(values)},{OUT_CTYPES[outs[0].dtype]}>"
    launch_train_kernel("train_backward.cu", kernel, sms * WGRAD_BLOCKS_PER_SM, WGRAD_WARPS_PER_BLOCK, args, device)
