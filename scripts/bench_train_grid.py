"""Is `kernel=auto` ever slower to train than the dense path? The training step of both, over a grid of settings.

    python scripts/bench_train_grid.py --sizes 1b 2b --density-l0 24 300               # the full grid, random init
    python scripts/bench_train_grid.py --checkpoint outputs/real_2b/final --tokens data/embedded --modes graphs
    python scripts/bench_train_grid.py --sizes tiny --seq-len 64 --batches 1 2 --modes eager --device cpu  # smoke

For each model (a random-init --sizes model made sparse at each --density-l0, or each --checkpoint), each of --modes
(eager; compile: trainer.compile=true; graphs: trainer.compile=true trainer.cuda_graphs=true) and each micro-batch of
--batches (x --seq-len tokens), one table row: the training step's median ms with `kernel=torch` and with
`kernel=auto` (the layers' choices made from the L0 the dense pass observed, as the trainer's observations do), their
ratio (above 1: auto is faster), each one's spread ((max - min) / median of its timed steps: a gap smaller than
that is noise), both steps' peak GPU memory, the layers auto trains on the sparse op, and "slower" where auto's median
took more than --tolerance (2%) longer than dense's ("slower within spread" where that gap is smaller than the
spread). A row whose verdict is not "ok" is timed again in the reverse order (auto, then dense) and judged on both
runs' steps together, so that a machine whose pace drifts over the four runs weighs on both paths alike; its "order"
column says so. A training step here is --accumulate micro-batches and the
optimizer's update (`bench.train_step.TrainStep`, as train.py runs it), timed back to back after --warmup steps.

The rows print as they are measured, and the record (docs/records/, `--record-dir`) is rewritten after each, so a run
cut short keeps what it measured. Each model is built again for each mode (its layers compiled for that mode); the
inductor cache makes a shape compiled before cheap to compile again.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from sparse_llm.bench.arguments import GRAPH_WARMUP_STEPS, add_record_dir, add_token_source, check_token_source
from sparse_llm.bench.measure import MeasureOptions, VariantResult, bench_train, fill_timing, run_variants
from sparse_llm.bench.model_setup import CALIBRATION_TOKENS, SIZES, load_model, make_inputs, make_sparse
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.model.llama import compile_layers

MODES = {"eager": (False, False), "compile": (True, False), "graphs": (True, True)}  # mode -> (compile, CUDA graphs)
KERNELS = ("torch", "auto")
REPS_TOKENS = 8192  # micro-batch size (tokens) at which a variant is timed over --reps steps


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=[], help="random-init models of these sizes")
    parser.add_argument(
        "--density-l0", nargs="+", type=float, default=[24.0], help="mean non-zeros per token of the random models"
    )
    parser.add_argument("--checkpoint", nargs="+", default=[], help="trained model directories (a run's final/)")
    add_token_source(parser)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8], help="micro-batches (rows)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--reps",
        type=int,
        default=5,
        help=f"timed steps per variant at {REPS_TOKENS} tokens a micro-batch or more; a smaller micro-batch takes "
        "proportionally more, up to 4x (its steps are shorter and vary more from one to the next)",
    )
    parser.add_argument("--tolerance", type=float, default=0.02, help="auto may take this much longer than dense")
    parser.add_argument("--l1", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_record_dir(parser)
    args = parser.parse_args(argv)
    check_token_source(parser, args)
    if not args.sizes and not args.checkpoint:
        parser.error("give --sizes (random-init models) or --checkpoint (trained ones), or both")
    if any(b < 1 for b in args.batches) or args.accumulate < 1 or args.reps < 1:
        parser.error("--batches, --accumulate and --reps must be >= 1")
    if any(not 0 < d for d in args.density_l0):
        parser.error("--density-l0 must be > 0")
    for path in args.checkpoint:
        if not (Path(path) / "config.json").is_file():
            parser.error(f"--checkpoint {path}: not a model directory (no config.json)")
    graphed = "graphs" in args.modes
    if graphed and torch.device(args.device).type != "cuda":
        parser.error(f"--modes graphs needs a CUDA GPU (--device {args.device})")
    if graphed and args.warmup < GRAPH_WARMUP_STEPS:
        parser.error(f"--modes graphs needs --warmup {GRAPH_WARMUP_STEPS} or more (the steps that record the graphs)")
    args.argv = list(argv)
    return args


def sources(args: argparse.Namespace) -> Iterator[tuple[str, dict]]:
    """(row label, load_model's and make_sparse's arguments) of each model of the grid."""
    for size in args.sizes:
        for density in args.density_l0:
            yield f"{size}, random at L0 {density:g}", {"size": size, "checkpoint": None, "density_l0": density}
    for path in args.checkpoint:
        yield path, {"size": None, "checkpoint": path, "density_l0": None}


def timed_steps(reps: int, tokens: int) -> int:
    """Timed steps for a micro-batch of `tokens`: reps at REPS_TOKENS or more, proportionally more below (up to 4x,
    one sequence of 2048 tokens), so that each variant is timed over about as much work."""
    return reps * min(4, max(1, math.ceil(REPS_TOKENS / tokens)))


def spread(result: VariantResult) -> float:
    """(max - min) / median of a variant's timed steps: how far apart two measurements of one thing may lie."""
    low, high = result.ms_spread or (result.ms, result.ms)
    return (high - low) / result.ms


def verdict(ratio: float, noise: float, tolerance: float) -> str:
    """A row's verdict: "ok" where auto took at most `tolerance` longer than dense; otherwise "slower", or "slower
    within spread" where the gap (1 / ratio - 1) is smaller than `noise`, the larger spread of the two variants' steps
    (`measure_source` then times the row again)."""
    gap = 1 / ratio - 1
    if gap <= tolerance:
        return "ok"
    return "slower within spread" if gap < noise else "slower"


def pooled(first: VariantResult, again: VariantResult) -> VariantResult:
    """One variant's two runs as one: the median and spread of both runs' timed steps, the larger peak, the layers'
    paths of the later run. A skipped run makes the result skipped."""
    if first.skipped or again.skipped:
        return first if first.skipped else again
    both = dataclasses.replace(first, layers=again.layers)
    peaks = [gib for gib in (first.peak_gib, again.peak_gib) if gib is not None]
    fill_timing(both, first.samples_ms + again.samples_ms, max(peaks, default=None), None)
    return both


def grid_row(
    source: str, mode: str, dense: VariantResult, auto: VariantResult, tolerance: float, order: str = "torch, auto"
) -> dict:
    """One row of the table: the two steps' times and what auto chose; `order`: the runs it was timed over."""
    row = {"model": source, "mode": mode, "micro-batch": dense.batch, "tokens per step": dense.tokens}
    skipped = dense.skipped or auto.skipped
    if skipped:
        return row | {"skipped": skipped}
    ratio = dense.ms / auto.ms
    sparse = [i for i, layer in enumerate(auto.layers) if layer.path != "torch"]
    return row | {
        "L0 mean": round(sum(layer.l0_mean for layer in dense.layers) / len(dense.layers), 1),
        "torch ms": round(dense.ms, 2),
        "auto ms": round(auto.ms, 2),
        "auto speedup": round(ratio, 3),
        "spread": f"{spread(dense):.1%} / {spread(auto):.1%}",
        "peak GiB torch": dense.peak_gib and round(dense.peak_gib, 2),  # None off a GPU
        "peak GiB auto": auto.peak_gib and round(auto.peak_gib, 2),
        "sparse layers": f"{len(sparse)}/{len(auto.layers)}",
        "verdict": verdict(ratio, max(spread(dense), spread(auto)), tolerance),
        "order": order,
    }


def measure_source(args: argparse.Namespace, source: str, spec: dict, mode: str) -> Iterator[dict]:
    """The rows of one model in one mode: built, made sparse, compiled for the mode, then each micro-batch."""
    device = torch.device(args.device)
    compiled, graphs = MODES[mode]
    model = load_model(device, checkpoint=spec["checkpoint"], size=spec["size"], vocab_size=None, seed=args.seed)
    ids = make_inputs(max(args.batches), args.seq_len, model.config.vocab_size, tokens=args.tokens, seed=args.seed)
    ids = ids.to(device)
    if spec["density_l0"] is not None:
        make_sparse(model, spec["density_l0"], ids[: max(1, CALIBRATION_TOKENS // args.seq_len)])
    if compiled:
        compile_layers(model, cuda_graphs=graphs)
    master = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    options = MeasureOptions(
        warmup=args.warmup,
        reps=args.reps,  # set per micro-batch below
        l1=args.l1,
        accumulate=args.accumulate,
        compile=compiled,
        cuda_graphs=graphs,
    )
    for batch in args.batches:
        batch_ids = ids[:batch]
        options = dataclasses.replace(options, reps=timed_steps(args.reps, batch_ids.numel()))

        def bench(kernel: str, seen: list | None) -> VariantResult:
            return bench_train(model, master, batch_ids, kernel, seen, None, None, options)

        dense, auto = run_variants("train", KERNELS, model, batch_ids, bench)
        row = grid_row(source, mode, dense, auto, args.tolerance)
        if row.get("verdict", "ok") != "ok":
            auto_again = bench("auto", dense.layers or None)  # auto decides from the dense run's L0, as before
            dense_again = bench("torch", None)
            order = "torch, auto, auto, torch"
            row = grid_row(source, mode, pooled(dense, dense_again), pooled(auto, auto_again), args.tolerance, order)
        yield row


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as bench_model.py: fp32 leftovers stay fp32
    settings = {
        name: getattr(args, name)
        for name in ("sizes", "density_l0", "checkpoint", "tokens", "batches", "seq_len", "modes", "accumulate")
    } | {"warmup": args.warmup, "reps": args.reps, "tolerance": args.tolerance, "l1": args.l1, "seed": args.seed}
    rows: list[dict] = []
    record_path: Path | None = None
    for source, spec in sources(args):
        for mode in args.modes:
            for row in measure_source(args, source, spec, mode):
                rows.append(row)
                print(" | ".join(f"{key} {value}" for key, value in row.items()), flush=True)
                record = make_record("bench_train_grid", settings, rows, args.device, args.argv)
                if record_path is not None:
                    record_path.unlink(missing_ok=True)  # the record grows with each row: one file per run
                record_path = write_record(args.record_dir, record)
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()  # the mode's model is gone: its memory goes back before the next one builds
    slower = [row for row in rows if row.get("verdict") == "slower"]
    unsettled = [row for row in rows if row.get("verdict") == "slower within spread"]
    print(
        f"\n{len(rows)} rows, {len(slower)} where auto trained more than {args.tolerance:.0%} slower than dense, "
        f"{len(unsettled)} more where it did by less than the steps' spread"
    )
    return rows


if __name__ == "__main__":
    main()
