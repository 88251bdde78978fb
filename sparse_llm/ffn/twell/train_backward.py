"""The training op's CUDA backward: dh at the support, dx, the weight gradients, the heavy tokens' rows.

Light tokens go through the sparse kernels (kernels/train_backward.cu): an SDDMM gives dh, du and dg at the ELL
entries, dx is walked by rows or by slices (`dx_by_slices`), and the weight gradients come from the CSC view
(`csc`) on a side stream. Heavy tokens go through cuBLAS GEMMs around one pointwise kernel.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparse_llm.cuda import runtime
from sparse_llm.cuda.kernel_constants import BACKUP_GRADS_THREADS, ORDER_GROUP
from sparse_llm.ffn.twell import cost_model
from sparse_llm.ffn.twell.csc import KEY_CTYPES, csc_index, csc_key_dtype, csc_weight_gradients, wgrad_scratch
from sparse_llm.ffn.twell.infer_launch import TOKENS_PER_BLOCK, flagged_parts, slices_down, transposed_copy
from sparse_llm.ffn.twell.train_launch import (
    heavy_rows,
    launch_train_kernel,
    require_kernels,
    row_pieces,
    slot_entries,
    split_compute_weights,
)

DX_SUMS_BYTES = 32 << 20  # fp32 sums the slices walk of dx holds at once (4096 tokens at K = 2048)


def _light_backward(
    dy_MK,
    w_gate_NK,
    w_up_NK,
    w_down_t_NK,
    ell_cols_MW,
    ell_count_M,
    heavy_M,
    ell_g_MW,
    ell_u_MW,
    dl1_1,
    dx_slices,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
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
        kv = row_pieces(k)
        blocks = math.ceil(m / TOKENS_PER_BLOCK)
        _, sddmm_columns, dx_columns = cost_model.walk_column_parts(k, n)
        operands = (
            dy_MK,
            w_down_t_NK,
            ell_cols_MW,
            ell_g_MW,
            ell_u_MW,
            ell_count_M,
            heavy_M,
            dl1_1,
            ell_h_MW,
            ell_du_MW,
            ell_dg_MW,
            key_MW,
        )
        smem = TOKENS_PER_BLOCK * kv * 32 * 16
        sddmm = f"train_bwd_sddmm<{kv},{KEY_CTYPES[key_MW.dtype]}>"
        for (begin, end), part in flagged_parts(sddmm_columns):
            args = (*map(runtime.ptr, operands), *map(np.int32, (m, n, k, width, begin, end, part)))
            launch_train_kernel("train_backward.cu", sddmm, blocks, TOKENS_PER_BLOCK, args, device, smem)
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
            operands = (w_gate_NK, w_up_NK, ell_cols_MW, ell_du_MW, ell_dg_MW, ell_count_M, heavy_M, dx_MK, partial_MK)
            for (begin, end), part in flagged_parts(dx_columns):
                args = (*map(runtime.ptr, operands), *map(np.int32, (m, n, k, width, begin, end, part)))
                launch_train_kernel("train_backward.cu", f"train_bwd_dx<{kv}>", blocks, TOKENS_PER_BLOCK, args, device)
        main.wait_stream(side)
        for t in csc:  # allocated on the side stream, used and freed on this one
            t.record_stream(main)
    else:
        csc = ()
    return dx_MK, ell_h_MW, ell_du_MW, ell_dg_MW, csc


def _dx_by_slices(
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    ell_cols_MW: torch.Tensor,
    ell_du_MW: torch.Tensor,
    ell_dg_MW: torch.Tensor,
    ell_count_M: torch.Tensor,
    heavy_M: torch.Tensor,
    dx_MK: torch.Tensor,
) -> None:
    """dx_MK's light rows = du w_up + dg w_gate at the ELL entries through the slices walk, one pass per weight, the
    fp32 sums carried from the first to the second (rounded once, as train_bwd_dx rounds them). The passes take the
    tokens DX_SUMS_BYTES of fp32 sums at a time, so that the sums add little to the backward's peak memory. Heavy rows
    are left unwritten."""
    m, k = ell_cols_MW.shape[0], w_up_NK.shape[1]
    (_, slot_counts_M, slot_tokens_M), (du_entries, dg_entries) = slot_entries(
        ell_cols_MW, ell_du_MW, ell_dg_MW, ell_count_M, heavy_M, product=False
    )
    step = max(ORDER_GROUP, DX_SUMS_BYTES // (4 * k) // ORDER_GROUP * ORDER_GROUP)  # slots per pass: whole groups
    sums_SK = torch.empty(min(m, step), k, dtype=torch.float32, device=w_up_NK.device)
    for s0 in range(0, m, step):
        slots = (s0, min(m, s0 + step))
        slices_down(du_entries, slot_counts_M, slot_tokens_M, w_up_NK, None, sums_out_SK=sums_SK, slots=slots)
        slices_down(dg_entries, slot_counts_M, slot_tokens_M, w_gate_NK, dx_MK, sums_in_SK=sums_SK, slots=slots)


def _light_weight_gradients(
    csc: tuple[torch.Tensor, ...],
    ell_h_MW: torch.Tensor,
    ell_du_MW: torch.Tensor,
    ell_dg_MW: torch.Tensor,
    x_MK: torch.Tensor,
    dy_MK: torch.Tensor,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    add_gate_up: bool = False,
) -> None:
    """Writes the light tokens' (dW_gate, dW_up, dW_down^T) into outs ([N, K] each) through the transposed view
    csc (`csc_index`); with `add_gate_up`, adds dW_gate and dW_up to theirs."""
    k = outs[0].shape[1]
    width = ell_h_MW.shape[1]
    scratch, counters = wgrad_scratch(k, x_MK.device)
    csc_weight_gradients(csc, (ell_dg_MW, ell_du_MW), x_MK, outs[:2], scratch, counters[0], width, add_gate_up)
    csc_weight_gradients(csc, (ell_h_MW,), dy_MK, outs[2:], scratch, counters[1], width)


def cuda_backward(
    x_MK,
    w_gate_NK,
    w_up_NK,
    w_down_KN,
    ell_cols_MW,
    ell_count_M,
    heavy_M,
    ell_g_MW,
    ell_u_MW,
    heavy_counts,
    w_compute_RK,
    dy_MK,
    dl1,
    dx_slices=False,
    grads_into=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    # grads_into: None, or float32 tensors shaped as the three weights (`step_scope.held_grads`) that the weight
    # gradients are added into; then None is returned for them.
    device = x_MK.device
    require_kernels(device)
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    weight_dtype = w_gate_NK.dtype  # bf16, or fp32 master weights: their gradients skip the bf16 round trip
    w_gate_NK, w_up_NK, w_down_t_NK = split_compute_weights(w_compute_RK, w_gate_NK, w_up_NK)
    with runtime.on_device(device):
        dy_MK = dy_MK.to(torch.bfloat16).contiguous()
        dl1_1 = dl1.detach().to(device=device, dtype=torch.float32).reshape(1).contiguous()
        dx_MK, ell_h_MW, ell_du_MW, ell_dg_MW, csc = _light_backward(
            dy_MK,
            w_gate_NK,
            w_up_NK,
            w_down_t_NK,
            ell_cols_MW,
            ell_count_M,
            heavy_M,
            ell_g_MW,
            ell_u_MW,
            dl1_1,
            dx_slices,
        )
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
            backup_backward(
                x_MK,
                w_gate_NK,
                w_up_NK,
                w_down_t_NK.t(),
                rows_R,
                dy_MK,
                dl1_1,
                dx_MK,
                dw_gate_NK,
                dw_up_NK,
                dw_down_NK,
            )
        if grads_into is not None:
            transposed_copy(dw_down_NK, torch.float32, out=grads_into[2], add=True)
            return dx_MK, None, None, None
        return (
            dx_MK,
            dw_gate_NK.to(weight_dtype),
            dw_up_NK.to(weight_dtype),
            transposed_copy(dw_down_NK, weight_dtype),
        )


def backup_pointwise(
    gate_dg_RN: torch.Tensor, up_du_RN: torch.Tensor, dhd_h_RN: torch.Tensor, dl1_1: torch.Tensor
) -> None:
    """The heavy tokens' pointwise backward step (`train_backup_grads`), in place on bf16 [R, N] tensors:
    x w_gate^T becomes dg, x w_up^T becomes du, dy w_down becomes h; dl1_1 is the fp32 [1] L1 gradient."""
    pieces = gate_dg_RN.numel() // 8  # N % 256 == 0
    args = (*map(runtime.ptr, (gate_dg_RN, up_du_RN, dhd_h_RN, dl1_1)), np.int64(pieces))
    kernel = runtime.get_function("train_backward.cu", "train_backup_grads", gate_dg_RN.device)
    runtime.launch(
        kernel, (math.ceil(pieces / BACKUP_GRADS_THREADS),), (BACKUP_GRADS_THREADS,), args, gate_dg_RN.device
    )


def backup_backward(
    x_MK,
    w_gate_NK,
    w_up_NK,
    w_down_KN,
    rows_R,
    dy_MK,
    dl1_1,
    dx_MK,
    dw_gate_NK,
    dw_up_NK,
    dw_down_NK,
) -> None:
    """Heavy tokens' gradients: writes their dx rows, adds to the fp32 weight gradients ([N, K] each).

    g and u are recomputed from the tokens' x rows (the forward keeps no [R, N] rows and never learns R). Between
    cuBLAS GEMMs one kernel (`train_backup_grads`) does the pointwise steps, and the weight gradients are
    accumulated by the GEMMs themselves in fp32: a dozen launches where torch ops took about 35, which the host
    issues for every layer with heavy tokens, on a backward that can be waiting on the host.

    torch reference: the backup branch of formats.hybrid_gated_mlp_backward_ref.
    """
    x_RK, dy_RK = x_MK.index_select(0, rows_R), dy_MK.index_select(0, rows_R)
    # Named for what they hold once backup_pointwise has rewritten them.
    dg_RN, du_RN, h_RN = torch.mm(x_RK, w_gate_NK.t()), torch.mm(x_RK, w_up_NK.t()), torch.mm(dy_RK, w_down_KN)
    backup_pointwise(dg_RN, du_RN, h_RN, dl1_1)
    dx_MK.index_copy_(0, rows_R, torch.addmm(torch.mm(du_RN, w_up_NK), dg_RN, w_gate_NK))
    for dw_NK, grad_RN, src_RK in ((dw_gate_NK, dg_RN, x_RK), (dw_up_NK, du_RN, x_RK), (dw_down_NK, h_RN, dy_RK)):
        torch.addmm(dw_NK, grad_RN.t(), src_RK, out_dtype=torch.float32, out=dw_NK)
