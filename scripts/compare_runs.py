"""Compare training runs side by side from their metrics.jsonl: loss parity and throughput.

    python scripts/compare_runs.py outputs/one_gpu outputs/ddp outputs/fsdp [--markdown BENCHMARKS.md --title ...]

The first run is the baseline: the table shows each run's final loss, the largest loss gap to the baseline
over the steps both logged, steady-state tokens/s (median over logging windows after the first, which holds
start-up; the median also ignores windows that include a checkpoint write) and its ratio to the baseline,
peak memory and energy per token.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

from sparse_llm.telemetry import read_metrics


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


def table(run_dirs: list[Path]) -> str:
    base_records = {r["step"]: r for r in read_metrics(run_dirs[0] / "metrics.jsonl")}
    rows = [summarize(d, None if i == 0 else base_records) for i, d in enumerate(run_dirs)]
    base_tps = rows[0]["tokens_per_s"]
    lines = ["| run | steps | final loss | max loss gap vs first | tokens/s | speed vs first | peak GB/rank | "
             "mJ/token | mean L0 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['steps']} | {r['final_loss']:.4f} | {r['max_gap']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base_tps:.2f}x | {r['peak_mem_gb']:.1f} | "
                     f"{r['mj_per_token']:.2f} | {r['l0']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the baseline")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument("--title", default="Run comparison", help="section title in the markdown file")
    parser.add_argument("--note", default="", help="hardware and settings line under the title")
    args = parser.parse_args()
    text = table(args.runs)
    print(text)
    if args.markdown:
        stamp = datetime.date.today().isoformat()
        with args.markdown.open("a") as f:
            f.write(f"\n## {args.title} ({stamp})\n\n{args.note}\n\n{text}\n")


if __name__ == "__main__":
    main()
