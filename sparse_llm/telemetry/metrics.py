"""Training telemetry: a metrics.jsonl file, Weights & Biases (offline by default), a console line and a
progress bar, all driven from the main process only.

``run_dir/metrics.jsonl`` is the source of truth: one JSON object per :meth:`Telemetry.log` call,
``{"step": <optimizer step>, **metrics}``, flushed on every write and opened in append mode so a resumed
run continues the same file. A resumed run first drops the lines past the step it resumes from (logged by the run
that went on after that checkpoint, or cut short by its crash; all of them for a run started over), so the file holds
each step once: one history.
W&B is a mirror of it; without ``wandb`` installed, or if W&B fails, training goes on with a warning.

Metric conventions the trainer follows (the console line relies on them):
    loss, ce, l1_term, l1_coeff, lr, grad_norm, tokens_per_s, step_time_s, mfu, peak_mem_gb,
    energy_j (joules over the logging window), mj_per_token, power_w,
    l0/mean (non-zeros of h per token), sparsity/mean and dead/mean (fractions in [0, 1]),
    per layer ``l0/layer_03``, ``l0_p99/layer_03``, ``l0_max/layer_03``, ``sparsity/layer_03``,
    ``dead/layer_03``, ``backend/layer_03`` (a string), ``l1_weight/layer_03`` (with sparsity.layer_balance),
    and val/ce, val/ppl.
String values go to the jsonl and to the W&B run summary (W&B charts only numbers).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Number
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
_WANDB_MODES = ("online", "offline", "disabled")

MetricValue = float | int | str


@dataclass
class LoggingConfig:
    """``logging.*`` config group.

    Attributes:
        every: log every N optimizer steps (and at the last step).
        wandb: mirror the metrics to Weights & Biases.
        wandb_project: W&B project name.
        wandb_mode: "offline", "online" or "disabled"; ``None`` honours ``$WANDB_MODE`` and otherwise
            means "offline". "online" without ``$WANDB_API_KEY`` falls back to "offline", because W&B
            would otherwise block for ~100 s on a machine without network.
        progress_bar: show a tqdm bar over optimizer steps.
        console: print one compact line per log call.
    """

    every: int = 10
    wandb: bool = True
    wandb_project: str = "sparse-llm"
    wandb_mode: str | None = None
    progress_bar: bool = True
    console: bool = True


def resolve_wandb_mode(configured: str | None) -> str:
    """The W&B mode: the configured one, else ``$WANDB_MODE``, else "offline"; never online without a key."""
    source = "logging.wandb_mode"
    mode = configured
    if mode is None:
        source, mode = "$WANDB_MODE", os.environ.get("WANDB_MODE") or "offline"
    if mode not in _WANDB_MODES:
        raise ValueError(f"{source}={mode!r} is not a W&B mode; use one of {', '.join(_WANDB_MODES)}")
    if mode == "online" and not os.environ.get("WANDB_API_KEY"):
        logger.warning("W&B mode 'online' but WANDB_API_KEY is not set: logging offline instead")
        mode = "offline"
    return mode


def _plain(key: str, value: Any) -> MetricValue | None:
    """A JSON-ready scalar: Python numbers and strings pass, 0-d tensors/arrays become numbers."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item"):  # one-element tensors, numpy scalars
        return value.item()
    if isinstance(value, Number):
        return float(value)
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log a number or a string")


def _fmt(spec: str) -> Callable[[Any], str]:
    return lambda v: spec.format(v)


def _percent(v: float) -> str:
    return f"{100.0 * v:.1f}%"


def _si(v: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.1f}{suffix}"
    return f"{v:.0f}"


# (metric key, console template, value formatter), in console order.
_CONSOLE_FIELDS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("loss", "loss {}", _fmt("{:.4f}")),
    ("ce", "ce {}", _fmt("{:.4f}")),
    ("l1_term", "l1 {}", _fmt("{:.4f}")),
    ("l0/mean", "L0 {}", _fmt("{:.1f}")),
    ("sparsity/mean", "sparsity {}", _percent),
    ("dead/mean", "dead {}", _percent),
    ("tokens_per_s", "{} tok/s", _si),
    ("lr", "lr {}", _fmt("{:.2e}")),
    ("energy_j", "{} J", _fmt("{:.1f}")),
    ("mj_per_token", "{} mJ/tok", _fmt("{:.3g}")),
    ("power_w", "{} W", _fmt("{:.0f}")),
    ("val/ce", "val ce {}", _fmt("{:.4f}")),
    ("val/ppl", "val ppl {}", _fmt("{:.2f}")),
    ("val/ce_dense_source", "dense source val ce {}", _fmt("{:.4f}")),
)


def _duration(seconds: float) -> str:
    """12s, 4m05s, 2h07m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_console_line(step: int, total_steps: int, metrics: dict[str, MetricValue | None]) -> str:
    """``step  120/1000 | loss 3.2101 | ... | sparsity 97.8% | 12.3k tok/s | eta 4m05s | ...`` (metrics present only;
    eta from the window's step time, validation passes not included)."""
    parts = [f"step {step:>{len(str(total_steps))}}/{total_steps}"]
    for key, template, fmt in _CONSOLE_FIELDS:
        value = metrics.get(key)
        if value is None:
            continue
        shown = fmt(value) if isinstance(value, Number) and not isinstance(value, bool) else str(value)
        parts.append(template.format(shown))
        step_time_s = metrics.get("step_time_s")
        if key == "tokens_per_s" and isinstance(step_time_s, Number) and step < total_steps:
            parts.append(f"eta {_duration((total_steps - step) * step_time_s)}")
    return " | ".join(parts)


class Telemetry:
    """Sink for the trainer's metrics: jsonl file, W&B, console line and progress bar.

    Args:
        cfg: the ``logging`` config.
        run_dir: the run's output directory (created if missing); holds ``metrics.jsonl`` and ``wandb/``.
        run_config: resolved run config (plain dict), stored as the W&B run config.
        is_main: only the main process logs; on other processes every method is a no-op and nothing
            is created on disk.
        total_steps: number of optimizer steps of the whole run (progress bar total).
        start_step: optimizer steps already done (non-zero when resuming), the bar's start position.
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        run_config: dict[str, Any],
        is_main: bool,
        total_steps: int,
        start_step: int = 0,
    ) -> None:
        if cfg.every < 1:
            raise ValueError(f"logging.every={cfg.every} must be >= 1 (log every N optimizer steps)")
        if total_steps < 0 or start_step < 0:
            raise ValueError(f"total_steps={total_steps}, start_step={start_step}: both must be >= 0")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self._file = None
        self._bar = None
        self._wandb_run: Any = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run (or one started over) continues the file from its own step: one history, each step once.
        drop_steps_after(self.run_dir / METRICS_FILE, start_step)
        self._file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        if cfg.wandb:
            self._wandb_run = self._start_wandb(run_config)
        # Created after W&B's ~1 s start so that the bar's rate is not skewed by it.
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not cfg.progress_bar,
        )

    def should_log(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based count of steps done) is a logging step."""
        return step % self.cfg.every == 0 or step == self.total_steps

    def _start_wandb(self, run_config: dict[str, Any]) -> Any:
        mode = resolve_wandb_mode(self.cfg.wandb_mode)
        if mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            logger.warning("logging.wandb=true but wandb is not installed (pip install wandb); going on without it")
            return None
        try:
            return wandb.init(
                project=self.cfg.wandb_project,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=run_config,
                mode=mode,
                # console="off": W&B's stdout capture would fight the progress bar.
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as exc:  # a tracker failure must not stop training
            logger.warning("W&B init failed (%s: %s); continuing without W&B", type(exc).__name__, exc)
            return None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` for optimizer step ``step`` in the jsonl file, W&B and the console."""
        if not self.is_main:
            return
        if self._file is None:
            raise RuntimeError("Telemetry.log called after close()")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass the step as the first argument")
        record = {"step": int(step), **{k: _plain(k, v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._log_wandb(record)
        if self.cfg.console:
            line = format_console_line(step, self.total_steps, record)
            tqdm.write(line)

    def _log_wandb(self, record: dict[str, MetricValue | None]) -> None:
        step = record["step"]
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, Number) and not isinstance(v, bool)}
        strings = {k: v for k, v in record.items() if isinstance(v, str)}
        try:
            if numbers:
                self._wandb_run.log(numbers, step=step)
            if strings:
                self._wandb_run.summary.update(strings)
        except Exception as exc:
            logger.warning("W&B logging failed (%s: %s); W&B is off for the rest of the run", type(exc).__name__, exc)
            self._finish_wandb()

    def advance(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        """Move the progress bar to ``step`` optimizer steps done, showing ``postfix`` (e.g. loss)."""
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def _finish_wandb(self) -> None:
        run, self._wandb_run = self._wandb_run, None
        if run is not None:
            try:
                run.finish()
            except Exception as exc:
                logger.warning("W&B finish failed (%s: %s)", type(exc).__name__, exc)

    def close(self) -> None:
        """Finish W&B, close the bar and the jsonl file. Safe to call twice."""
        self._finish_wandb()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def drop_steps_after(path: Path, step: int) -> None:
    """Rewrite metrics file `path` without its lines past optimizer step `step` and its lines that do not parse (a
    crash's cut-short last line); atomic, so a crash here leaves the old file."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= step
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            elif line.strip():
                dropped += 1
    if not dropped:
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept), encoding="utf-8")
    os.replace(temporary, path)
    logger.info("%s: dropped %d lines past step %d, the step this run resumes from", path, dropped, step)


def read_metrics(path: Path) -> list[dict[str, MetricValue | None]]:
    """Records of a metrics.jsonl file, one per step, sorted by step.

    Lines with the same step are merged, later lines winning key by key: a resumed run that repeats
    steps keeps its newest values, and a validation line logged at the same step as a training line
    joins it. A line cut short by a crash is skipped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory that holds {METRICS_FILE}")
    by_step: dict[int, dict[str, MetricValue | None]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON (cut short by a crash?); skipped", path, number)
                continue
            if "step" not in record:
                raise ValueError(f"{path}:{number} has no 'step' key; it is not a {METRICS_FILE} written by Telemetry")
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[step] for step in sorted(by_step)]
