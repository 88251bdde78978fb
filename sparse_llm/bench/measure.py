"""Whole-model measurements: a forward or a training step per FFN path, timed, metered and broken down.

What is measured, per FFN path: tokens/ms from the median of CUDA-event timings after warm-up; peak allocated memory
(resident weights included; in training also gradients and AdamW state); energy per token from the NVML counter
over >= `energy_seconds` of back-to-back calls (None on a CPU or without pynvml); per-layer L0 and the path each
layer took in its last call; a time breakdown from CUDA events around the attention and FFN modules (a separate
pass, so the events cost the throughput numbers nothing; eager layers only: hooks around modules would split
compiled graphs); and on a GPU the device time of one profiled call per kernel family (`timing.kernel_family`), the
time any device work ran ("busy") and the rest of the timed call's median ("idle": the device waited for the host).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from sparse_llm.bench.model_setup import (
    STOCK,
    LayerStats,
    decoder_layers,
    free_memory,
    kernel_unavailable_reason,
    layer_stats,
    set_kernel,
)
from sparse_llm.bench.timing import (
    Clock,
    PeakMemory,
    SectionTimer,
    device_ms_by_family,
    energy_mj_per_call,
    profile_once,
    time_ms,
    time_samples_ms,
)
from sparse_llm.bench.train_step import TrainStep
from sparse_llm.ffn.mlp import recording_statistics
from sparse_llm.telemetry.energy import EnergyMeter
from sparse_llm.training.trainer import FrozenHeap

MODES = ("forward", "train")
BREAKDOWN_REPS = 3


@dataclass(frozen=True)
class MeasureOptions:
    """How the variants are timed and run (the benchmark's command-line options of the same names)."""

    warmup: int = 3
    reps: int = 10
    energy_seconds: float = 2.0
    l1: float = 2e-5  # L1 coefficient of the training loss
    lr: float = 0.0  # AdamW does the same work at any lr; 0 keeps the weights (so L0) fixed
    accumulate: int = 1  # training micro-batches per optimizer step
    compile: bool = False  # decoder layers are torch.compiled: no per-module breakdown
    cuda_graphs: bool = False  # compiled parts replayed as CUDA graphs
    profile_dir: str | None = None  # one profiled call per variant: trace and top-ops table here
    max_train_batch: int = 0  # largest training micro-batch to try (0: do not search)

    @classmethod
    def from_namespace(cls, namespace: object) -> MeasureOptions:
        """The options an argparse namespace holds under these names (the others keep their defaults)."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(namespace, f.name)]
        return cls(**{name: getattr(namespace, name) for name in names})


@dataclass
class VariantResult:
    """One (mode, kernel, micro-batch) measurement. `skipped` holds the reason when it could not run."""

    mode: str
    kernel: str
    batch: int
    tokens: int
    ms: float | None = None
    ms_spread: tuple[float, float] | None = None  # (min, max) of the timed calls
    samples_ms: list[float] = field(default_factory=list)  # the timed calls, in order
    tokens_per_ms: float | None = None
    peak_gib: float | None = None
    mj_per_token: float | None = None
    layers: list[LayerStats] = field(default_factory=list)
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    device_ms: dict[str, float] = field(default_factory=dict)  # timing.device_ms_by_family of one call
    skipped: str | None = None

    def path_summary(self) -> str:
        """e.g. 'twell x6, twell+dense-rows x2 (140 rows dense)'."""
        if not self.layers:
            return "LlamaMLP (no statistics)"
        counts = collections.Counter(layer.path for layer in self.layers)
        text = ", ".join(f"{path} x{n}" for path, n in counts.most_common())
        rerouted = sum(layer.overflow_rows for layer in self.layers)
        return text + (f" ({rerouted} rows dense)" if rerouted else "")


def gate_gemm_ms(model: LlamaForCausalLM, tokens: int, dtype: torch.dtype, options: MeasureOptions) -> float:
    """All layers' gate GEMMs [tokens, K] x [K, N], timed alone (cost does not depend on the values)."""
    layers = decoder_layers(model)
    w_NK = layers[0].mlp.gate_proj.weight.detach().to(dtype)
    x_MK = torch.randn(tokens, w_NK.shape[1], device=w_NK.device, dtype=dtype)
    with torch.no_grad():
        one = time_ms(
            lambda: F.linear(x_MK, w_NK), warmup=options.warmup + 2, reps=max(options.reps, 20), device=w_NK.device
        )
    return one * len(layers)


def section_timer(model: LlamaForCausalLM, device: torch.device) -> SectionTimer:
    layers = decoder_layers(model)
    return SectionTimer(
        {"attention": [layer.self_attn for layer in layers], "ffn": [layer.mlp for layer in layers]}, device
    )


def split_forward(total: float, sections: dict[str, float], gate_ms: float) -> dict[str, float]:
    return {
        "attention": sections["attention"],
        "ffn gate GEMM": gate_ms,
        "ffn rest": sections["ffn"] - gate_ms,
        "other fwd": total - sections["attention"] - sections["ffn"],
    }


def median_dicts(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: sorted(r[key] for r in rows)[len(rows) // 2] for key in rows[0]}


def fill_timing(result: VariantResult, samples: list[float], peak_gib: float | None, energy_mj: float | None) -> None:
    result.samples_ms = list(samples)
    result.ms = statistics.median(samples)
    result.ms_spread = (min(samples), max(samples))
    result.tokens_per_ms = result.tokens / result.ms
    result.peak_gib = peak_gib
    result.mj_per_token = None if energy_mj is None else energy_mj / result.tokens


def write_profile(
    fn: Callable[[], object], result: VariantResult, device: torch.device, options: MeasureOptions
) -> None:
    """With a profile_dir: one profiled call of fn, as <dir>/<mode>_<kernel>.json (trace) and .txt (top ops)."""
    if not options.profile_dir:
        return
    out = Path(options.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{result.mode}_{result.kernel}"
    with torch.inference_mode() if result.mode == "forward" else nullcontext():
        table = profile_once(fn, stem.with_suffix(".json"), device, row_limit=45)
    stem.with_suffix(".txt").write_text(table)
    print(f"profile: {stem}.json / .txt", flush=True)


def bench_forward(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    kernel: str,
    observed: list[LayerStats] | None,
    meter: EnergyMeter,
    gate_ms: float,
    options: MeasureOptions,
) -> VariantResult:
    """Core-model forward (no lm_head, no KV cache) of ids [B, T] with every FFN on `kernel`."""
    device = ids.device
    set_kernel(model, kernel, observed)
    result = VariantResult("forward", kernel, ids.shape[0], ids.numel())

    def forward() -> object:
        if options.cuda_graphs:  # a new step: this call's graphs may overwrite the last call's outputs
            torch.compiler.cudagraph_mark_step_begin()
        return model.model(input_ids=ids, use_cache=False)

    try:
        with torch.inference_mode(), PeakMemory(device) as peak:
            samples = time_samples_ms(forward, options.warmup, options.reps, device)
            with recording_statistics(model):  # the timed calls skip what only this report needs
                forward()
            result.layers = layer_stats(model)
            energy = energy_mj_per_call(meter, forward, options.energy_seconds)
        fill_timing(result, samples, peak.gib, energy)
        if not options.compile:
            clock, runs = Clock(device), []
            with torch.inference_mode(), section_timer(model, device) as timer:
                for _ in range(BREAKDOWN_REPS):
                    start = clock.mark()
                    forward()
                    total = clock.elapsed_ms(start, clock.mark())
                    runs.append({"total": total, **split_forward(total, timer.totals_ms(), gate_ms)})
            result.breakdown_ms = median_dicts(runs)
        with torch.inference_mode():
            result.device_ms = device_ms_by_family(forward, device)
        write_profile(forward, result, device, options)
    except torch.OutOfMemoryError:
        result.skipped = f"out of memory at micro-batch {ids.shape[0]}"
    finally:
        free_memory(model, device)
    return result


def bench_train(
    model: LlamaForCausalLM,
    master: dict[str, torch.Tensor],
    ids: torch.Tensor,
    kernel: str,
    observed: list[LayerStats] | None,
    meter: EnergyMeter | None,
    gate_ms: float | None,
    options: MeasureOptions,
) -> VariantResult:
    """Training steps on ids [B, T] from the master weights; energy and breakdown only when given."""
    device = ids.device
    result = VariantResult("train", kernel, ids.shape[0], ids.numel() * options.accumulate)
    model.load_state_dict(master)
    model.train()
    set_kernel(model, kernel, observed)
    step: TrainStep | None = None
    try:
        with FrozenHeap() as heap:  # as the trainer runs its steps
            with PeakMemory(device) as peak:
                step = TrainStep(
                    model,
                    ids,
                    options.l1,
                    options.lr,
                    after=heap.freeze,
                    cuda_graphs=options.cuda_graphs,
                    accumulate=options.accumulate,
                )
                # Steps back to back, as the trainer issues them: a step's time is from its first kernel's turn on
                # the device to its last, including any wait of the device for the host within it.
                samples = time_samples_ms(step, options.warmup, options.reps, device, drain=False)
                result.layers = layer_stats(model)
                energy = energy_mj_per_call(meter, step, options.energy_seconds) if meter is not None else None
            fill_timing(result, samples, peak.reserved_gib if options.cuda_graphs else peak.gib, energy)
            if gate_ms is not None:
                if not options.compile:
                    result.breakdown_ms = train_breakdown(model, step, gate_ms)
                result.device_ms = device_ms_by_family(step, device)
                write_profile(step, result, device, options)
    except torch.OutOfMemoryError as exc:
        result.skipped = f"out of memory at micro-batch {ids.shape[0]}"
        print(f"train, {kernel}, micro-batch {ids.shape[0]}: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
    except NotImplementedError as exc:  # a backend without a training path says so in its error
        result.skipped = f"no training path: {exc}"
    finally:
        del step
        model.zero_grad(set_to_none=True)
        if options.cuda_graphs:
            # The graphs' memory pools outlive the variant's tensors; drop them with the compiled code (the next
            # variant compiles again), so that its peak reserve does not count this variant's pools.
            torch._dynamo.reset()
        free_memory(model, device)
    return result


def train_breakdown(model: LlamaForCausalLM, step: TrainStep, gate_ms: float) -> dict[str, float]:
    """Phase times of one step, summed over its micro-batches (forward, backward), then its optimizer step."""
    device = step.ids.device
    clock, runs = Clock(device), []
    with section_timer(model, device) as timer:
        for _ in range(BREAKDOWN_REPS):
            marks = [clock.mark()]  # then after each forward and each backward, then after the update
            with step.micro_batches():
                for _ in range(step.accumulate):
                    loss = step.forward()
                    marks.append(clock.mark())
                    timer.active = False  # gradient checkpointing re-runs module forwards inside backward
                    step.backward(loss)
                    marks.append(clock.mark())
                    timer.active = True
            step.update(loss)
            marks.append(clock.mark())
            spans = [clock.elapsed_ms(a, b) for a, b in itertools.pairwise(marks)]
            runs.append(
                {
                    "total": clock.elapsed_ms(marks[0], marks[-1]),
                    **split_forward(sum(spans[0:-1:2]), timer.totals_ms(), gate_ms * step.accumulate),
                    "backward": sum(spans[1:-1:2]),
                    "optimizer": spans[-1],
                }
            )
    return median_dicts(runs)


def largest_batches(
    model: LlamaForCausalLM,
    master: dict[str, torch.Tensor],
    ids: torch.Tensor,
    measured: list[VariantResult],
    observed: list[LayerStats] | None,
    meter: EnergyMeter,
    options: MeasureOptions,
) -> list[VariantResult]:
    """Per training kernel that ran (`measured`), the largest micro-batch that fits in memory, growing it by half
    (rounded up, ending at options.max_train_batch: 4, 6, 8 or 2, 3, 5, 8) until it runs out, with its throughput and
    energy (the measured row itself where the first step already runs out of memory); ids [>= max_train_batch, T]
    holds the inputs. Steps of a half, not doublings: a sparse path that saves a third of the memory fits 1.5x the
    batch, which doubling would miss."""
    found = []
    for best in measured:
        batch = best.batch
        while batch < options.max_train_batch:
            batch = min(max(batch + 1, math.ceil(batch * 1.5)), options.max_train_batch)
            row = bench_train(model, master, ids[:batch], best.kernel, observed, meter, None, options)
            if row.skipped:
                print(f"largest fit, {best.kernel}: stopped at micro-batch {batch} ({row.skipped})", flush=True)
                break
            best = row
        found.append(dataclasses.replace(best, mode="train (largest fit)"))
    return found


def run_variants(
    mode: str,
    kernels: Sequence[str],
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    bench: Callable[[str, list[LayerStats] | None], VariantResult],
    on_row: Callable[[VariantResult], None] = lambda row: None,
) -> list[VariantResult]:
    """bench(kernel, observed) for each of `kernels` that can run here; the others are listed as skipped. Each
    row goes to on_row as soon as it is measured.

    `observed` is the per-layer L0 of the first variant that recorded it (the `torch` pass), which the
    `auto` variant decides from.
    """
    rows: list[VariantResult] = []
    observed = None
    for kernel in kernels:
        reason = kernel_unavailable_reason(kernel, model, ids.device)
        row = (
            VariantResult(mode, kernel, ids.shape[0], ids.numel(), skipped=reason)
            if reason
            else bench(kernel, observed)
        )
        rows.append(row)
        observed = observed or (row.layers or None)
        on_row(row)
    return rows


def speed_ratios(results: list[VariantResult]) -> list[tuple[float | None, float | None]]:
    """Each row's tokens/ms over the `stock` and the `torch` row's of the same mode and micro-batch (largest-fit rows
    compare across micro-batches); None where that row is missing, skipped, or this one is."""

    def key(r: VariantResult) -> tuple[str, int | None]:
        return r.mode, (r.batch if r.mode in MODES else None)

    bases = {(r.kernel, key(r)): r for r in results if r.kernel in (STOCK, "torch") and not r.skipped}
    ratios = []
    for r in results:
        pair = []
        for kernel in (STOCK, "torch"):
            base = bases.get((kernel, key(r)))
            pair.append(None if r.skipped or base is None else r.tokens_per_ms / base.tokens_per_ms)
        ratios.append((pair[0], pair[1]))
    return ratios


def result_row(result: VariantResult, vs_stock: float | None, vs_torch: float | None) -> dict[str, object]:
    """A VariantResult as one row of a benchmark record, with its `speed_ratios`: its scalars first, then its
    per-layer and per-section detail (which the generated tables leave to the record file)."""
    lo, hi = result.ms_spread or (None, None)
    layers = result.layers
    return {
        "mode": result.mode,
        "kernel": result.kernel,
        "micro_batch": result.batch,
        "tokens": result.tokens,
        "ms": result.ms,
        "ms_min": lo,
        "ms_max": hi,
        "tokens_per_ms": result.tokens_per_ms,
        "vs_stock": vs_stock,
        "vs_torch": vs_torch,
        "peak_gib": result.peak_gib,
        "mj_per_token": result.mj_per_token,
        "l0_mean": sum(layer.l0_mean for layer in layers) / len(layers) if layers else None,
        "l0_p99_worst_layer": max(layer.l0_p99 for layer in layers) if layers else None,
        "l0_max": max(layer.l0_max for layer in layers) if layers else None,
        "paths": None if result.skipped else result.path_summary(),
        "skipped": result.skipped,
        "breakdown_ms": result.breakdown_ms,
        "device_ms": result.device_ms,
        "layers": [dataclasses.asdict(layer) for layer in layers],
    }
