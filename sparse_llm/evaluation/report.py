"""The report of an evaluation: console table, results.json (atomic) and metrics.jsonl / W&B records."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sparse_llm.telemetry.metrics import LoggingConfig, Telemetry

RESULTS_FILE = "results.json"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _score(row: dict[str, Any], metric: str) -> str:
    """``0.2933 ± 0.0263 (n=300)`` for one task metric, ``-`` if the task lacks it."""
    if metric not in row:
        return "-"
    err = row.get(f"{metric}_stderr")
    return f"{row[metric]:.4f}" + (f" ± {err:.4f}" if isinstance(err, float) else "") + f" (n={row['n']})"


def table_rows(models: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(row name, one cell per model) for the console table."""
    rows: list[tuple[str, list[str]]] = [
        ("step", [str(m["step"]) if m["step"] is not None else "-" for m in models]),
        ("held-out perplexity", [_num(m["perplexity"]["ppl"], ".3f") for m in models]),
        ("held-out CE", [_num(m["perplexity"]["ce"], ".4f") for m in models]),
        ("L0 mean (non-zeros/token)", [f"{m['sparsity']['l0_mean']:.1f} / {m['sparsity']['neurons']}" for m in models]),
        ("sparsity mean", [f"{100 * m['sparsity']['sparsity_mean']:.2f}%" for m in models]),
    ]
    for layer in range(len(models[0]["sparsity"]["layers"])):
        rows.append(
            (
                f"  layer {layer} L0 / never fired / backend",
                [
                    "{l0_mean:.1f} / {fired:.1f}% / {backend}".format(fired=100 * x["never_fired"], **x)
                    for x in (m["sparsity"]["layers"][layer] for m in models)
                ],
            )
        )
    for task in models[0].get("tasks", {}):
        for metric in ("acc", "acc_norm"):
            cells = [_score(m["tasks"].get(task, {}), metric) for m in models]
            if any(c != "-" for c in cells):
                rows.append((f"{task} {metric}", cells))
    if "mean_acc" in models[0]:
        rows.append(("mean acc", [_num(m.get("mean_acc"), ".4f") for m in models]))
        rows.append(("mean acc_norm (acc if none)", [_num(m.get("mean_acc_norm"), ".4f") for m in models]))
    return rows


def format_table(models: list[dict[str, Any]]) -> str:
    """A plain-text table: one row per metric, one column per checkpoint."""
    header = ("metric", [m["label"] for m in models])
    rows = [header] + table_rows(models)
    widths = [max(len(r[0]) for r in rows)] + [max(len(r[1][i]) for r in rows) for i in range(len(models))]
    lines = [
        "  ".join([name.ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells, widths[1:], strict=False)])
        for name, cells in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_results(out_dir: Path, results: dict[str, Any]) -> Path:
    """Write ``results.json`` atomically (a temporary file renamed over it)."""
    path = out_dir / RESULTS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _flat_metrics(record: dict[str, Any], prefix: str) -> dict[str, float | str]:
    """The scalars of one checkpoint's record, for W&B / metrics.jsonl."""
    flat: dict[str, float | str] = {
        f"{prefix}/ppl": record["perplexity"]["ppl"],
        f"{prefix}/ce": record["perplexity"]["ce"],
        f"{prefix}/l0/mean": record["sparsity"]["l0_mean"],
        f"{prefix}/sparsity/mean": record["sparsity"]["sparsity_mean"],
    }
    for layer in record["sparsity"]["layers"]:
        tag = f"layer_{layer['layer']:02d}"
        flat.update(
            {
                f"{prefix}/l0/{tag}": layer["l0_mean"],
                f"{prefix}/sparsity/{tag}": layer["sparsity"],
                f"{prefix}/backend/{tag}": layer["backend"],
            }
        )
    for task, metrics in record.get("tasks", {}).items():
        flat.update({f"{prefix}/{task}/{k}": v for k, v in metrics.items() if k in ("acc", "acc_norm")})
    flat.update({f"{prefix}/{k}": record[k] for k in ("mean_acc", "mean_acc_norm") if k in record})
    return flat


def log_telemetry(logging_cfg: LoggingConfig, out_dir: Path, results: dict[str, Any]) -> None:
    """metrics.jsonl and W&B: one record at the first checkpoint's step, keys ``eval/*`` for it and
    ``compare/*`` (``compare_2/*``, ``compare_3/*``, ... for further ones) for the compared checkpoints."""
    quiet = LoggingConfig(**{**asdict(logging_cfg), "progress_bar": False, "console": False})
    step = results["models"][0]["step"] or 0
    metrics: dict[str, float | str] = {}
    for index, record in enumerate(results["models"]):
        prefix = "eval" if index == 0 else "compare" if index == 1 else f"compare_{index}"
        metrics.update(_flat_metrics(record, prefix))
    with Telemetry(quiet, out_dir, results["settings"], is_main=True, total_steps=step) as telemetry:
        telemetry.log(step, metrics)
