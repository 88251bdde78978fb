"""The decode kernel: a gated block of up to DECODE_MAX_M tokens in one launch (kernels/decode_ffn.cu).

Few tokens cannot share weight rows, so the block is bound by the bytes it reads: all of w_gate, and of w_up and
w_down only the rows of neurons some token fires. The workspace its last block leaves zeroed is kept per device
and shape, so a call is a single launch (what a decoding step replayed in a CUDA graph needs).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparse_llm.cuda import runtime
from sparse_llm.cuda.kernel_constants import DECODE_GROUP_M, DECODE_MAX_M, DECODE_MMA_NEURONS, DECODE_WARPS
from sparse_llm.ffn.twell.cost_model import decode_block_sums, decode_mma_gate
from sparse_llm.ffn.twell.infer_launch import as_i32

DECODE_BLOCKS_PER_SM = 2

DECODE_FINISH_THREADS = 256  # threads per block of decode_finish (graphed calls)


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
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    residual_MK: torch.Tensor | None = None,
    l0_max: float | None = None,
    statistics: bool = True,
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
    args = (
        *map(runtime.ptr, operands),
        *parts,
        *map(runtime.ptr, (residual_MK, *outs, fired_N)),
        as_i32(m),
        as_i32(k),
        as_i32(n),
    )
    runtime.launch(kernel, (blocks, groups), (DECODE_WARPS * 32,), args, device, shared_mem=smem)
    if graphed:
        pieces = m * k // 8
        blocks = min(math.ceil(pieces / DECODE_FINISH_THREADS), runtime.sm_count(device))
        args = (runtime.ptr(workspace), runtime.ptr(residual_MK), runtime.ptr(y_MK), as_i32(pieces))
        finish = runtime.get_function("decode_ffn.cu", "decode_finish", device)
        runtime.launch(finish, (blocks,), (DECODE_FINISH_THREADS,), args, device)
    return y_MK, l1_M, l0_M, fired_N
