"""Training path of the gated feedforward block on the hybrid sparse format: an autograd-aware op.


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
the backward reads it (`ffn.backend.landed`) to size the heavy rows' GEMMs. For most layers of a model that copy landed
long before the layer's backward is issued, so the read waits for nothing. Where it has not (the last layer, whose
backward comes first; a backward issued right after its forward; a gradient-checkpointed layer's recompute), the
read waits for the copy alone, after the light tokens' backward kernels are queued, so they run while the host
waits. The host then has nothing queued ahead of them: in a step of several micro-batches its lead is lost once
per micro-batch, and the step follows the host wherever the host's forward is slower than the device's. Since the
forward reads nothing back, graphed training steps capture it as one CUDA graph per layer (`graphs`,
`step_scope.optimizer_step(graph_forwards=True)`): the host then issues a 2B forward in less time than the device runs
it (docs/performance.md, "2B training step").
The heavy tokens' forward reads the bf16 gate row and skips the bf16 rounding of u and h that the light
path applies (the inference kernel's arithmetic); the backward recomputes their g from an R-row GEMM.
Both differences are below one bf16 rounding. scripts/bench_train_mlp.py reports host wall-clock per step
beside the CUDA-event time.

Cost bound (why a target may be missed): past the gate GEMM, each light non-zero streams seven K-wide bf16
rows (forward: w_up, w_down; backward: w_down, w_up, w_gate; weight gradients: the token's x and dy rows),
28 KiB at K = 2048, on CUDA cores. Dense training does 9 * 2 * K * N flops per token on tensor cores, so
with the gate GEMM (1/9 of that) paid on both paths the break-even is (8 N / 7) * B / F non-zeros per
token for a row bandwidth of B bytes/s and a tensor-core rate of F flop/s (K cancels): about 49 at
N = 5632, B = 5.5 TB/s, F = 720 TFLOP/s. B is bounded by the rate at which warps stream random rows from L2, which
the kernels' walks come close to (docs/kernels.md, measured choices). Reuse of weight rows across tokens (real
activations are correlated, the synthetic ones are not) or tensor-core tiles are the ways past this bound.

Determinism: the weight gradients of columns longer than `csc_whole_column` entries are summed with fp32
atomics, so their summation order varies run to run. The forward's outputs are deterministic (ELL rows in
ascending columns, zero padding, as in sparse_llm/formats; each heavy token reduced in a fixed order), as
torch.compile and opcheck require: the heavy tokens leave the op as flags, not as the kernel's list (whose
order is that of arrival); the backward lists them with nonzero_static, sized by the landed count.

On CPU (and for opcheck / gradcheck in CI) the same op runs the torch reference built on
`sparse_llm.formats` (`hybrid_gated_mlp_forward_ref` / `hybrid_gated_mlp_backward_ref`), any float dtype.
"""

from __future__ import annotations

import torch

from sparse_llm.cuda import runtime
from sparse_llm.ffn.backend import FFNResult, Tail
from sparse_llm.ffn.step_scope import adding_into_grads, graphing_forwards, held_grads, reused_cast
from sparse_llm.ffn.twell.cost_model import DEFAULT_WIDTH, dense_row_capacity, dx_by_slices
from sparse_llm.ffn.twell.graphs import graphed_forward
from sparse_llm.ffn.twell.train_backward import cuda_backward
from sparse_llm.ffn.twell.train_launch import (
    COUNTS_OUTPUT,
    OpOutputs,
    accumulation_dtype,
    backup_gate_up,
    compute_weights,
    compute_weights_shape,
    forward_kernels,
    heavy_rows,
    new_counts_host,
    require_kernels,
)
from sparse_llm.ffn.twell.validation import check_train_inputs
from sparse_llm.formats import (
    HybridPacked,
    HybridSaved,
    hybrid_gated_mlp_backward_ref,
    hybrid_gated_mlp_forward_ref,
    hybrid_mul,
)


def _reference_forward(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    width: int,
    dx_slices: bool = False,
    dense_rows: int = 0,
    w_compute_RK: torch.Tensor | None = None,
) -> OpOutputs:
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
        fwd.y_MK,
        fwd.l1_sum,
        l0_M,
        fired_N,
        g.ell_cols_MW,
        g.ell_count_M,
        g.heavy_M,
        g.ell_values_MW,
        u.ell_values_MW,
        heavy_counts,
        w_compute_RK,
    )


def _reference_backward(
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
    # dx_slices picks the CUDA backward's dx walk; the reference has one. grads_into: as in cuda_backward.
    weight_dtype = w_gate_NK.dtype
    w_gate_NK, w_up_NK, w_down_KN = (w.to(x_MK.dtype) for w in (w_gate_NK, w_up_NK, w_down_KN))
    rows_R = heavy_rows(heavy_M, heavy_counts)
    backup_g_RN, backup_u_RN = backup_gate_up(x_MK, w_gate_NK, w_up_NK, rows_R)
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


def _cuda_forward(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    width: int,
    dx_slices: bool = False,
    dense_rows: int = 0,
    w_compute_RK: torch.Tensor | None = None,
) -> OpOutputs:
    # dx_slices (part of the op's schema) reaches the backward through the autograd context; w_compute_RK as in
    # _reference_forward
    device = x_MK.device
    require_kernels(device)  # the operands were checked once, by twell_train_ffn
    with runtime.on_device(device):
        if w_compute_RK is None:
            w_compute_RK = compute_weights(w_gate_NK, w_up_NK, w_down_KN, torch.bfloat16)
        return forward_kernels(
            x_MK, w_gate_NK, w_up_NK, width, w_compute_RK, counts_host=new_counts_host(), dense_rows=dense_rows
        )


@torch.library.custom_op("sparsellm::twell_train_forward", mutates_args=())
def twell_train_forward_op(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    width: int,
    dx_slices: bool = False,
    dense_rows: int = 0,
) -> OpOutputs:
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
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    ell_cols_MW: torch.Tensor,
    ell_count_M: torch.Tensor,
    heavy_M: torch.Tensor,
    ell_g_MW: torch.Tensor,
    ell_u_MW: torch.Tensor,
    heavy_counts: torch.Tensor,
    w_compute_RK: torch.Tensor,
    dy_MK: torch.Tensor,
    dl1: torch.Tensor,
    dx_slices: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx_MK, dw_gate_NK, dw_up_NK, dw_down_KN) given dy_MK and dl1 = dLoss/dl1_sum (a scalar tensor); the
    weight gradients in the weights' dtype."""
    return _reference_backward(
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
        dx_slices,
    )


twell_train_forward_op.register_kernel("cuda")(_cuda_forward)
twell_train_backward_op.register_kernel("cuda")(cuda_backward)


@twell_train_forward_op.register_fake
def _forward_fake(x_MK, w_gate_NK, w_up_NK, w_down_KN, width, dx_slices=False, dense_rows=0):
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    i32 = torch.int32
    return (
        x_MK.new_empty(m, k),
        x_MK.new_empty((), dtype=accumulation_dtype(x_MK.dtype)),
        x_MK.new_empty(m, dtype=i32),
        x_MK.new_empty(n, dtype=torch.bool),
        x_MK.new_empty(m, width, dtype=i32),
        x_MK.new_empty(m, dtype=i32),
        x_MK.new_empty(m, dtype=torch.bool),
        x_MK.new_empty(m, width),
        x_MK.new_empty(m, width),
        torch.empty(1, dtype=i32, device="cpu"),
        x_MK.new_empty(compute_weights_shape(w_gate_NK, x_MK.dtype)),
    )


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
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
            require_kernels(x_MK.device)
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

        def backward_impl(
            x_MK: torch.Tensor, *args: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
            """What the backward custom op runs for x_MK's device, called directly, adding into held gradients where
            the forward was called to and the weights' gradients allow it. args[:3] are the weights, saved as
            inputs: unpacked, they are the tensors the forward was given."""
            into = held_grads(args[:3]) if ctx.add_into_grads else None
            return (cuda_backward if x_MK.is_cuda else _reference_backward)(x_MK, *args, grads_into=into)

        return _gradients(ctx, dy_MK, dl1, backward_impl)


def twell_train_ffn(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    *,
    width: int = DEFAULT_WIDTH,
    l0_hint: tuple[float, float] | None = None,
    tail: Tail | None = None,
    dense_rows: int | None = None,
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
        tail: the layer's recent shares of heavy tokens (`ffn.backend.Tail`), or None.
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
    return FFNResult(
        y_MK=y_MK,
        l1_sum=l1_sum,
        l0_M=l0_M,
        fired_N=fired_N,
        path="twell-train",
        overflow_rows=outputs[COUNTS_OUTPUT][:1],
    )
