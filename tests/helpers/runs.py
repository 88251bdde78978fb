"""Tiny training runs for the tests: the overrides that make one take seconds on two CPU cores, the config they
compose to, and train.py launched as users launch it (one process, or ranks through `accelerate launch`, which may
be forked from the entry-point server: helpers/entry_points.py)."""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers.entry_points import FORKED_RANK, ROOT, EntryPoints, child_env
from sparse_llm.telemetry.metrics import read_metrics
from sparse_llm.training.config import TrainConfig, register_configs

register_configs()

# The embedded corpus tokenized once for every run of one pytest call, in this process or another (data.cache_dir):
# about a second of CPU a run otherwise.
TOKEN_CACHE = Path(tempfile.mkdtemp(prefix="sparse_llm_test_tokens_"))
atexit.register(shutil.rmtree, TOKEN_CACHE, ignore_errors=True)

# The tests' model: two layers of width 64, small enough for a few seconds per run on two cores.
TINY_MODEL = [
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.max_position_embeddings=64",
]
SMALL = [
    *TINY_MODEL,
    "trainer.micro_batch=4",
    "trainer.global_batch=8",
    "trainer.warmup_steps=5",
    "trainer.val_every=0",
    "logging.wandb=false",
    "logging.progress_bar=false",
    "logging.every=2",
    "l1=1e-3",
    f"data.cache_dir={TOKEN_CACHE}",
]

# A run that learns something in 40 steps (`trained_run` of tests/conftest.py, trained once per test run).
TRAINED = (
    "model.max_position_embeddings=128",
    "trainer.max_steps=40",
    "trainer.micro_batch=8",
    "trainer.lr=5e-3",
    "checkpoint.every=0",
    "logging.console=false",
)


# The one-process run that the 2-rank DDP and FSDP runs must reproduce (tests/conftest.py, one_process_run): 6 steps
# with a checkpoint every 3, and every statistic that is reduced over ranks at work: the layers' L1 weights move with
# the non-zeros of all ranks' tokens (layer_balance), and a steep L1 term with a quick learning rate kills neurons
# within a few steps, whose gate rows the ranks re-initialise alike (reinit_dead).
PARALLEL_REFERENCE = (
    "trainer.max_steps=6",
    "checkpoint.every=3",
    "sparsity.layer_balance=0.5",
    "sparsity.reinit_dead=true",
    "l1=3",
    "trainer.lr=1e-2",
    "trainer.warmup_steps=1",
)


def small_config(*overrides: str) -> TrainConfig:
    """train.yaml with SMALL and then `overrides` applied, as train.py would compose it."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=SMALL + list(overrides))
    return OmegaConf.to_object(cfg)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss of a run's metrics.jsonl, a resumed attempt's lines replacing the ones before."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def rank_reduced_statistics(run_dir: Path) -> tuple[list[float], int]:
    """The layers' L1 weights at a run's last logged step, and the neurons it re-initialised over its logged steps:
    what PARALLEL_REFERENCE's ranks must agree on."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = [value for key, value in sorted(records[-1].items()) if key.startswith("l1_weight/")]
    return weights, sum(r.get("reinit_neurons", 0) for r in records)


def logged_losses(run_dir: Path) -> list[float]:
    """Every loss line of a run's metrics.jsonl in the order written (a rank that logs writes lines of its own)."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# `accelerate launch` without the CLI's other commands, whose imports (transformers, ~7 s) it would wait for first.
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def accelerate_launch(processes: int, forked: bool) -> list[str]:
    """`accelerate launch` of `processes` CPU ranks, up to the script. `forked`: the script runs in ranks forked from
    the entry-point server (tests/helpers/entry_points.py), which needs its `rank_env`."""
    launcher = [
        *ACCELERATE_LAUNCH,
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    return [*launcher, "--no_python", *FORKED_RANK] if forked else launcher


def train_py_command(run_dir: Path, processes: int, *overrides: str, forked: bool = False) -> list[str]:
    """train.py with SMALL, `overrides` and `run_dir`: in one process, or `processes` CPU ranks under accelerate
    (`forked`: see `accelerate_launch`)."""
    launcher = [shutil.which("python") or sys.executable]
    if processes > 1:
        launcher = accelerate_launch(processes, forked)
    return [*launcher, "train.py", *SMALL, *overrides, f"hydra.run.dir={run_dir}"]


def run_train_py(
    run_dir: Path, processes: int, *overrides: str, entry_points: EntryPoints | None = None
) -> list[float]:
    """Run `train_py_command` to the end; the losses it logged. With `entry_points`, the ranks (`processes` > 1) are
    forked from its server instead of starting fresh interpreters."""
    forked = entry_points is not None and processes > 1
    command = train_py_command(run_dir, processes, *overrides, forked=forked)
    if forked:
        out = entry_points.launch(command)
    else:
        out = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return logged_losses(run_dir)
