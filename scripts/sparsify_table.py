"""The table of scripts/sparsify_experiment.sh: its three runs side by side, printed and written as a benchmark record.

    python scripts/sparsify_table.py --prefix spx --n 400 --m 200 --l1 1e-3 --model 91m --data "data=tokens ..."

Reads outputs/<prefix>_{dense,sparsified,scratch}/metrics.jsonl (train.py) and outputs/<prefix>_eval/results.json
(eval.py of the two sparse models). Rows: train.py's last validation CE (the same validation batches in every run),
eval.py's held-out CE, sparsity, mean and largest L0 per token, the last training window's dead fraction, the share of
neurons that never fired on the held-out tokens, and the mean task accuracy; the sparsified row also holds the
validation CE of the dense source and of the model right after the ReLU swap (its step 0). eval.py scores ReLU models
only, so the dense row has train.py's numbers alone.

The record's hardware is the GPU the runs ran on, as eval.py wrote it, not the machine that draws the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparse_llm.bench.arguments import add_record_dir
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.report import results_table
from sparse_llm.telemetry.metrics import read_metrics


def last(records: Sequence[Mapping[str, Any]], key: str) -> Any:
    """The newest value of `key` in a run's metrics, None where it was never logged."""
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run_row(name: str, steps: str, metrics: Sequence[Mapping[str, Any]], scored: Mapping[str, Any] | None) -> dict:
    """One run's row; `scored` is its entry of eval.py's results (None for the dense run)."""
    layers = scored["sparsity"]["layers"] if scored else None
    return {
        "run": name,
        "steps": steps,
        "val CE (train.py)": rounded(last(metrics, "val/ce"), 4),
        "held-out CE (eval.py)": rounded(scored["perplexity"]["ce"], 4) if scored else None,
        "sparsity": rounded(scored["sparsity"]["sparsity_mean"], 4) if scored else None,
        "L0 mean": rounded(scored["sparsity"]["l0_mean"], 1) if scored else None,
        "L0 max": max(layer["l0_max"] for layer in layers) if layers else None,
        "dead (last window)": rounded(last(metrics, "dead/mean"), 4),
        "never fired": rounded(sum(layer["never_fired"] for layer in layers) / len(layers), 4) if layers else None,
        "mean acc": rounded(scored.get("mean_acc"), 3) if scored else None,
    }


def eval_hardware(results: Mapping[str, Any]) -> dict[str, Any]:
    """The hardware block of the machine eval.py ran on, from its results.json."""
    gpu = results["settings"].get("device_name")
    torch_version = results["software"].get("torch")
    return {"summary": f"{gpu}, torch {torch_version}", "gpu": gpu, "torch": torch_version}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default="spx", help="the runs' name prefix (PREFIX of sparsify_experiment.sh)")
    parser.add_argument("--n", type=int, required=True, help="steps of the dense run")
    parser.add_argument("--m", type=int, required=True, help="steps of the sparsified run")
    parser.add_argument("--l1", type=float, required=True, help="the sparse runs' L1 coefficient")
    parser.add_argument("--model", required=True, help="the model= of the runs")
    parser.add_argument("--data", required=True, help="the data overrides of the runs")
    parser.add_argument("--outputs", default="outputs", help="where the runs are (default outputs)")
    add_record_dir(parser)
    args = parser.parse_args(argv)
    outputs, prefix = Path(args.outputs), args.prefix
    results_path = outputs / f"{prefix}_eval" / "results.json"
    if not results_path.is_file():
        parser.error(f"{results_path}: no eval.py results; run scripts/sparsify_experiment.sh to the end first")
    results = json.loads(results_path.read_text())
    scored = {Path(model["checkpoint"]).parent.name: model for model in results["models"]}
    runs = {"dense": str(args.n), "sparsified": f"{args.n} + {args.m}", "scratch": str(args.n + args.m)}
    metrics = {run: read_metrics(outputs / f"{prefix}_{run}" / "metrics.jsonl") for run in runs}
    rows = [run_row(run, steps, metrics[run], scored.get(f"{prefix}_{run}")) for run, steps in runs.items()]
    start = metrics["sparsified"][0]
    rows[1]["step 0 val CE: dense source / after ReLU swap"] = (
        f"{start.get('val/ce_dense_source', float('nan')):.4f} / {start.get('val/ce', float('nan')):.4f}"
    )
    print("\n".join(results_table(rows)[0]))
    settings = {"model": args.model, "data": args.data, "n": args.n, "m": args.m, "l1": args.l1}
    record = make_record("sparsify_table", settings, rows, "cpu", argv)
    record["hardware"] = eval_hardware(results)
    write_record(args.record_dir, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
