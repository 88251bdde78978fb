"""Per-layer choice of FFN backend, so that a layer never runs slower than the dense path.

`kernel=torch` or `kernel=twell` force one backend for every layer (a forced backend that cannot run
here is an error, never a silent fallback). `kernel=auto` asks each available backend's cost model
for the layer's last measured sparsity and takes the cheapest, with hysteresis so a layer near the
break-even point does not flip back and forth. Where the sparse and dense prices of an inference call on a GPU lie
within TRIAL_BAND of each other, the layer times both paths once on that call's inputs (per token count and
density bucket) and keeps the faster: a price knows the layer's density, not how its neurons share the GPU's caches.
A call issued from Python whose prices are both under HOST_BOUND_MS (a decoding step's few tokens) is timed the same
way, whatever its prices: it runs at the host's pace, which the prices (device times) do not see. In a CUDA graph
(`SparseMLP.in_cuda_graph`) the host issues nothing, and the prices stand.
In training the same prices decide, with no trial (a training call's backward cannot be timed apart from the step):
the sparse training op's price never drops below the host's exposed time to issue it (the cost model's floor), so a
layer stays dense while it is dense-ish (early in training) or its micro-batch is small, and switches once its
observed sparsity makes the sparse op the cheaper by SWITCH_MARGIN (and back once the dense path is, by the same).

Rank consistency: in distributed training the decision must be the same on every rank (or ranks
would run different kernels and disagree on statistics). The trainer therefore feeds `observe` with
statistics already reduced over ranks; each rank then takes the same decision from the same numbers.
Outside the trainer (evaluation, generation) a layer observes its own statistics.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch

from sparse_llm.ffn.backend import HEAVY_TOKEN_NNZ, FFNBackend, Tail
from sparse_llm.ffn.kernel_choice import validate_kernel
from sparse_llm.ffn.registry import backend_names, get_backend
from sparse_llm.ffn.trials import best_times_ms, can_time, env_choice, log_bucket, loop_times_ms

log = logging.getLogger(__name__)

# A sparse path must beat the dense one by this factor before a layer switches to it, and the dense path the sparse
# one before it switches back: prices within 5% of each other leave a layer on the path it runs.
SWITCH_MARGIN = 0.95

# Sparse and dense prices within this factor of each other (either way) are settled by a trial of both paths on the
# call's own inputs: a trained model's hot neurons keep their weight rows in L2, so its walks run faster than the
# price (fitted on evenly spread non-zeros) says at the same density. Further apart, the price stands.
TRIAL_BAND = 1.5

# In a trial the sparse path must beat the dense one by this factor: a smaller lead is within a trial's noise.
TRIAL_MARGIN = 0.97

TRIAL_REPS = 3  # timed calls per path in a trial, after one untimed call each

# A host-bound trial times each path's calls issued back to back by the host's clock, with a wait for the GPU around
# each run of them (`loop_times_ms`): what a decoding loop pays per call, the host's time or the device's, whichever is
# longer. CUDA events around single calls misread it: the dense block's events start late where the call before left
# the GPU busy, which can rank the two paths the wrong way round (docs/kernels.md, tuned constants). A call costs
# ~0.1 ms: the trial runs a few dozen, once per bucket.
HOST_BOUND_TRIAL_ROUNDS = 5

HOST_BOUND_TRIAL_CALLS = 4  # calls per run

# An inference call issued from Python whose sparse and dense prices are both under this runs at the host's pace on
# either path: a block of a few tokens takes the host several times its device time. Which path's call costs the host
# less depends on the host and on how many ops the call issues, which a price (device time) does not see
# (docs/kernels.md, tuned constants).
HOST_BOUND_MS = 0.06

# Choices a layer remembers between observations (per token count and call kind), before it forgets them all: lm-eval's
# calls bring a new token count each, a decoding loop the same few again and again.
CHOICES_KEPT = 256

TRIAL_BUCKETS = 4  # density buckets per doubling of the mean non-zeros per token: a trial holds within one

TOKEN_BUCKETS = 2  # token-count buckets per doubling of the tokens in a call, likewise

# SPARSE_LLM_AUTO=priced: no trials, the prices decide (bit-reproducible choices); "measured" (default) runs them.
AUTO_CHOICE_ENV = "SPARSE_LLM_AUTO"

AUTO_CHOICE_MEANING = (
    "measured: where a layer's prices are close, time both paths once on its tokens; priced: the cost model's choice, "
    "bit-reproducible"
)

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def density_of(l0_M: torch.Tensor) -> tuple[float, float, Tail]:
    """(mean, max, tail) of per-token non-zero counts l0_M [M], M >= 1, read back with one host sync: what
    `LayerDispatcher.observe` takes."""
    l0_M = l0_M.detach().float()
    heavy_M = l0_M > HEAVY_TOKEN_NNZ
    values = torch.stack([l0_M.mean(), l0_M.max(), heavy_M.float().mean(), (l0_M * heavy_M).sum(), l0_M.sum()])
    mean, top, heavy_tokens, heavy_nonzeros, nonzeros = values.tolist()
    return mean, top, Tail(heavy_tokens, heavy_nonzeros / nonzeros if nonzeros else 0.0)


@functools.cache
def _has_autocast(device_type: str) -> bool:
    """Whether torch has an autocast for `device_type` (not for meta, say); asked once per type: a layer's every call
    asks `_autocast_dtype`."""
    return torch.amp.is_autocast_available(device_type)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on `device_type` now, None where it is off (or has no autocast: meta)."""
    if not _has_autocast(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


class LayerDispatcher:
    """Chooses and remembers the backend of one FFN layer."""

    def __init__(self, kernel: str = "auto") -> None:
        validate_kernel(kernel)
        self.kernel = kernel
        self.l0_mean: float | None = None  # last observed mean non-zeros per token
        self.l0_max: float | None = None
        self.tail: Tail | None = None  # its heavy tokens, where known
        self.current = "torch"
        # (host-bound, tokens bucket, density bucket) -> the backend a trial found faster
        self.trials: dict[tuple[bool, int, int], str] = {}
        # A call's kind -> the backend `auto` chose for it since the last observation. The kind is all that the prices,
        # `accepts` and the trials read besides the observation: tokens, device, dtypes, autocast, training, compiled,
        # graphed, trial offered and the current backend (SPARSE_LLM_AUTO is read when a choice is made, and holds for
        # it until the next observation or `forget_trials`). A call of a kind seen before skips the cost models and the
        # trial lookup. A decoding step's few tokens issued from Python pay that host time in full, per layer and token
        # (docs/kernels.md, CHOICES_KEPT). The backend object itself is kept: its lookup by name costs host time too.
        self._chosen: dict[tuple, FFNBackend] = {}

    @property
    def l0(self) -> tuple[float, float] | None:
        """(mean, max) of the last observation, None before the first."""
        return None if self.l0_mean is None else (self.l0_mean, self.l0_max or self.l0_mean)

    def observe(self, l0_mean: float, l0_max: float, tail: Tail | None = None) -> None:
        """Record the layer's latest sparsity: mean and max non-zeros of h per token and, where known, its heavy
        tokens' shares."""
        self.l0_mean, self.l0_max = float(l0_mean), float(l0_max)
        self.tail = tail
        self._chosen.clear()  # chosen from the previous observation's prices

    def forget_trials(self) -> None:
        """Drop the trials' results (and the choices made from them): the next close call runs its trial again."""
        self.trials.clear()
        self._chosen.clear()

    def choose(
        self,
        x_MK: torch.Tensor,
        w_gate_NK: torch.Tensor,
        training: bool,
        compiled: bool = False,
        trial: Callable[[FFNBackend], object] | None = None,
        graphed: bool = False,
    ) -> FFNBackend:
        """The backend for this call: x_MK [M, K] tokens, w_gate_NK [N, K] the layer's gate weight; `compiled`:
        the layer runs its torch ops through torch.compile (the dense path is cheaper then). `trial(backend)` runs
        this inference call's block on `backend` (for a trial where the prices are close, see TRIAL_BAND, or where
        the call is host-bound, see HOST_BOUND_MS). `graphed`: the call runs in a CUDA graph (captured, or the eager
        run before a capture), where no host time is paid per call."""
        if self.kernel != "auto":
            backend = get_backend(self.kernel)
            reason = backend.unavailable_reason(x_MK.device)
            if reason is not None:
                raise RuntimeError(
                    f"kernel={self.kernel} cannot run here: {reason.rstrip('.')}. Use kernel=auto (picks the "
                    "fastest exact path available) or kernel=torch."
                )
            self.current = backend.name
            return backend
        device = x_MK.device
        kind = (
            x_MK.shape[0],
            device,
            x_MK.dtype,
            w_gate_NK.dtype,
            _autocast_dtype(device.type),
            training,
            compiled,
            graphed,
            trial is not None,
            self.current,
        )
        backend = self._chosen.get(kind)
        if backend is None:
            choice, settled = self._cheapest(x_MK, w_gate_NK, training, compiled, trial, graphed)
            backend = get_backend(choice)
            if settled:
                if len(self._chosen) >= CHOICES_KEPT:
                    self._chosen.clear()
                self._chosen[kind] = backend
        self.current = backend.name
        return backend

    def _cheapest(
        self,
        x_MK: torch.Tensor,
        w_gate_NK: torch.Tensor,
        training: bool,
        compiled: bool,
        trial: Callable[[FFNBackend], object] | None,
        graphed: bool,
    ) -> tuple[str, bool]:
        """The backend for this call, and whether calls of its kind may keep it until the next observation (not where a
        trial was due but could not run now)."""
        if self.l0_mean is None:
            return "torch", True  # no measurement yet
        (m, k), n = x_MK.shape, w_gate_NK.shape[0]
        estimates = {}
        for name in backend_names():
            backend = get_backend(name)
            reason = backend.unavailable_reason(x_MK.device)
            if reason is not None:
                if name != "torch" and x_MK.device.type == "cuda":  # on a CPU the dense path is expected
                    _warn_once(f"FFN backend {name!r} unavailable, layers use the torch path: {reason}")
                continue
            if not backend.accepts(x_MK, w_gate_NK, training):
                continue
            ms = backend.estimated_ms(m, k, n, *self.l0, training, compiled, tail=self.tail)
            if ms is not None and math.isfinite(ms):
                estimates[name] = ms
        dense_ms = estimates.get("torch", math.inf)
        best = min(estimates, key=estimates.get, default="torch")
        sparse = min((name for name in estimates if name != "torch"), key=estimates.get, default=None)
        ratio = math.inf if sparse is None else estimates[sparse] / dense_ms  # 0 without a dense price
        host_bound = sparse is not None and not graphed and max(dense_ms, estimates[sparse]) < HOST_BOUND_MS
        trials = trial is not None and not training and (1 / TRIAL_BAND <= ratio <= TRIAL_BAND or host_bound)
        settled = True
        if trials and env_choice(AUTO_CHOICE_ENV, AUTO_CHOICE_MEANING) == "measured":  # (read only where it decides)
            measured = self._tried(x_MK, sparse, trial, host_bound)
            if measured is not None:
                return measured, True
            settled = False
        if best != "torch" and estimates[best] > SWITCH_MARGIN * dense_ms and self.current == "torch":
            return "torch", settled
        held = estimates.get(self.current) if self.current != "torch" else None
        if best == "torch" and held is not None and dense_ms > SWITCH_MARGIN * held:
            return self.current, settled  # leaving a sparse path takes the same margin as taking it
        return best, settled

    def _tried(
        self, x_MK: torch.Tensor, sparse: str, trial: Callable[[FFNBackend], object], host_bound: bool
    ) -> str | None:
        """ "torch" or `sparse`, whichever a trial on this call found faster at its token count's and density's buckets
        (one trial per pair, remembered: lm-eval's and generation's token counts vary from call to call); None where
        no trial can run now (`can_time`). A host-bound call's trial times the host's pace, which a call in a CUDA
        graph does not pay: it is remembered apart."""
        key = (host_bound, log_bucket(x_MK.shape[0], TOKEN_BUCKETS), log_bucket(self.l0_mean, TRIAL_BUCKETS))
        if key not in self.trials:
            if not can_time(x_MK):
                return None
            calls = {name: lambda name=name: trial(get_backend(name)) for name in ("torch", sparse)}
            if host_bound:
                ms = loop_times_ms(calls, HOST_BOUND_TRIAL_ROUNDS, HOST_BOUND_TRIAL_CALLS, x_MK.device)
            else:
                ms = best_times_ms(calls, TRIAL_REPS)
            self.trials[key] = sparse if ms[sparse] <= TRIAL_MARGIN * ms["torch"] else "torch"
            log.debug("trial at %s: %s ms -> %s", key, ms, self.trials[key])
        return self.trials[key]
