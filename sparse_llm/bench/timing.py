"""Measurement helpers shared by the benchmark scripts: time, energy, peak memory, per-module time.

Conventions (docs/design.md "Conventions"): a time is the median of several timings taken after warm-up
calls; on a GPU each timing is a pair of CUDA events around the call, on a CPU (smoke tests) a
`time.perf_counter` pair, which is exact there because CPU kernels run synchronously. Energy comes from
the NVML cumulative counter (`sparse_llm.telemetry.energy.EnergyMeter`) over a window of at least `seconds` of
back-to-back calls, because the counter only advances every 20-100 ms.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from sparse_llm.telemetry.energy import EnergyMeter

Mark = Any  # a recorded torch.cuda.Event on a GPU, a perf_counter() float on a CPU


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Clock:
    """Timestamps on one device's timeline: CUDA events on a GPU, wall-clock time on a CPU."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Mark:
        """A timestamp taken after all work queued so far on the current stream."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def wait(self, mark: Mark) -> None:
        """Block the host until the GPU has reached `mark` (nothing to wait for on a CPU)."""
        if self.cuda:
            mark.synchronize()

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds between two marks (waits for `end` on a GPU)."""
        self.wait(end)
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def time_samples_ms(
    fn: Callable[[], object],
    warmup: int = 5,
    reps: int = 30,
    device: torch.device | str | None = None,
    drain: bool = True,
) -> list[float]:
    """Per-call times of `reps` calls of fn() in ms, after `warmup` untimed calls.

    drain=True waits for each call before the next is issued: a call's time then includes the host's latency to
    its first kernel (an isolated call, as a decode step that reads its result). drain=False issues the calls
    back to back and waits once at the end, as a model's layers run: the host works ahead of the GPU, and a
    call's time includes only the gaps where the GPU waited for it.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"time_samples_ms: reps={reps} must be >= 1 and warmup={warmup} >= 0.")
    clock = Clock(device)
    for _ in range(warmup):
        fn()
    clock.synchronize()
    marks = []
    for _ in range(reps):
        start = clock.mark()
        fn()
        end = clock.mark()
        if drain:
            clock.wait(end)
        marks.append((start, end))
    return [clock.elapsed_ms(start, end) for start, end in marks]


def time_ms(
    fn: Callable[[], object],
    warmup: int = 5,
    reps: int = 30,
    device: torch.device | str | None = None,
    drain: bool = True,
) -> float:
    """Median time of fn() in ms (CUDA events on a GPU; see the module docstring and `time_samples_ms`)."""
    return statistics.median(time_samples_ms(fn, warmup, reps, device, drain))


def wall_ms(fn: Callable[[], object], reps: int = 30, device: torch.device | str | None = None) -> float:
    """Host wall-clock ms per call of `reps` back-to-back calls (one sync at the end), after one warm-up call.

    Above the device time of a call, the GPU waited for the host (launch overhead, host reads): stalls that
    per-call CUDA-event timings hide.
    """
    clock = Clock(device)
    fn()
    clock.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    clock.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps


def graph_ms(fn: Callable[[], object], reps: int = 100) -> float:
    """Device ms per fn() call replayed as a CUDA graph: the GPU's time with no host launch cost between kernels (a
    decode step whose launches are captured once). fn must not wait for the GPU; it is run once on a side stream to
    warm up, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def energy_mj_per_call(
    meter: EnergyMeter, fn: Callable[[], object], seconds: float = 1.0, calls_per_sync: int = 10
) -> float | None:
    """Energy of one fn() call in mJ, over a window of at least `seconds` of back-to-back calls.

    None when the meter has no reading (CPU, no pynvml, MIG). `calls_per_sync` calls are queued between
    the checks of the wall clock so the GPU never idles while the host waits. Windows under ~1 s are
    unreliable (the counter's update period is 20-100 ms).
    """
    if not meter.available:
        return None
    meter.lap()  # synchronises, then starts the window
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(calls_per_sync):
            fn()
        calls += calls_per_sync
        if meter.device.type == "cuda":
            torch.cuda.synchronize(meter.device)
    joules = meter.lap()
    return None if joules is None else 1e3 * joules / calls


class PeakMemory:
    """Peak allocated device memory (GiB) inside a `with` block; `gib` is None on a CPU.

    Counts what the torch caching allocator hands out (tensors), not its reserve or the CUDA context.
    `reserved_gib`: the peak of its reserve, which also holds the memory pools of CUDA graphs (their replays
    reuse the pool's memory without allocating, so `gib` does not see it).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.gib: float | None = None
        self.reserved_gib: float | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.gib = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.reserved_gib = torch.cuda.max_memory_reserved(self.device) / 2**30


class SectionTimer:
    """Time spent inside the forward calls of chosen modules, summed per named section.

    sections maps a name to modules, e.g. {"attention": [layer.self_attn, ...], "ffn": [layer.mlp, ...]}.
    While the timer is entered and `active`, a pre-forward hook marks each call's start and a forward
    hook its end. Marks are CUDA events, so measuring adds no host synchronisation inside the model;
    `totals_ms()` waits once and sums. Clear `active` around code whose module calls must not count
    (e.g. the recomputation of gradient checkpointing during backward).
    """

    def __init__(self, sections: dict[str, list[nn.Module]], device: torch.device | str) -> None:
        self.sections = sections
        self.clock = Clock(device)
        self.active = True
        self._spans: dict[str, list[tuple[Mark, Mark]]] = defaultdict(list)
        self._open: dict[int, Mark] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> SectionTimer:
        for name, modules in self.sections.items():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._start))
                self._handles.append(module.register_forward_hook(self._ender(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _start(self, module: nn.Module, args: object) -> None:
        if self.active:
            self._open[id(module)] = self.clock.mark()

    def _ender(self, name: str) -> Callable[[nn.Module, object, object], None]:
        def end(module: nn.Module, args: object, output: object) -> None:
            start = self._open.pop(id(module), None)
            if self.active and start is not None:
                self._spans[name].append((start, self.clock.mark()))

        return end

    def totals_ms(self) -> dict[str, float]:
        """Summed ms per section since the last call (every section named, 0.0 if it never ran)."""
        totals = {
            name: sum(self.clock.elapsed_ms(a, b) for a, b in self._spans.get(name, [])) for name in self.sections
        }
        self._spans.clear()
        self._open.clear()
        return totals


# Device kernels by what they compute, from their names (first match wins; "other" for the rest): a compiled
# model's time has no module boundaries left to put timers at, but its kernels still say what they are.
KERNEL_FAMILIES = (
    ("sparse FFN", re.compile(r"^(void )?(train_|gate_up_|twell_|transpose_cast|order_tokens|entries_|ell_to_slots)")),
    ("attention", re.compile(r"sdpa|flash|fmha|attention|compute_dot_do_o|rope_")),
    ("GEMM", re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.IGNORECASE)),
    # CUDA graphs copy inputs made outside them into their own buffers with a multi-tensor copy (torch 2.11).
    ("graph input copies", re.compile(r"multi_tensor_apply_kernel<.*Copy<")),
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.IGNORECASE)),
    ("sort", re.compile(r"RadixSort|fill_reverse_indices")),
    ("fused by torch.compile", re.compile(r"^triton_")),
)


def kernel_family(name: str) -> str:
    """The KERNEL_FAMILIES name of a device kernel (or memset / memcpy), "other" where none matches."""
    return next((family for family, pattern in KERNEL_FAMILIES if pattern.search(name)), "other")


def _profiled_call(fn: Callable[[], object], device: torch.device | str) -> profile:
    """One call of fn under torch.profiler (host activity, and the device's on a GPU), started and ended with the
    device idle so that the profile holds exactly this call's work."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return prof


def device_ms_by_family(fn: Callable[[], object], device: torch.device | str) -> dict[str, float]:
    """Device time of one call of fn: ms per `kernel_family`, and "busy", the time any device work ran (the union
    of the intervals: kernels that overlap count once). Empty on a CPU.

    One call under torch.profiler, after the device is idle; the kernels' own times are unaffected by the
    profiler, the host's are not, so compare "busy" with an unprofiled wall-clock time of the call: the
    difference is time the device waited for the host.
    """
    if torch.device(device).type != "cuda":
        return {}
    prof = _profiled_call(fn, device)
    # Device-side spans of record_function ranges (an optimizer step, a compiled graph) cover kernels and the gaps
    # between them: only the device work itself counts.
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )
    totals: dict[str, float] = defaultdict(float)
    busy_us, reach = 0.0, float("-inf")
    for start, end, name in spans:
        totals[kernel_family(name)] += (end - start) / 1e3
        busy_us += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return {"busy": busy_us / 1e3, **totals}


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """||got - reference|| / ||reference|| (L2 over all elements, in fp32; an all-zero reference divides by 1e-30)."""
    reference = reference.float()
    return ((got.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def l0_summary(l0_M: torch.Tensor) -> tuple[float, float, float]:
    """(mean, p99, max) of per-token non-zero counts l0_M [M]."""
    if l0_M.numel() == 0:
        raise ValueError("l0_summary: l0_M is empty; run the model on at least one token first.")
    l0 = l0_M.detach().float().flatten()
    return l0.mean().item(), torch.quantile(l0, 0.99).item(), l0.max().item()


def hardware_summary(device: torch.device | str) -> str:
    """One line naming the device and the software stack, for benchmark tables."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return f"{name} ({sms} SMs), torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}"


def profile_once(
    fn: Callable[[], object], trace_path: str | Path, device: torch.device | str, row_limit: int = 15
) -> str:
    """Run fn() once under torch.profiler; write a Chrome trace to `trace_path`, return the op table.

    The table lists the `row_limit` ops/kernels with the most self time on the device (CPU time on a
    CPU), which names the kernels that a module-level breakdown lumps together. CUDA kernels launched
    outside torch (CuPy) are recorded too: CUPTI sees every kernel on the device.
    """
    prof = _profiled_call(fn, device)
    prof.export_chrome_trace(str(trace_path))
    sort_by = "self_device_time_total" if torch.device(device).type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)
