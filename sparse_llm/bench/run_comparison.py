"""Training runs side by side from their metrics.jsonl: loss parity and throughput, spread over repeats, and
held-out quality from eval.py's results (scripts/compare_runs.py).

The first run is the baseline. Repeats of one configuration are named <configuration>_r<k> (outputs/ddp_r1,
outputs/ddp_r2, ...); `spread_table` reads each configuration's final loss against that spread, since identical GPU
runs do not end at identical losses.
"""

from __future__ import annotations

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
    return {
        "run": run_dir.name,
        "steps": steps[-1],
        "final_loss": records[steps[-1]]["loss"],
        "max_gap": gap,
        "tokens_per_s": median("tokens_per_s"),
        "peak_mem_gb": median("peak_mem_gb"),
        "mj_per_token": median("mj_per_token"),
        "l0": records[steps[-1]].get("l0/mean", float("nan")),
    }


def _cell(value: float, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """value formatted with `spec`, or "-" where it was not measured (NaN: no GPU meter, no closed window)."""
    return "-" if math.isnan(value) else f"{value * scale:{spec}}{suffix}"


def summaries(run_dirs: list[Path]) -> list[dict[str, float | str]]:
    """`summarize` of each run, each against the first run's losses (the first's own gap is NaN)."""
    base_records = {r["step"]: r for r in read_metrics(run_dirs[0] / "metrics.jsonl")}
    return [summarize(d, None if i == 0 else base_records) for i, d in enumerate(run_dirs)]


def table(run_dirs: list[Path]) -> str:
    rows = summaries(run_dirs)
    base_tps = rows[0]["tokens_per_s"]
    lines = [
        "| run | steps | final loss | max loss gap vs first | tokens/s | speed vs first | peak GB/rank | "
        "mJ/token | mean L0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["run"],
            str(r["steps"]),
            _cell(r["final_loss"], ".4f"),
            _cell(r["max_gap"], ".4f"),
            _cell(r["tokens_per_s"], ",.0f"),
            _cell(r["tokens_per_s"] / base_tps, ".2f", suffix="x"),
            _cell(r["peak_mem_gb"], ".1f"),
            _cell(r["mj_per_token"], ".2f"),
            _cell(r["l0"], ".1f"),
        ]
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
    lines = [
        "| configuration | runs | final loss mean | sd | range | mean gap vs first | its standard error | "
        "tokens/s | speed vs first |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in groups.items():
        finals, mean, sd = spread(rows)
        gap = error = float("nan")
        if rows is not first:
            gap = mean - base_mean
            # NaN unless both configurations were repeated
            error = math.sqrt(base_sd**2 / len(base_finals) + sd**2 / len(finals))
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        cells = [
            name,
            str(len(finals)),
            f"{mean:.4f}",
            _cell(sd, ".4f"),
            f"{min(finals):.4f}-{max(finals):.4f}",
            _cell(gap, "+.4f"),
            _cell(error, ".4f"),
            _cell(tps, ",.0f"),
            _cell(tps / base_tps, ".2f", suffix="x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _last(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return values[-1] if values else float("nan")


def quality_rows(run_dirs: list[Path], eval_results: Path) -> list[dict]:
    """Held-out quality of each run's final checkpoint, read from an eval.py results.json: per run its CE and the
    CE's gap to the first run's, perplexity, L0, sparsity, the share of neurons never fired on the held-out text,
    the dead-neuron share of the last training window, and each task's accuracy."""
    models = {Path(m["checkpoint"]).resolve(): m for m in json.loads(eval_results.read_text())["models"]}
    rows = []
    for run_dir in run_dirs:
        model = models.get((run_dir / "final").resolve())
        if model is None:
            raise SystemExit(f"{eval_results} has no result for {run_dir / 'final'}; evaluate it with eval.py")
        sparsity = model["sparsity"]
        rows.append(
            {
                "run": run_dir.name,
                "ce": model["perplexity"]["ce"],
                "perplexity": model["perplexity"]["ppl"],
                "l0_mean": sparsity["l0_mean"],
                "neurons": sparsity["neurons"],
                "sparsity": sparsity["sparsity_mean"],
                "never_fired": sum(layer["never_fired"] for layer in sparsity["layers"]) / len(sparsity["layers"]),
                "dead": _last(read_metrics(run_dir / "metrics.jsonl"), "dead/mean"),
                **{f"{task}_acc": result["acc"] for task, result in model.get("tasks", {}).items()},
            }
        )
    base_ce = rows[0]["ce"]
    for row in rows:
        row["ce_vs_first"] = row["ce"] / base_ce - 1
    return rows


def quality_table(run_dirs: list[Path], eval_results: Path) -> str:
    """`quality_rows` as a markdown table."""
    rows = quality_rows(run_dirs, eval_results)
    tasks = sorted({key.removesuffix("_acc") for row in rows for key in row if key.endswith("_acc")})
    header = [
        "run",
        "held-out CE",
        "CE vs first",
        "perplexity",
        "mean L0 / N",
        "sparsity",
        "never fired (held-out)",
        "dead (last training window)",
    ] + [f"{t} acc" for t in tasks]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        accs = [f"{row[f'{t}_acc']:.3f}" if f"{t}_acc" in row else "-" for t in tasks]
        cells = [
            row["run"],
            f"{row['ce']:.4f}",
            f"{100 * row['ce_vs_first']:+.2f}%",
            f"{row['perplexity']:.2f}",
            f"{row['l0_mean']:.1f} / {row['neurons']}",
            f"{100 * row['sparsity']:.2f}%",
            f"{100 * row['never_fired']:.1f}%",
            _cell(row["dead"], ".1f", 100, "%"),
        ] + accs
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
