"""Execution backends for the gated feedforward block, behind one signature.

Every backend computes the same function (docs/design.md "The math"):

    g = relu(x w_gate^T),  u = x w_up^T,  h = g * u,  y = h w_down^T

and reports the sparsity quantities the trainer needs, so that a layer's statistics stay exact whichever
path ran. A backend is chosen per layer by `sparse_llm.ffn.dispatch`; `estimated_ms` is its cost model.

Shapes: M tokens, K hidden, N FFN width. Weights are in nn.Linear layout: w_gate_NK, w_up_NK [N, K],
w_down_KN [K, N].

This module is the interface only (no project imports); `torch_backend` and `twell.backend` implement it and
`registry` names them.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import torch

# Tokens with more non-zeros than this are "heavy": the sparse inference kernels compute them by dense GEMMs, over as
# many rows as the layer's observed share of such tokens calls for (sparse_llm/ffn/twell/cost_model.py, DENSE_ROW_NNZ).
HEAVY_TOKEN_NNZ = 128


@dataclass(frozen=True)
class Tail:
    """A layer's heavy tokens: the share of its tokens with more than HEAVY_TOKEN_NNZ non-zeros, and the share of its
    non-zeros they hold (both 0..1)."""

    tokens: float
    nonzeros: float


@dataclass
class FFNResult:
    """What one gated-FFN call returns.

    Attributes:
        y_MK: block output [M, K].
        l1_sum: scalar, sum over tokens of sum_n |h[m, n]| (differentiable when training).
        l0_M: [M] int32, non-zeros of h per token (detached).
        fired_N: [N] bool, neurons with h != 0 for at least one token (detached).
            These three are None where an inference call was not asked for statistics and its backend would
            have had to spend passes over h on them (the dense path); training calls always carry them.
        path: which code path produced y (for logs), e.g. "torch", "twell-direct", "twell-decode".
        normed_MK: the RMSNorm of y_MK that the call's `output_norm` asked for, where the backend wrote it as it
            stored y_MK (bf16, F.rms_norm's arithmetic); None elsewhere (the caller applies the norm itself).
        overflow_rows: tokens that could not take the sparse path and were computed densely (the training op's
            backup rows): an int, or, where the call does not wait for the GPU to learn it, a pinned CPU int32 [1]
            that an asynchronous copy fills (-1 until it lands).
            `dense_rows()` reads either. The direct inference route's dense rows are not counted: their number
            never leaves the device.
    """

    y_MK: torch.Tensor
    l1_sum: torch.Tensor | None
    l0_M: torch.Tensor | None
    fired_N: torch.Tensor | None
    path: str
    overflow_rows: int | torch.Tensor = 0
    normed_MK: torch.Tensor | None = None

    def dense_rows(self) -> int:
        """overflow_rows as an int (waits for the device only if its count has not landed yet)."""
        if isinstance(self.overflow_rows, torch.Tensor):
            return landed(self.overflow_rows)[0]
        return self.overflow_rows


class HostWaits:
    """Host seconds that `landed` has spent waiting for counts still on their way, over the process: a diagnostic
    (scripts/profile_train_step.py reads it around each phase of a training step)."""

    seconds = 0.0


def landed(values_host: torch.Tensor) -> list[int]:
    """The values of a pinned CPU tensor that an asynchronous device-to-host copy fills, once they are there.

    The writer sets every entry to -1 before queueing the copy and copies only non-negative counts, so -1
    means "not yet". Read well after the copy (a layer's backward reading its forward's count) this returns
    at once. Otherwise it waits for the copy itself by reading the pinned memory until the values arrive, not
    for the device: the kernels queued after the copy (a backward's first launches) keep the GPU busy while
    the host waits, where a device synchronisation would drain them and leave the GPU idle until the host
    issued more. Once the current stream has run everything queued on it the copy was elsewhere (another
    stream), so the device is synchronised. The time waited adds to `HostWaits.seconds`.
    """
    values = values_host.tolist()
    if not values or min(values) >= 0:
        return values
    start = time.perf_counter()
    while min(values) < 0:
        drained = _current_stream_drained()
        values = values_host.tolist()
        if drained and min(values) < 0:
            torch.cuda.synchronize()
            values = values_host.tolist()
            if min(values) < 0:
                raise RuntimeError("A device-to-host count never arrived: the copy that fills it was not queued.")
    HostWaits.seconds += time.perf_counter() - start
    return values


def _current_stream_drained() -> bool:
    """Whether the current CUDA stream has run all the work queued on it."""
    return torch.cuda.current_stream().query()


class FFNBackend(abc.ABC):
    """One way of running the gated FFN. Subclasses are registered with `register_backend`."""

    name: str = ""

    @abc.abstractmethod
    def unavailable_reason(self, device: torch.device) -> str | None:
        """None if this backend can run on `device`, else a sentence saying why not."""

    @abc.abstractmethod
    def forward(
        self,
        x_MK: torch.Tensor,
        w_gate_NK: torch.Tensor,
        w_up_NK: torch.Tensor,
        w_down_KN: torch.Tensor,
        *,
        training: bool,
        statistics: bool = True,
        compile_backend: str | None = None,
        residual_MK: torch.Tensor | None = None,
        residual_writable: bool = False,
        l0: tuple[float, float] | None = None,
        tail: Tail | None = None,
        output_norm: tuple[torch.Tensor, float] | None = None,
    ) -> FFNResult:
        """Run the block; `training` says whether gradients must flow. `statistics=False` lets an inference
        call skip L1/L0/fired where they cost extra work (a backend may still return them). `compile_backend`
        names a torch.compile backend for a block built from torch ops (None: eager); backends running their
        own kernels ignore it. With `residual_MK` ([M, K], a decoder layer's residual stream) the result's y_MK
        is residual_MK + the block's output, which a backend may add as it writes y; `residual_writable` says the
        caller no longer needs residual_MK, so y_MK may be written into its memory. `l0`: the layer's recent
        (mean, max) non-zeros per token, and `tail` its heavy tokens' shares, when known, which a backend may tune
        its launch by. `output_norm` = (weight_K, eps): an RMSNorm of y_MK (the next decoder layer's input norm) that
        a backend may write as it stores y_MK, into the result's normed_MK; one that does not leaves normed_MK None."""

    def accepts(self, x_MK: torch.Tensor, w_gate_NK: torch.Tensor, training: bool) -> bool:
        """Whether `auto` may send these tensors here as they are (e.g. their dtypes)."""
        return True

    @abc.abstractmethod
    def estimated_ms(
        self,
        m: int,
        k: int,
        n: int,
        l0_mean: float,
        l0_max: float,
        training: bool,
        compiled: bool = False,
        tail: Tail | None = None,
    ) -> float | None:
        """Predicted time of one call in ms on the current GPU, or None if this case cannot run here. `compiled`:
        the call runs with a `compile_backend` (torch ops fused by torch.compile); `tail`: the layer's heavy tokens'
        shares, where known."""
