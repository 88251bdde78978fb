"""Timed trials: run candidate calls on the GPU and keep the fastest.

Where a price cannot tell two paths apart, a layer times both once on its own inputs and remembers the winner by a
bucket of its token count and density (`log_bucket`). `SPARSE_LLM_AUTO=priced` (and `SPARSE_LLM_TWELL_WALK=priced`)
turn trials off for bit-reproducible choices (`env_choice`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

CHOICES = ("measured", "priced")

Key = TypeVar("Key", bound=Hashable)


def best_times_ms(calls: dict[Key, Callable[[], object]], reps: int) -> dict[Key, float]:
    """Each of `calls` timed on the current CUDA stream: one untimed run each (a first call may load its kernels), then
    `reps` rounds of all of them in turn between CUDA events; each call's best time (the least disturbed) in ms.
    Waits for the GPU once."""
    for call in calls.values():
        call()
    events: dict[Key, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events[key].append((start, end))
    end.synchronize()  # the last event recorded: every timed call is done
    return {key: min(s.elapsed_time(e) for s, e in pairs) for key, pairs in events.items()}


def loop_times_ms(
    calls: dict[Key, Callable[[], object]], rounds: int, per_run: int, device: torch.device
) -> dict[Key, float]:
    """Each of `calls` run `per_run` times back to back between two waits for CUDA `device`, timed by the host's clock,
    `rounds` times in turn after one untimed run each: each call's best wall time per call in ms (what a loop of such
    calls pays, the host's time or the device's)."""
    best = dict.fromkeys(calls, math.inf)
    for timed in (False,) + (True,) * rounds:
        for key, call in calls.items():
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(per_run):
                call()
            torch.cuda.synchronize(device)
            if timed:
                best[key] = min(best[key], (time.perf_counter() - start) * 1e3 / per_run)
    return best


def can_time(x: torch.Tensor) -> bool:
    """Whether a trial may time calls on x's device now: a GPU, and no CUDA graph being captured (a trial waits for
    the GPU, which a capture forbids)."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing()


def env_choice(env: str, meaning: str) -> str:
    """The environment variable `env`'s choice between a measured and a priced decision: "measured" (default) or
    "priced"; `meaning` says what each does, for the error on any other value."""
    choice = os.environ.get(env, "measured")
    if choice not in CHOICES:
        raise ValueError(f"{env}={choice!r} is not valid; use one of {list(CHOICES)} ({meaning})")
    return choice


def log_bucket(value: float, per_doubling: int) -> int:
    """The bucket of `value` (>= 1 counted; below, as 1) on a log scale of `per_doubling` buckets per doubling: what
    a trial's result is remembered by, so that values within a factor 2 ** (1 / per_doubling) share it."""
    return round(per_doubling * math.log2(max(value, 1.0)))
