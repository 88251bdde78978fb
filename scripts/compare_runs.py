"""Compare training runs side by side from their metrics.jsonl: loss parity and throughput (and quality).

    python scripts/compare_runs.py outputs/one_gpu outputs/ddp outputs/fsdp [--markdown BENCHMARKS.md --title ...]
    python scripts/compare_runs.py outputs/dense outputs/sparse --eval outputs/eval/<time>/results.json

The first run is the baseline: the table shows each run's final loss, the largest loss gap to the baseline
over the steps both logged, steady-state tokens/s (median over logging windows after the first, which holds
start-up; the median also ignores windows that include a checkpoint write) and its ratio to the baseline,
peak memory and energy per token. With --eval (an eval.py results.json that scored the runs' final/
checkpoints) a second table gives each run's held-out CE and its gap to the baseline, perplexity, L0,
sparsity, the share of neurons that never fired on the held-out text, the dead-neuron fraction of the last
training window, and the task accuracies.

Repeats of one configuration are named <configuration>_r<k> (outputs/ddp_r1, outputs/ddp_r2, ...). Where any
configuration has several, a third table gives each configuration's final loss as mean, standard deviation and
range, and the gap of its mean to the first configuration's with the standard error of that gap: identical GPU runs
do not end at identical losses, so a single run's gap says little until it is read against that spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
from pathlib import Path

from sparse_llm.telemetry.metrics import read_metrics


def summarize(run_dir: Path, baseline: dict[int, dict] | None) -> dict[str, float | str]:
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    if not records:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no records")
    steps = sorted(records)
    steady = [records[s] for s in steps[1:]] or [records[steps[0]]]

    def median(key: str) -> float:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else float("nan")

    gap = float("nan")
    if baseline is not None:
        common = [s for s in steps if s in baseline]
        gap = max((abs(records[s]["loss"] - baseline[s]["loss"]) for s in common), default=float("nan"))
    return {"run": run_dir.name, "steps": steps[-1], "final_loss": records[steps[-1]]["loss"], "max_gap": gap,
            "tokens_per_s": median("tokens_per_s"), "peak_mem_gb": median("peak_mem_gb"),
            "mj_per_token": median("mj_per_token"), "l0": records[steps[-1]].get("l0/mean", float("nan"))}


def _cell(value: float, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """value formatted with `spec`, or "-" where it was not measured (NaN: no GPU meter, no closed window)."""
    return "-" if math.isnan(value) else f"{value * scale:{spec}}{suffix}"


def table(run_dirs: list[Path]) -> str:
    base_records = {r["step"]: r for r in read_metrics(run_dirs[0] / "metrics.jsonl")}
    rows = [summarize(d, None if i == 0 else base_records) for i, d in enumerate(run_dirs)]
    base_tps = rows[0]["tokens_per_s"]
    lines = ["| run | steps | final loss | max loss gap vs first | tokens/s | speed vs first | peak GB/rank | "
             "mJ/token | mean L0 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["run"], str(r["steps"]), _cell(r["final_loss"], ".4f"), _cell(r["max_gap"], ".4f"),
                 _cell(r["tokens_per_s"], ",.0f"), _cell(r["tokens_per_s"] / base_tps, ".2f", suffix="x"),
                 _cell(r["peak_mem_gb"], ".1f"), _cell(r["mj_per_token"], ".2f"), _cell(r["l0"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def configuration(run_dir: Path) -> str:
    """The configuration a run repeats: its directory name without a trailing _r<k>."""
    return re.sub(r"_r\d+$", "", run_dir.name)


def spread_table(run_dirs: list[Path]) -> str | None:
    """Final loss per configuration over its repeats (see the module docstring); None where no configuration
    was repeated."""
    groups: dict[str, list[dict]] = {}
    for run_dir in run_dirs:
        groups.setdefault(configuration(run_dir), []).append(summarize(run_dir, None))
    if all(len(rows) == 1 for rows in groups.values()):
        return None

    def spread(rows: list[dict]) -> tuple[list[float], float, float]:
        finals = [r["final_loss"] for r in rows]
        return finals, statistics.mean(finals), statistics.stdev(finals) if len(finals) > 1 else float("nan")

    first = next(iter(groups.values()))
    base_finals, base_mean, base_sd = spread(first)
    base_tps = statistics.median(r["tokens_per_s"] for r in first)
    lines = ["| configuration | runs | final loss mean | sd | range | mean gap vs first | its standard error | "
             "tokens/s | speed vs first |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in groups.items():
        finals, mean, sd = spread(rows)
        gap = error = float("nan")
        if rows is not first:
            gap = mean - base_mean
            # NaN unless both configurations were repeated
            error = math.sqrt(base_sd**2 / len(base_finals) + sd**2 / len(finals))
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        cells = [name, str(len(finals)), f"{mean:.4f}", _cell(sd, ".4f"), f"{min(finals):.4f}-{max(finals):.4f}",
                 _cell(gap, "+.4f"), _cell(error, ".4f"), _cell(tps, ",.0f"), _cell(tps / base_tps, ".2f", suffix="x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _last(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return values[-1] if values else float("nan")


def quality_table(run_dirs: list[Path], eval_results: Path) -> str:
    """Held-out quality of each run's final checkpoint, read from an eval.py results.json."""
    models = {Path(m["checkpoint"]).resolve(): m for m in json.loads(eval_results.read_text())["models"]}
    rows = []
    for run_dir in run_dirs:
        model = models.get((run_dir / "final").resolve())
        if model is None:
            raise SystemExit(f"{eval_results} has no result for {run_dir / 'final'}; evaluate it with eval.py")
        rows.append((run_dir.name, model, _last(read_metrics(run_dir / "metrics.jsonl"), "dead/mean")))
    tasks = sorted({task for _, model, _ in rows for task in model.get("tasks", {})})
    base_ce = rows[0][1]["perplexity"]["ce"]
    header = ["run", "held-out CE", "CE vs first", "perplexity", "mean L0 / N", "sparsity", "never fired (held-out)",
              "dead (last training window)"] + [f"{t} acc" for t in tasks]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for name, model, dead in rows:
        ce, sparsity = model["perplexity"]["ce"], model["sparsity"]
        never = sum(layer["never_fired"] for layer in sparsity["layers"]) / len(sparsity["layers"])
        accs = [f"{model['tasks'][t]['acc']:.3f}" if t in model.get("tasks", {}) else "-" for t in tasks]
        cells = [name, f"{ce:.4f}", f"{100 * (ce / base_ce - 1):+.2f}%", f"{model['perplexity']['ppl']:.2f}",
                 f"{sparsity['l0_mean']:.1f} / {sparsity['neurons']}", f"{100 * sparsity['sparsity_mean']:.2f}%",
                 f"{100 * never:.1f}%", _cell(dead, ".1f", 100, "%")] + accs
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the baseline")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument("--title", default="Run comparison", help="section title in the markdown file")
    parser.add_argument("--note", default="", help="hardware and settings line under the title")
    parser.add_argument("--eval", type=Path, help="eval.py results.json that scored the runs' final/ checkpoints")
    args = parser.parse_args()
    text = table(args.runs)
    spread = spread_table(args.runs)
    if spread is not None:
        text += "\n\n" + spread
    if args.eval:
        text += "\n\n" + quality_table(args.runs, args.eval)
    print(text)
    if args.markdown:
        stamp = datetime.date.today().isoformat()
        with args.markdown.open("a") as f:
            f.write(f"\n## {args.title} ({stamp})\n\n{args.note}\n\n{text}\n")


if __name__ == "__main__":
    main()
