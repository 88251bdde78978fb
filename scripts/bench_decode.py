"""Decoding-step benchmark: the whole model feeding one token per row, dense FFNs vs the sparse decode kernel,
each step issued eagerly and replayed as a CUDA graph (sparse_llm.generation.decoding, what generate.py runs).

    python scripts/bench_decode.py --size 2b --density-l0 24 --batches 1,4,16
    python scripts/bench_decode.py --checkpoint outputs/<run>/final --batches 1,8
    python scripts/bench_decode.py --size tiny --batches 1,2 --prompt-len 16 --steps 4 --device cpu   # smoke run

The model and its sparsity are built as scripts/bench_model.py builds them (sparse_llm/bench/model_setup.py)
(--density-l0: a random-init model given
~T positive gate pre-activations per token, calibrated on random prompts). Per batch of B prompts of --prompt-len
random tokens: prefill, one eager step and one captured step, then --steps steps timed with CUDA events, each
feeding the arg-max of the last logits (greedy decoding, its arg-max included); the median over --reps such runs, as
ms per step and new tokens per second. The kernels take turns run by run (the order rotating), so that a drift in
the host's pace, which sets the eager steps' time, reaches every kernel alike; each eager step's speed against
`torch` is also given as the median of the per-run ratios. Kernels: `stock` (transformers' own modules: the plain
dense model), `torch` (our modules, dense FFN) and `auto` (each layer's FFN path chosen by the cost model from the
per-layer L0 that the `torch` pass measured on the prompts, which the report gives).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from sparse_llm.bench.arguments import add_model_source, add_record_dir, check_model_source
from sparse_llm.bench.model_setup import (
    CALIBRATION_TOKENS,
    STOCK,
    LayerStats,
    layer_stats,
    load_model,
    make_sparse,
    set_kernel,
)
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.timing import Clock, hardware_summary
from sparse_llm.ffn.mlp import recording_statistics
from sparse_llm.generation.decoding import SETUP_STEPS, DecodeSteps
from sparse_llm.model.llama import sparse_mlps

KERNELS = (STOCK, "torch", "auto")


@dataclass
class StepTiming:
    """ms per decoding step of one (kernel, batch), eager and replayed (medians over the runs); `eager_vs_torch`: the
    median over the runs of the `torch` run's eager ms / this kernel's, beside it in turn (None without `torch`);
    `paths`: FFN path -> layers."""

    kernel: str
    batch: int
    eager_ms: float
    graph_ms: float | None  # None on a CPU
    eager_vs_torch: float | None
    paths: dict[str, int]

    @property
    def fastest_ms(self) -> float:
        """The replayed steps where measured, else the eager ones."""
        return self.graph_ms if self.graph_ms is not None else self.eager_ms


def step_ms(model: torch.nn.Module, prompts_BS: torch.Tensor, steps: int, cuda_graph: bool) -> float:
    """ms per decoding step after the prompts prompts_BS [B, S], the setup steps (warm-up, capture) excluded."""
    clock = Clock(prompts_BS.device)
    with torch.no_grad():
        decoder = DecodeSteps(model, torch.ones_like(prompts_BS), steps + SETUP_STEPS, cuda_graph)
        logits_BV = decoder.prefill(prompts_BS)
        for _ in range(SETUP_STEPS):
            logits_BV = decoder(logits_BV.argmax(dim=-1))
        start = clock.mark()
        for _ in range(steps):
            logits_BV = decoder(logits_BV.argmax(dim=-1))
        return clock.elapsed_ms(start, clock.mark()) / steps


def bench(model, prompts_BS, kernels: list[str], observed: list[LayerStats] | None, args) -> list[StepTiming]:
    """One StepTiming per kernel for the prompts prompts_BS [B, S], from args.reps runs of each kernel in turn."""
    modes = (False, True) if prompts_BS.is_cuda else (False,)  # eager, replayed
    runs: dict[str, list[dict[bool, float]]] = {kernel: [] for kernel in kernels}
    paths: dict[str, Counter] = {}
    for rep in range(args.reps):
        for kernel in kernels[rep % len(kernels) :] + kernels[: rep % len(kernels)]:
            set_kernel(model, kernel, observed)
            runs[kernel].append({graph: step_ms(model, prompts_BS, args.steps, graph) for graph in modes})
            paths[kernel] = Counter(mlp.dispatcher.current for mlp in sparse_mlps(model))  # none on stock modules
    timings = []
    for kernel in kernels:
        median = {graph: statistics.median(run[graph] for run in runs[kernel]) for graph in modes}
        vs_torch = None
        if "torch" in runs:
            vs_torch = statistics.median(base[False] / run[False] for base, run in zip(runs["torch"], runs[kernel]))
        timings.append(
            StepTiming(kernel, prompts_BS.shape[0], median[False], median.get(True), vs_torch, dict(paths[kernel]))
        )
    return timings


def prompt_l0(model, prompts_BS: torch.Tensor) -> list[LayerStats]:
    """Per-layer L0 of the prompts on the dense path: what `auto` decides from."""
    set_kernel(model, "torch", None)
    with torch.no_grad(), recording_statistics(model):
        model.model(input_ids=prompts_BS, use_cache=False)
    return layer_stats(model)


def dense_ratios(rows: list[StepTiming]) -> list[tuple[float | None, float | None]]:
    """Each row's speed (its fastest ms per step) over the `torch` and the `stock` row's of the same batch; None
    where that row was not run."""
    dense = {(r.kernel, r.batch): r for r in rows if r.kernel in (STOCK, "torch")}
    ratios = []
    for r in rows:
        pair = [dense.get((base, r.batch)) for base in ("torch", STOCK)]
        ratios.append(tuple(None if other is None else other.fastest_ms / r.fastest_ms for other in pair))
    return ratios


def table(rows: list[StepTiming]) -> list[str]:
    """Markdown rows: ms per step eager and replayed, tokens/s, and the replayed speed vs the dense paths."""
    lines = [
        "| batch | FFN | eager ms/step | eager vs torch | graph ms/step | tokens/s | vs torch | vs stock | FFN paths |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, pair in zip(rows, dense_ratios(rows), strict=True):
        ratios = ["-" if ratio is None else f"{ratio:.2f}x" for ratio in pair]
        graph = "-" if r.graph_ms is None else f"{r.graph_ms:.3f}"
        paths = ", ".join(f"{p} x{n}" for p, n in r.paths.items()) or "LlamaMLP"
        eager_vs = "-" if r.eager_vs_torch is None else f"{r.eager_vs_torch:.3f}x"
        lines.append(
            f"| {r.batch} | {r.kernel} | {r.eager_ms:.3f} | {eager_vs} | {graph} | "
            f"{r.batch * 1000 / r.fastest_ms:.0f} | {ratios[0]} | {ratios[1]} | {paths} |"
        )
    return lines


def l0_line(stats: list[LayerStats]) -> str:
    means = [s.l0_mean for s in stats]
    return (
        f"Prompt L0 per layer (non-zeros of h per token): mean {statistics.mean(means):.1f} "
        f"(layers {min(means):.1f}-{max(means):.1f}), p99 up to {max(s.l0_p99 for s in stats):.0f}, "
        f"max {max(s.l0_max for s in stats):.0f}."
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--density-l0", type=float, default=None, help="make a --size model ~T non-zeros/token")
    parser.add_argument("--batches", default="1,4,16", help="prompts decoded together, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=64, help="timed decoding steps per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per case (the median is reported)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {list(KERNELS)}")
    add_record_dir(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    check_model_source(parser, args)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    args.kernel_list = args.kernels.split(",")
    unknown = sorted(set(args.kernel_list) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; choose from {list(KERNELS)}")
    if min(args.batch_list) < 1 or args.steps < 1 or args.reps < 1:
        parser.error("--batches, --steps and --reps must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> list[StepTiming]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    model = load_model(device, checkpoint=args.checkpoint, size=args.size, vocab_size=args.vocab_size, seed=args.seed)
    if args.prompt_len + args.steps + SETUP_STEPS > model.config.max_position_embeddings:
        raise SystemExit(
            f"--prompt-len + --steps + {SETUP_STEPS} exceeds the model's context of "
            f"{model.config.max_position_embeddings}"
        )
    gen = torch.Generator().manual_seed(args.seed)
    prompts_BS = torch.randint(0, model.config.vocab_size, (max(args.batch_list), args.prompt_len), generator=gen)
    prompts_BS = prompts_BS.to(device)
    if args.density_l0 is not None:
        make_sparse(model, args.density_l0, prompts_BS[: max(1, CALIBRATION_TOKENS // args.prompt_len)])
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    observed = prompt_l0(model, prompts_BS)
    rows = []
    for batch in args.batch_list:
        rows += bench(model, prompts_BS[:batch], args.kernel_list, observed, args)
        print("\n".join(table(rows[-len(args.kernel_list) :])[2:]), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = "\n".join(
        [
            f"### Decoding steps, {args.checkpoint or args.size} ({stamp})",
            "",
            f"Hardware: {hardware_summary(device)}. Settings: `python scripts/bench_decode.py "
            f"{' '.join(argv)}` (prompts of {args.prompt_len} random tokens, "
            f"{args.steps} timed steps, median of {args.reps} runs, the kernels in turn).",
            l0_line(observed),
            "",
            *table(rows),
        ]
    )
    print("\n" + report, flush=True)
    results = [
        {**asdict(r), "tokens_per_s": r.batch * 1000 / r.fastest_ms, "vs_torch": vs_torch, "vs_stock": vs_stock}
        for r, (vs_torch, vs_stock) in zip(rows, dense_ratios(rows), strict=True)
    ]
    settings = {
        "checkpoint": args.checkpoint,
        "size": args.size,
        "vocab_size": args.vocab_size,
        "density_l0": args.density_l0,
        "batches": args.batch_list,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "reps": args.reps,
        "kernels": args.kernel_list,
        "seed": args.seed,
    }
    layers = [asdict(stats) for stats in observed]
    write_record(args.record_dir, make_record("bench_decode", settings, results, device, argv, prompt_l0=layers))
    return rows


if __name__ == "__main__":
    main()
