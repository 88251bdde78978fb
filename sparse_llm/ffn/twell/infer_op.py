"""The "twell" inference op: the gated feedforward block through sparse CUDA kernels (`twell_gated_mlp`).

Per block (kernels/ holds the CUDA sources), by one of two routes:

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
  "twell-slices". That walk, and the one-pass walk from WORDS_GATE_MIN_M tokens, take the gate as TwELL words from
  a wgmma GEMM whose epilogue packs them (kernels/twell_gate_wgmma.cu, `twell_gate`) rather than from cuBLAS as a
  dense row (`_direct_gate`): the heavy tokens' gate rows are rebuilt on the device for the dense paths. Where the
  price puts slices ahead, one timed trial per shape and density settles the walk (`measured_walk`): the call that
  runs it waits for the GPU once.
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

Statistics (same meaning as the torch backend): l0_M = non-zeros of h = g * u per token (the kernel
counts h != 0 in fp32; it differs from the gate's count only where u is exactly 0), fired_N = neurons
with h != 0 for some token, l1_sum = sum |h| in fp32.

Launchers live in `infer_launch` and `decode`, prices and walk choices in `cost_model`; docs/kernels.md
describes the routes and lists the tuned constants with the measurements behind them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparse_llm.cuda import tensor_map
from sparse_llm.cuda.kernel_constants import DECODE_MAX_M
from sparse_llm.ffn.backend import FFNResult, Tail
from sparse_llm.ffn.trials import best_times_ms, env_choice, log_bucket
from sparse_llm.ffn.twell.cost_model import DENSE_ROW_NNZ, column_parts, dense_row_capacity, direct_walk
from sparse_llm.ffn.twell.decode import decode_ffn
from sparse_llm.ffn.twell.infer_launch import (
    DOWN_TRANSPOSES,
    WALKS,
    OutputNorm,
    check_output_norm,
    launch_direct_up_down,
    twell_gate,
)
from sparse_llm.ffn.twell.validation import check_inputs, check_residual

MLP_ROUTES = ("auto", "direct")  # twell_gated_mlp: "auto" takes decode_ffn for up to DECODE_MAX_M tokens, else "direct"

# The direct route's "rows" walk lists from the fused GEMM's TwELL words (`_direct_gate`) from this many tokens (same
# bits as from cuBLAS's gate): the fused GEMM runs a little behind cuBLAS's, which the walk's smaller read repays only
# for many tokens (docs/kernels.md, tuned constants).
WORDS_GATE_MIN_M = 16384

# Where the price puts slices ahead, the price alone cannot tell: it sees only the mean and max non-zeros per token,
# not how unevenly the neurons fire. Rows profit from hot neurons (their rows stay in L2 and L1) and slices do not, so
# a model's layers can rank the walks the other way from the synthetic block (docs/kernels.md, tuned constants).
# So by default ("measured") the first such call at a shape and density times both walks on its own tokens, and calls
# at that shape and density keep the faster (`measured_walk`); SPARSE_LLM_TWELL_WALK=priced trusts the price
# (deterministic: the two walks round h differently).
WALK_CHOICE_ENV = "SPARSE_LLM_TWELL_WALK"

WALK_TRIAL_REPS = 2  # timed calls per walk in a trial, after one untimed call each

WALK_TRIAL_BUCKETS = 2  # densities within a factor 2 ** (1 / this) of mean non-zeros share a trial

_measured_walks: dict[tuple[int, int, int, int], str] = {}


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
        gate_route: "auto" (= "direct", or for up to DECODE_MAX_M tokens `decode_ffn`) or "direct".
        dense_row_nnz: tokens with more gate non-zeros than this are computed by dense GEMMs (as many as
            `dense_row_capacity` reserves, the others split over a block of warps).
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
            "rows" walk writes it as it stores them, into the result's normed_MK (`OutputNorm`). The other walks
            leave normed_MK None, as does a weight other than a contiguous bf16 [K] on x_MK's device.

    Returns:
        FFNResult: path "twell-direct" ("twell-slices" where it took the slices walk, "twell-decode" for the decode
        kernel), overflow_rows 0 (no token is recomputed).
    """
    check_inputs(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    if gate_route not in MLP_ROUTES:
        raise ValueError(f"gate_route={gate_route!r} is not valid; use one of {MLP_ROUTES}")
    fusable = residual_MK is not None and check_residual(residual_MK, x_MK)
    fused = residual_MK if fusable else None
    if gate_route == "auto" and 0 < x_MK.shape[0] <= DECODE_MAX_M:
        y_MK, l1_M, l0_M, fired_N = decode_ffn(
            x_MK,
            w_gate_NK,
            w_up_NK,
            DOWN_TRANSPOSES.get(w_down_KN),
            fused,
            None if l0_hint is None else l0_hint[1],
            statistics,
        )
        return _finished(y_MK, l1_M, l0_M, fired_N, residual_MK if fused is None else None, statistics, "twell-decode")
    (m, k), n = x_MK.shape, w_gate_NK.shape[0]
    walk = direct_walk(m, k, n, l0_hint, tail)
    trial = (m, k, n, _mean_bucket(l0_hint[0])) if walk == "slices" and walk_choice() == "measured" else None
    if trial in _measured_walks:
        walk, trial = _measured_walks[trial], None
    # Once the walk is known, its gate GEMM goes out before the host's other work for the call: an isolated call's
    # GPU idles until its first kernel.
    gate = None if trial is not None else _direct_gate(x_MK, w_gate_NK, walk)
    # the gate and the cached transpose are well formed by construction: no second validation
    w_down_t_NK = DOWN_TRANSPOSES.get(w_down_KN)
    dense_rows = dense_row_capacity(m, l0_hint, dense_row_nnz, tail)
    # the norm of the rows as the kernels store them: not where the caller adds the residual afterwards
    norm = _output_norm(output_norm, x_MK) if fused is not None or residual_MK is None else None

    def walk_through(
        walk: str, gate: tuple[torch.Tensor, torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block through `walk`, from `gate` (`_direct_gate`'s for that walk) where it was issued already."""
        columns = None if walk == "slices" else column_parts(k, n, l0_mean=None if l0_hint is None else l0_hint[0])
        gate_MN, packed_MS = _direct_gate(x_MK, w_gate_NK, walk) if gate is None else gate
        return launch_direct_up_down(
            x_MK,
            gate_MN,
            w_up_NK,
            w_down_t_NK,
            dense_row_nnz,
            fused,
            columns,
            walk=walk,
            dense_rows=dense_rows,
            norm=norm if walk == "rows" else None,
            packed_MS=packed_MS,
        )

    if trial is not None:
        walk = measured_walk(trial, walk_through)
    path = "twell-slices" if walk == "slices" else "twell-direct"
    result = _finished(*walk_through(walk, gate), residual_MK if fused is None else None, statistics, path)
    if norm is not None and walk == "rows":
        result.normed_MK = norm.out_MK
    return result


def _direct_gate(x_MK: torch.Tensor, w_gate_NK: torch.Tensor, walk: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The direct route's gate for its walk: (gate_MN, packed_MS). The walks list from the fused GEMM's TwELL words
    (the "slices" walk always, the "rows" walk from WORDS_GATE_MIN_M tokens), which spare them the dense row's read and
    the GEMM its write (same bits; docs/kernels.md, measured choices); gate_MN is then only a buffer for the heavy
    tokens' rows, written on the device. Otherwise, and for operands the copy engine cannot read (not
    `tensor_map.mappable`, e.g. not 16-byte aligned), the walk reads cuBLAS's bf16 pre-activation [M, N] (packed_MS
    None)."""
    words = walk == "slices" or x_MK.shape[0] >= WORDS_GATE_MIN_M
    if words and tensor_map.mappable(x_MK) and tensor_map.mappable(w_gate_NK):
        gate_MN = torch.empty(x_MK.shape[0], w_gate_NK.shape[0], dtype=torch.bfloat16, device=x_MK.device)
        return gate_MN, twell_gate(x_MK, w_gate_NK, overflow_gate_MN=gate_MN)
    return F.linear(x_MK, w_gate_NK), None


def _output_norm(output_norm: tuple[torch.Tensor, float] | None, x_MK: torch.Tensor) -> OutputNorm | None:
    """The OutputNorm the kernels can write for twell_gated_mlp's `output_norm`, or None (the caller norms)."""
    if output_norm is None:
        return None
    weight_K, eps = output_norm
    norm = OutputNorm(weight_K, float(eps), torch.empty_like(x_MK))
    try:
        check_output_norm(norm, x_MK, "rows")
    except (TypeError, ValueError):  # a weight the kernels cannot read (dtype, shape, layout, device)
        return None
    return norm


def _finished(
    y_MK: torch.Tensor,
    l1_M: torch.Tensor,
    l0_M: torch.Tensor,
    fired_N: torch.Tensor,
    unfused_residual_MK: torch.Tensor | None,
    statistics: bool,
    path: str,
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
