"""Launchers of the training op's forward kernels, and the layout of the op's outputs.

`forward_kernels` queues the gate GEMM's consumers (light tokens' ELL rows, u, h, L1, L0 and y; the heavy tokens'
dense rows) on torch's current stream and reads nothing back: the heavy-token count reaches the host by an
asynchronous copy (`new_counts_host`). The graphed forward (`graphs`) captures exactly these launches.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from sparse_llm.cuda import runtime
from sparse_llm.cuda.kernel_constants import DIRECT_LIST_CAP
from sparse_llm.ffn.backend import landed
from sparse_llm.ffn.twell import cost_model
from sparse_llm.ffn.twell.infer_launch import (
    TOKENS_PER_BLOCK,
    dense_heavy_rows,
    flagged_parts,
    order_slots,
    slices_down,
    split_token_up_down,
    transposed_copy,
)

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


WGRAD_PIECES = 4  # 16-byte pieces per lane of one K slice in the weight-gradient kernel (1024 columns)

OpOutputs = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_weights(
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
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


def compute_weights_shape(w_gate_NK: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """[N, K] (w_down^T alone) where the weights are in `dtype`, else [3N, K]: `compute_weights`' output."""
    n, k = w_gate_NK.shape
    return (n, k) if w_gate_NK.dtype == dtype else (3 * n, k)


def split_compute_weights(
    w_RK: torch.Tensor, w_gate_NK: torch.Tensor, w_up_NK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate, w_up, w_down^T) in the compute dtype from `compute_weights`' output (and the op's inputs)."""
    n = w_gate_NK.shape[0]
    if w_RK.shape[0] == 3 * n:
        return w_RK[:n], w_RK[n : 2 * n], w_RK[2 * n :]
    return w_gate_NK, w_up_NK, w_RK


def launch_train_kernel(
    filename: str, name: str, grid: int, warps: int, args: tuple, device: torch.device, smem: int = 0
) -> None:
    kernel = runtime.get_function(filename, name, device)
    runtime.set_dynamic_smem(kernel, smem)
    runtime.launch(kernel, (grid,), (32 * warps,), args, device, shared_mem=smem)


def row_pieces(k: int) -> int:
    """KV of the kernels: 16-byte pieces per lane of a K-wide bf16 row (lane owns 8 of every 256 columns)."""
    return math.ceil(k / 256)


def wgrad_slices(k: int) -> tuple[int, int]:
    """(KW, parts) of the weight-gradient kernel: K is cut into `parts` slices of KW pieces per lane."""
    kw = min(row_pieces(k), WGRAD_PIECES)
    return kw, math.ceil(row_pieces(k) / kw)


def require_kernels(device: torch.device) -> None:
    reason = runtime.unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(
            f"The twell training kernels cannot run on {device}: {reason} Use kernel=torch (or auto) there."
        )


def heavy_rows(heavy_M: torch.Tensor, heavy_counts: torch.Tensor) -> torch.Tensor:
    """The heavy tokens of a forward, ascending: int64 [R] (R = heavy_counts[0] once its copy has landed).

    nonzero_static, unlike nonzero, is sized by the host and so does not wait for the device.
    """
    return torch.nonzero_static(heavy_M, size=landed(heavy_counts)[0])[:, 0]


def backup_gate_up(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, w_up_NK: torch.Tensor, rows_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy tokens' dense gate and up rows for the torch reference's backward: (g_RN = relu(x w_gate^T),
    u_RN = x w_up^T masked by g's support), recomputed as the CUDA backward recomputes them (`backup_backward`).

    torch reference: the backup branch of formats.hybrid_sddmm / pack_hybrid.
    """
    x_RK = x_MK.index_select(0, rows_R)
    g_RN = F.relu(F.linear(x_RK, w_gate_NK))
    return g_RN, torch.where(g_RN != 0, F.linear(x_RK, w_up_NK), 0)


def new_counts_host() -> torch.Tensor:
    """A pinned CPU int32 [1] for the heavy-token count, -1 until its copy lands (`ffn.backend.landed`)."""
    return torch.full((1,), -1, dtype=torch.int32, pin_memory=True)


def forward_kernels(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    width: int,
    w_compute_RK: torch.Tensor,
    counts_host: torch.Tensor | None = None,
    gate_MN: torch.Tensor | None = None,
    dense_rows: int = 0,
) -> OpOutputs:
    """The CUDA forward on the current device and stream: `_cuda_forward`'s outputs, with the heavy-token count
    copied into counts_host (`new_counts_host`) as soon as it is known, or, where counts_host is None (a CUDA graph
    capture, `twell.graphs`), left on the device in its place (int32 [1]). gate_MN: where the gate GEMM writes (bf16
    [M, N]), else a new tensor. dense_rows: how many heavy tokens take dense GEMMs over their gathered rows; the rest
    are split over blocks of warps. Issues no host sync."""
    device = x_MK.device
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    i32, bf16 = torch.int32, torch.bfloat16
    w_gate_NK, w_up_NK, w_down_t_NK = split_compute_weights(w_compute_RK, w_gate_NK, w_up_NK)
    # Three allocations, not views of one: outputs of a custom op must not alias each other. The kernel writes
    # their zero padding (value 0, column 0, as in sparse_llm/formats), so the state is deterministic.
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
        kv = row_pieces(k)
        by_slices = cost_model.walk_by_slices(cost_model.FWD_WALK, m, k, n, width)
        columns = [(0, n)] if by_slices else cost_model.walk_column_parts(k, n)[0]
        # y's fp32 sums carried from one column part to the next
        partial_MK = torch.empty(m, k, dtype=torch.float32, device=device) if len(columns) > 1 else None
        operands = (
            gate_MN,
            x_MK,
            w_up_NK,
            w_down_t_NK,
            ell_cols_MW,
            ell_g_MW,
            ell_u_MW,
            ell_count_M,
            heavy_M,
            heavy_list,
            heavy_count,
            y_MK,
            l1_M,
            l0_M,
            fired_N,
            partial_MK,
        )
        smem = TOKENS_PER_BLOCK * (kv * 32 * 16 + width * 4)  # per warp: the x row, the token's entry list
        blocks = math.ceil(m / TOKENS_PER_BLOCK)
        name = f"train_fwd_gate<{kv},{str(not by_slices).lower()}>"  # without its down half for the slices
        for (begin, end), part in flagged_parts(columns):
            args = (*map(runtime.ptr, operands), *map(np.int32, (m, k, n, width, begin, end, part)))
            launch_train_kernel("train_forward.cu", name, blocks, TOKENS_PER_BLOCK, args, device, smem)
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
            rows_M, count_1 = dense_heavy_rows(
                x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs, None, min(dense_rows, m)
            )
        split_token_up_down(x_MK, gate_MN, w_up_NK, w_down_t_NK, rows_M, count_1, outs)
    return (
        y_MK,
        l1_M.sum(),
        l0_M,
        fired_N.bool(),
        ell_cols_MW,
        ell_count_M,
        heavy_M,
        ell_g_MW,
        ell_u_MW,
        heavy_count if counts_host is None else counts_host,
        w_compute_RK,
    )


def slot_entries(
    ell_cols_MW: torch.Tensor,
    ell_a_MW: torch.Tensor,
    ell_b_MW: torch.Tensor,
    ell_count_M: torch.Tensor,
    heavy_M: torch.Tensor,
    product: bool,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
    """The light tokens ordered by count (order_slots: (token_slots, slot_counts, slot_tokens)) and their entries in
    slot order (ell_to_slots): h = a * b when `product` (a = g, b = u; returned twice), else a's and b's (du, dg)."""
    (m, width), device = ell_cols_MW.shape, ell_cols_MW.device
    slots = order_slots(ell_count_M, heavy_M)
    arrays = 1 if product else 2
    entries = torch.empty(arrays, math.ceil(m / 32) * DIRECT_LIST_CAP * 32, dtype=torch.int32, device=device)
    operands = (ell_cols_MW, ell_a_MW, ell_b_MW, ell_count_M, heavy_M, slots[0], entries[0], entries[-1])
    args = (*map(runtime.ptr, operands), *map(np.int32, (m, width, 2)))  # 16-column slices: two 16-byte pieces a row
    launch_train_kernel(
        "gate_up_then_down.cu", f"ell_to_slots<{str(product).lower()}>", math.ceil(m / 4), 4, args, device
    )
    return slots, (entries[0], entries[-1])


def _y_by_slices(
    w_down_t_NK: torch.Tensor,
    ell_cols_MW: torch.Tensor,
    ell_g_MW: torch.Tensor,
    ell_u_MW: torch.Tensor,
    ell_count_M: torch.Tensor,
    heavy_M: torch.Tensor,
    y_MK: torch.Tensor,
) -> None:
    """y_MK's light rows = h w_down^T at the ELL entries (h = bf16(g * u), as train_fwd_gate rounds it), through the
    slices walk. Heavy rows are left unwritten."""
    (_, slot_counts_M, slot_tokens_M), (h_entries, _) = slot_entries(
        ell_cols_MW, ell_g_MW, ell_u_MW, ell_count_M, heavy_M, product=True
    )
    slices_down(h_entries, slot_counts_M, slot_tokens_M, w_down_t_NK, y_MK)
