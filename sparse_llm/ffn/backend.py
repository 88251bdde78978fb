"""Execution backends for the gated feedforward block, behind one signature.

Every backend computes the same function (DESIGN.md "The math"):

    g = relu(x w_gate^T),  u = x w_up^T,  h = g * u,  y = h w_down^T

and reports the sparsity quantities the trainer needs, so that a layer's statistics stay exact whichever
path ran. A backend is chosen per layer by `sparse_llm.ffn.dispatch`; `estimated_ms` is its cost model.

Shapes: M tokens, K hidden, N FFN width. Weights are in nn.Linear layout: w_gate_NK, w_up_NK [N, K],
w_down_KN [K, N].
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# Tokens with more non-zeros than this are "heavy": the sparse inference kernels compute them by dense GEMMs, over as
# many rows as the layer's observed share of such tokens calls for (sparse_llm/ffn/twell/backend.py, DENSE_ROW_NNZ).
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
        path: which code path produced y (for logs), e.g. "torch", "twell", "twell+dense-rows".
        normed_MK: the RMSNorm of y_MK that the call's `output_norm` asked for, where the backend wrote it as it
            stored y_MK (bf16, F.rms_norm's arithmetic); None elsewhere (the caller applies the norm itself).
        overflow_rows: tokens that could not take the sparse path and were computed densely (the TwELL routes'
            overflows and heavy rows, the training op's backup rows): an int, or, where the call does not wait for
            the GPU to learn it, a pinned CPU int32 [1] that an asynchronous copy fills (-1 until it lands).
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
        self, m: int, k: int, n: int, l0_mean: float, l0_max: float, training: bool, compiled: bool = False,
        tail: Tail | None = None,
    ) -> float | None:  # fmt: skip
        """Predicted time of one call in ms on the current GPU, or None if this case cannot run here. `compiled`:
        the call runs with a `compile_backend` (torch ops fused by torch.compile); `tail`: the layer's heavy tokens'
        shares, where known."""


def _sparsity_of(h_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token non-zero counts [M] (int32) and per-neuron fired mask [N] of a dense activation."""
    nonzero_MN = h_MN.detach() != 0
    return nonzero_MN.sum(dim=1, dtype=torch.int32), nonzero_MN.any(dim=0)  # one compare, two reads of the mask


def dense_block(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, w_up_NK: torch.Tensor, w_down_KN: torch.Tensor, statistics: bool,
    residual_MK: torch.Tensor | None = None, residual_writable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(y_MK, l1_sum, l0_M, fired_N) of the gated block in torch ops (y_MK plus residual_MK when given, written into
    residual_MK's memory when `residual_writable`); the last three None without statistics."""
    g_MN = F.relu(F.linear(x_MK, w_gate_NK))
    h_MN = g_MN * F.linear(x_MK, w_up_NK)
    if residual_MK is None:
        y_MK = F.linear(h_MN, w_down_KN)
    elif residual_writable:
        y_MK = add_linear_(residual_MK, h_MN, w_down_KN)
    else:
        y_MK = residual_MK + F.linear(h_MN, w_down_KN)
    if not statistics:
        return y_MK, None, None, None
    # Accumulated in fp32 (bf16 sums over 10^5+ terms lose most of their digits) without an fp32 copy
    # of h: at M=16384, N=5632 a copy costs more than a GEMM.
    l1_sum = torch.linalg.vector_norm(h_MN, ord=1, dtype=torch.float32)
    l0_M, fired_N = _sparsity_of(h_MN)
    return y_MK, l1_sum, l0_M, fired_N


@functools.cache
def _compiled_dense_block(backend: str) -> Callable[..., tuple]:
    """dense_block through torch.compile: the ReLU, the product and the statistics fuse into the GEMMs' neighbours
    (one pass over h instead of five, forward and backward)."""
    return torch.compile(dense_block, backend=backend)


STATS_MS_PER_ELEMENT = 0.85 / (16384 * 5632)
# A few tokens cannot keep the tensor cores busy: the dense block then streams its three weights from HBM. In CUDA
# graphs (no host time) it took 35-39 us at K x N = 2048 x 5632 (69 MB) and 107-114 us at 4096 x 11008 (270 MB) for
# 1-16 tokens (H100, 2026-11-26, docs/benchmarks.md): priced as a fixed cost plus the weights at a rate that puts both
# shapes at or under their fastest calls (34.7 and 106.6 us), so that a sparse path must beat the dense block's best.
DENSE_WEIGHT_FIXED_MS = 0.010
DENSE_WEIGHT_GBPS = 2800.0


def add_linear_(
    acc_MK: torch.Tensor, a_MJ: torch.Tensor, w_KJ: torch.Tensor, bias_K: torch.Tensor | None = None
) -> torch.Tensor:
    """acc_MK += F.linear(a_MJ, w_KJ, bias_K), in acc_MK's memory; returns acc_MK.

    On a GPU, without a bias and where the three dtypes agree, this is one GEMM that reads acc_MK in its epilogue
    (cuBLAS's beta = 1): at 16384 x 2048 x 2048 in bf16 on an H100, 187 us against 246 us for the GEMM and then an
    add, which is a pass of its own over [M, K] (docs/benchmarks.md, 2026-11-27). Otherwise (a bias, a bf16 product into
    an fp32 stream under autocast, or the CPU) the GEMM and then an in-place add. On the CPU the fused form buys
    nothing, and MKL's sgemm with beta = 1 rounds apart from the product plus the add on some CPUs (AVX-512: a third
    of the values at 32 x 256 x 64), so the CPU keeps the stock model's bits."""
    if acc_MK.is_cuda and bias_K is None and acc_MK.dtype == a_MJ.dtype == w_KJ.dtype:
        return acc_MK.addmm_(a_MJ, w_KJ.t())
    return acc_MK.add_(F.linear(a_MJ, w_KJ, bias_K))


def with_residual(result: FFNResult, residual_MK: torch.Tensor | None) -> FFNResult:
    """result with residual_MK added to its y_MK (for backends that cannot add it as they write y)."""
    if residual_MK is not None:
        result.y_MK = residual_MK + result.y_MK
    return result


class TorchFFN(FFNBackend):
    """The reference path: three dense GEMMs through torch (cuBLAS on GPU). Runs everywhere."""

    name = "torch"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def forward(
        self, x_MK, w_gate_NK, w_up_NK, w_down_KN, *, training, statistics=True, compile_backend=None, residual_MK=None,
        residual_writable=False, l0=None, tail=None, output_norm=None,
    ):  # fmt: skip
        block = dense_block if compile_backend is None else _compiled_dense_block(compile_backend)
        # a compiled block writes nothing in place: inductor would copy the result back into the input
        writable = residual_writable and compile_backend is None
        # four passes over h saved without statistics: about 0.6 ms per layer at 16384 x 5632
        y_MK, l1_sum, l0_M, fired_N = block(
            x_MK, w_gate_NK, w_up_NK, w_down_KN, training or statistics, residual_MK, writable
        )
        return FFNResult(y_MK=y_MK, l1_sum=l1_sum, l0_M=l0_M, fired_N=fired_N, path=self.name)

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        # Dense cost does not depend on sparsity. Three GEMMs forward (2mkn flops each), six more backward,
        # at 600 TFLOP/s, a sustained bf16 rate of an H100 on GEMMs of these sizes; plus, in eager training, the
        # statistics pass over h (L1, L0, fired), memory-bound elementwise work measured at 0.85 ms for
        # M=16384, N=5632 on an H100 (docs/benchmarks.md, "re-check after the torch-path statistics change").
        # Compiled, that work fuses into one pass: the block trained in 5.47-5.61 ms there against 5.67 ms of
        # GEMMs at this rate (docs/benchmarks.md, 2026-11-25 06:47), so the GEMMs alone price it. Inference calls skip
        # the statistics unless recorded, so a sparse backend is weighed against the bare GEMMs there: the
        # stricter comparison. Few tokens' inference streams the weights instead (DENSE_WEIGHT_GBPS).
        flops = 2.0 * m * k * n * (9 if training else 3)
        statistics_ms = m * n * STATS_MS_PER_ELEMENT if training and not compiled else 0.0
        weights_ms = 0.0 if training else DENSE_WEIGHT_FIXED_MS + 3 * k * n * 2 / (DENSE_WEIGHT_GBPS * 1e6)
        return max(flops / 600e12 * 1e3, weights_ms) + statistics_ms


_BACKENDS: dict[str, FFNBackend] = {}


def register_backend(backend: FFNBackend) -> None:
    """Make `backend` selectable by its name (`kernel=<name>`)."""
    if not backend.name:
        raise ValueError(f"{type(backend).__name__} has no `name`; set a class attribute `name = '...'`.")
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> FFNBackend:
    """The registered backend called `name`; the error lists the valid names."""
    _load_optional_backends()
    if name not in _BACKENDS:
        raise ValueError(f"Unknown FFN backend {name!r}; choose one of {sorted(_BACKENDS)} or 'auto'.")
    return _BACKENDS[name]


def backend_names() -> list[str]:
    _load_optional_backends()
    return sorted(_BACKENDS)


def _load_optional_backends() -> None:
    """Import the CUDA backend module, which registers itself (it imports without a GPU or CuPy)."""
    if "twell" not in _BACKENDS:
        from sparse_llm.ffn.twell import backend  # noqa: F401  (registers "twell" on import)


register_backend(TorchFFN())
