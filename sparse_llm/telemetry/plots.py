"""Training curves of a run: ``python -m sparse_llm.telemetry.plots <run_dir>`` writes ``<run_dir>/training.png``.

Top panel: loss and cross-entropy (and validation CE when logged) against the optimizer step.
Bottom panel: per-layer mean L0 (non-zeros of the FFN activation h per token) as a layers x steps heat
map, or the model-mean L0 line when no per-layer values were logged.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sparse_llm.telemetry.metrics import METRICS_FILE, read_metrics

PLOT_FILE = "training.png"
_LAYER_L0 = re.compile(r"^l0/layer_(\d+)$")


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that hold a number under ``key``."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    steps, values = zip(*pairs, strict=False) if pairs else ((), ())
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def _layer_l0_grid(records: list[dict[str, Any]]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Per-layer L0 as ``layers``, ``steps_S`` [S] and ``l0_LS`` [L, S] (NaN where a layer was not logged).

    Only steps where at least one layer was logged are kept (validation-only lines carry no L0).
    """
    key_of = {int(m.group(1)): k for r in records for k in r if (m := _LAYER_L0.match(k))}
    layers = sorted(key_of)
    l0_LS_cols, steps = [], []
    for record in records:
        column = [record.get(key_of[layer]) for layer in layers]
        column = [v if isinstance(v, (int, float)) else np.nan for v in column]
        if not all(np.isnan(column)):
            l0_LS_cols.append(column)
            steps.append(record["step"])
    l0_LS = np.asarray(l0_LS_cols, dtype=float).T.reshape(len(layers), len(steps))
    return layers, np.asarray(steps, dtype=float), l0_LS


def _edges(centres: np.ndarray) -> np.ndarray:
    """Cell edges around sorted cell centres (midpoints; half-width 0.5 for a single cell)."""
    if len(centres) == 1:
        return np.array([centres[0] - 0.5, centres[0] + 0.5])
    mid = (centres[1:] + centres[:-1]) / 2
    return np.concatenate([[2 * centres[0] - mid[0]], mid, [2 * centres[-1] - mid[-1]]])


def _line_style(n_points: int) -> dict[str, Any]:
    # Markers keep a run with only a few log lines visible (a single point draws no line).
    return {"marker": "o", "markersize": 3} if n_points < 30 else {}


class NothingToPlot(ValueError):
    """The run's metrics file holds no step (e.g. trainer.max_steps=0)."""


def plot_run(run_dir: Path) -> Path:
    """Plot ``run_dir/metrics.jsonl`` into ``run_dir/training.png`` and return the PNG's path; NothingToPlot when the
    file holds no step."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plot_run needs matplotlib: pip install 'sparse-llm[plot]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    if not records:
        raise NothingToPlot(f"{run_dir / METRICS_FILE} holds no records; nothing to plot")

    fig, (ax_loss, ax_l0) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    fig.suptitle(f"run {run_dir.resolve().name}")

    for key, label in (("loss", "loss (CE + L1 term)"), ("ce", "train CE"), ("val/ce", "val CE")):
        steps, values = _series(records, key)
        if len(steps):
            ax_loss.plot(steps, values, label=label, **_line_style(len(steps)))
    ax_loss.set_title("Loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("nats / token")
    ax_loss.grid(alpha=0.3)
    if ax_loss.has_data():
        ax_loss.legend()

    layers, steps_S, l0_LS = _layer_l0_grid(records)
    ax_l0.set_xlabel("optimizer step")
    if layers:
        vmax = max(float(np.nanmax(l0_LS)), 1.0)
        # symlog: logarithmic above 1 non-zero per token, linear down to 0, so fully sparse cells still show.
        mesh = ax_l0.pcolormesh(
            _edges(steps_S),
            _edges(np.arange(len(layers), dtype=float)),
            np.ma.masked_invalid(l0_LS),
            norm=SymLogNorm(linthresh=1.0, vmin=0.0, vmax=vmax),
            cmap="viridis",
            shading="flat",
        )
        ticks = range(0, len(layers), max(1, len(layers) // 16))
        ax_l0.set_yticks(ticks, [str(layers[i]) for i in ticks])
        ax_l0.set_ylabel("layer")
        ax_l0.set_title("Per-layer mean L0 (non-zeros per token)")
        fig.colorbar(mesh, ax=ax_l0, label="mean L0 (symlog scale)")
    else:
        steps, values = _series(records, "l0/mean")
        if len(steps):
            ax_l0.plot(steps, values, label="mean over layers", **_line_style(len(steps)))
            ax_l0.set_yscale("symlog", linthresh=1.0)
            ax_l0.legend()
        else:
            ax_l0.text(0.5, 0.5, "no L0 logged", ha="center", va="center", transform=ax_l0.transAxes)
        ax_l0.set_ylabel("mean L0 (non-zeros per token)")
        ax_l0.set_title("Mean L0 (no per-layer values logged)")
        ax_l0.grid(alpha=0.3)

    out = run_dir / PLOT_FILE
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparse_llm.telemetry.plots", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help=f"run directory holding {METRICS_FILE}")
    args = parser.parse_args(argv)
    if not (args.run_dir / METRICS_FILE).is_file():
        parser.error(f"{args.run_dir / METRICS_FILE} not found; pass a run directory written by train.py")
    print(plot_run(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
