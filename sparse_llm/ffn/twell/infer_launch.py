"""Launchers of the inference kernels: the gate GEMM's TwELL packing, the up + down walks and the dense rows.

Each function takes torch tensors, checks what the kernel relies on and queues the kernel on torch's current stream
(`sparse_llm.cuda.runtime`); none waits for the GPU. The route that strings them together is `infer_op`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sparse_llm.cuda import runtime, tensor_map
from sparse_llm.cuda.kernel_constants import (
    DENSE_ROWS_THREADS,
    DIRECT_LIST_CAP,
    FIRST_PART,
    GATE_BLOCK_M,
    GATE_CLUSTER,
    GATE_SMEM_BYTES,
    GATE_THREADS,
    LAST_PART,
    ORDER_GROUP,
)
from sparse_llm.ffn.twell.cost_model import DENSE_ROW_NNZ, SPLIT_BELOW_M, Columns, column_parts, slice_width
from sparse_llm.ffn.twell.validation import check_2d, check_operands, check_tensor
from sparse_llm.formats.constants import SLOTS, TILE

# Warps (one per token) per block of the one-warp-per-token kernels (the training kernels' walks): one, so a block's
# registers are freed with its token rather than with the
# slowest of several.
TOKENS_PER_BLOCK = 1


# The direct route walks the non-zeros in one of two ways (`direct_walk` picks by price):
# - "rows" (kernels/gate_up_down.cu): one pass; per non-zero a warp reads its w_up and w_down rows from L2.
# - "slices" (kernels/gate_up_then_down.cu): an up walk reads one w_up row per non-zero and writes h; then each SM keeps
#   KS columns of w_down (all N rows) in shared memory and its threads, one per token, read KS weights per non-zero
#   from there, KS columns at a time. It pays where many tokens share each slice (large M); the tokens are ordered
#   by count first, so that the 32 a warp walks together take about equally long.
WALKS = ("rows", "slices")


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
        args = (runtime.ptr(src), runtime.ptr(out), as_i32(rows), as_i32(cols), as_i32(add))
        runtime.launch(kernel, (cols // 32, rows // 32), (32, 8), args, src.device)
    return out


class TransposeCache:
    """w [K, N] -> contiguous w^T [N, K], rebuilt when the weight tensor changes (new object, storage or version)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}

    def get(self, w_KN: torch.Tensor) -> torch.Tensor:
        key = id(w_KN)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is w_KN and entry[1] == _version(w_KN) and entry[2] == w_KN.data_ptr():
            return entry[3]
        w_t_NK = transposed_copy(w_KN, w_KN.dtype)
        ref = weakref.ref(w_KN, lambda _, key=key: self._entries.pop(key, None))
        self._entries[key] = (ref, _version(w_KN), w_KN.data_ptr(), w_t_NK)
        return w_t_NK

    def __len__(self) -> int:
        return len(self._entries)


DOWN_TRANSPOSES = TransposeCache()


def as_i32(value: int) -> np.int32:
    return np.int32(value)


def twell_gate(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, overflow_gate_MN: torch.Tensor | None = None
) -> torch.Tensor:
    """TwELL-packed relu(x w_gate^T): int32 [M, (N/256) * 32] (layout: sparse_llm.formats), from the wgmma gate GEMM
    whose epilogue packs (kernels/twell_gate_wgmma.cu): no dense gate is written.

    Args:
        x_MK: bf16 [M, K] on a Hopper GPU, contiguous, K % 64 == 0.
        w_gate_NK: bf16 [N, K] (gate_proj.weight), N % 256 == 0.
        overflow_gate_MN: bf16 [M, N] or None: the GEMM writes there the 256 pre-activation
            values of every (token, tile) whose segment overflows, and nothing else.
    """
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    device = x_MK.device
    packed_MS = torch.empty(m, n // TILE * SLOTS, dtype=torch.int32, device=device)
    if m == 0:
        return packed_MS
    kernel = runtime.get_function("twell_gate_wgmma.cu", "twell_gate_wgmma", device)
    runtime.set_dynamic_smem(kernel, GATE_SMEM_BYTES)
    items = math.ceil(m / (GATE_CLUSTER * GATE_BLOCK_M)) * (n // TILE)
    w_map = tensor_map.bf16_box_map(w_gate_NK, TILE // GATE_CLUSTER)
    operands = (runtime.ptr(packed_MS), runtime.ptr(overflow_gate_MN))
    args = (tensor_map.bf16_box_map(x_MK, GATE_BLOCK_M), w_map, *operands, as_i32(m), as_i32(n), as_i32(k))
    grid = (GATE_CLUSTER * min(items, runtime.sm_count(device) // GATE_CLUSTER),)  # persistent: clusters walk items
    runtime.launch(kernel, grid, (GATE_THREADS,), args, device, shared_mem=GATE_SMEM_BYTES)
    return packed_MS


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
    check_2d(x_MK, "x_MK", "[M, K]; flatten leading dims with x.reshape(-1, K)")
    check_2d(gate_MN, "gate_MN", "[M, N], the pre-activation gate x w_gate^T")
    m, k = x_MK.shape
    n = gate_MN.shape[1]
    if norm is not None:
        check_output_norm(norm, x_MK, walk)
    check_operands(
        x_MK,
        n,
        [
            ("gate_MN", gate_MN, (m, n), "the pre-activation gate x w_gate^T [M, N]"),
            ("w_up_NK", w_up_NK, (n, k), "up_proj.weight in nn.Linear layout [N, K]"),
            ("w_down_t_NK", w_down_t_NK, (n, k), "down_proj.weight transposed to [N, K], contiguous"),
            *(
                [("residual_MK", residual_MK, (m, k), "the residual stream [M, K], bf16, contiguous")]
                if residual_MK is not None
                else []
            ),
        ],
    )
    columns = column_parts(k, n, parts)  # checks `parts`
    if walk == "slices" and slice_width(n) is None:
        raise ValueError(f"walk='slices': a slice of w_down's N={n} rows does not fit shared memory; use walk='rows'")
    if isinstance(dense_rows, bool) or not isinstance(dense_rows, int) or dense_rows < 0:
        raise ValueError(f"dense_rows={dense_rows!r}: give a row count >= 0 (0: no dense rows)")
    return launch_direct_up_down(
        x_MK, gate_MN, w_up_NK, w_down_t_NK, split_nnz, residual_MK, columns, walk, dense_rows, norm
    )


def check_output_norm(norm: OutputNorm, x_MK: torch.Tensor, walk: str) -> None:
    if walk != "rows":
        raise ValueError(f"norm: walk={walk!r} stores y in column slices, a row at a time only walk='rows' can norm it")
    m, k = x_MK.shape
    check_tensor(norm.weight_K, "norm.weight_K", (k,), "the RMSNorm weight [K]")
    check_tensor(norm.out_MK, "norm.out_MK", (m, k), "the normed rows [M, K]")
    for name, t in (("norm.weight_K", norm.weight_K), ("norm.out_MK", norm.out_MK)):
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")


def launch_direct_up_down(
    x_MK: torch.Tensor,
    gate_MN: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    split_nnz: int,
    residual_MK: torch.Tensor | None = None,
    columns: Columns | None = None,
    walk: str = "rows",
    dense_rows: int = 0,
    norm: OutputNorm | None = None,
    packed_MS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
            rows_M, count_1 = dense_heavy_rows(
                x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, residual_MK, dense_rows, norm
            )
        split_token_up_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, residual_MK, norm=norm, **part)

    if walk == "slices":
        _up_then_down(
            x_MK, gate_MN, w_up_NK, w_down_t_NK, split_nnz, residual_MK, outs, heavy_rows_M, heavy_counts, packed_MS
        )
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
        operands = (
            gate,
            heavy_gate,
            x_MK,
            w_up_NK,
            w_down_t_NK,
            y_MK,
            residual_MK,
            l1_M,
            l0_M,
            fired_N,
            heavy_rows_M,
            count_1,
            partial_MK,
        )
        args = (*(runtime.ptr(t) for t in operands), *map(as_i32, (m, k, n, split, begin, end, part)), *norm_args(norm))
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
    x_MK: torch.Tensor,
    gate_MN: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    split_nnz: int,
    residual_MK: torch.Tensor | None,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    heavy_rows_M: torch.Tensor,
    count_1: torch.Tensor,
    packed_MS: torch.Tensor | None = None,
) -> None:
    """The light tokens of the "slices" walk (kernels/gate_up_then_down.cu) into outs = (y_MK, l1_M, l0_M, fired_N) as
    `launch_direct_up_down` allocates them: the up walk lists each token's positives and writes its h entries (a
    token with
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
    args = (*(runtime.ptr(t) for t in operands), *map(as_i32, (m, k, n, split, ks // 8)))
    # two row slots, the list, two barriers (up_barriers_offset in the kernel)
    runtime.launch(up, (m,), (32,), args, device, shared_mem=2 * kv * 512 + DIRECT_LIST_CAP * 4 + 16)
    token_slots_M, slot_counts_M, slot_tokens_M = order_slots(counts_M)
    to_slots = runtime.get_function("gate_up_then_down.cu", "entries_to_slots", device)
    operands = (entries, counts_M, token_slots_M, slot_entries)
    fours = chunks * 32 * DIRECT_LIST_CAP // 4  # one thread per 16 bytes of entries; a multiple of 256
    runtime.launch(to_slots, (fours // 256,), (256,), (*map(runtime.ptr, operands), as_i32(m)), device)
    slices_down(slot_entries, slot_counts_M, slot_tokens_M, w_down_t_NK, y_MK, residual_MK)


def order_slots(counts_M: torch.Tensor, heavy_M: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(token_slots_M, slot_counts_M, slot_tokens_M), int32 [M] each: order_tokens's places for the tokens of
    counts_M (int32 [M] entries per token, -1 or heavy_M (bool [M]) for a token with none on the slices walk), by
    descending count within groups of ORDER_GROUP."""
    m = counts_M.shape[0]
    token_slots_M, slot_counts_M, slot_tokens_M = torch.empty(3, m, dtype=torch.int32, device=counts_M.device)
    order = runtime.get_function("gate_up_then_down.cu", "order_tokens", counts_M.device)
    operands = (counts_M, heavy_M, token_slots_M, slot_counts_M, slot_tokens_M)
    runtime.launch(
        order, (math.ceil(m / ORDER_GROUP),), (ORDER_GROUP,), (*map(runtime.ptr, operands), as_i32(m)), counts_M.device
    )
    return token_slots_M, slot_counts_M, slot_tokens_M


def slices_down(
    slot_entries: torch.Tensor,
    slot_counts_M: torch.Tensor,
    slot_tokens_M: torch.Tensor,
    w_NK: torch.Tensor,
    out_MK: torch.Tensor | None,
    residual_MK: torch.Tensor | None = None,
    sums_in_SK: torch.Tensor | None = None,
    sums_out_SK: torch.Tensor | None = None,
    slots: tuple[int, int] | None = None,
) -> None:
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
    operands = (entries, slot_counts_M[s0:s1], slot_tokens_M[s0:s1], w_NK, out_MK, residual_MK, sums_in_SK, sums_out_SK)
    args = (*map(runtime.ptr, operands), *map(as_i32, (s1 - s0, k, n, s0)))
    runtime.launch(down, (blocks,), (1024,), args, device, shared_mem=smem)


def split_token_up_down(
    x_MK: torch.Tensor,
    gate_MN: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    rows_M: torch.Tensor,
    count_1: torch.Tensor,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    residual_MK: torch.Tensor | None = None,
    partial_MK: torch.Tensor | None = None,
    columns: tuple[int, int] | None = None,
    part: int = FIRST_PART | LAST_PART,
    norm: OutputNorm | None = None,
) -> None:
    """Writes the y, l1 and l0 rows of the tokens rows_M[: count_1[0]] and sets their fired neurons, each token
    split over a block of warps (gate_up_down_heavy). rows_M: int32 [M]; count_1: int32 [1], read on the device,
    so the host never learns it. outs = (y_MK, l1_M, l0_M, fired_N) as `launch_direct_up_down` allocates them; y rows
    include residual_MK's (bf16 [M, K]) when given. For one column part of several (`launch_direct_up_down`): columns
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
    args = (*(runtime.ptr(t) for t in operands), *map(as_i32, (k, n, begin, end, part)), *norm_args(norm))
    runtime.launch(heavy, (blocks,), (32 * warps,), args, device, shared_mem=smem)


def dense_heavy_rows(
    x_MK: torch.Tensor,
    gate_MN: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_t_NK: torch.Tensor,
    rows_M: torch.Tensor,
    count_1: torch.Tensor,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    residual_MK: torch.Tensor | None,
    capacity: int,
    norm: OutputNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    runtime.launch(gather, grid, block, (*map(runtime.ptr, operands), as_i32(capacity), as_i32(k)), device)
    h_CN = F.linear(x_CK, w_up_NK)  # u, made h in place
    hidden = runtime.get_function("dense_rows.cu", "dense_rows_h", device)
    operands = (gate_MN, rows_M, count_1, h_CN, l1_M, l0_M, fired_N)
    runtime.launch(hidden, grid, block, (*map(runtime.ptr, operands), as_i32(capacity), as_i32(n)), device)
    y_CK = torch.mm(h_CN, w_down_t_NK)
    scatter = runtime.get_function("dense_rows.cu", "scatter_dense_rows", device)
    operands = (y_CK, rows_M, count_1, residual_MK, y_MK)
    runtime.launch(
        scatter, grid, block, (*map(runtime.ptr, operands), as_i32(capacity), as_i32(k), *norm_args(norm)), device
    )
    return rows_M[capacity:], rest_1


def dense_row_stats(h_RN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum |h| per row in fp32 [R], non-zeros per row int32 [R], fired neurons bool [N]) of a dense h [R, N]."""
    nonzero_RN = h_RN != 0
    return h_RN.float().abs().sum(dim=1), nonzero_RN.sum(dim=1, dtype=torch.int32), nonzero_RN.any(dim=0)
