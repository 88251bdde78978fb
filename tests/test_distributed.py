"""Two-process data-parallel training on CPU (gloo) through `accelerate launch`, as users launch it.

The same global batch split over 2 ranks must give the losses of a single process, only rank 0 may
log, and a resumed 2-rank run must continue exactly.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.hidden_size=64", "model.intermediate_size=256", "model.num_layers=2", "model.num_heads=2",
    "model.max_position_embeddings=64", "trainer.micro_batch=4", "trainer.global_batch=8",
    "trainer.warmup_steps=5", "trainer.val_every=0", "logging.wandb=false", "logging.progress_bar=false",
    "logging.every=2", "l1=1e-3", "checkpoint.every=3",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not on PATH"),
]


def _run(tmp_path: Path, name: str, processes: int, *overrides: str) -> list[float]:
    launcher = ["python", "train.py"]
    if processes > 1:
        launcher = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"]
    launcher[0] = shutil.which(launcher[0]) or sys.executable
    run_dir = tmp_path / name
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([*launcher, *SMALL, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_match_one_process_and_resume(tmp_path):
    single = _run(tmp_path, "single", 1, "trainer.max_steps=6")
    ddp = _run(tmp_path, "ddp", 2, "trainer.max_steps=6")
    assert len(ddp) == 3  # one line per logging step: rank 1 wrote nothing
    assert ddp == pytest.approx(single, rel=1e-5)
    log = (tmp_path / "ddp" / "train.log").read_text()
    assert "2 ranks" in log

    _run(tmp_path, "cut", 2, "trainer.max_steps=3")
    resumed = _run(tmp_path, "cut", 2, "trainer.max_steps=6", "checkpoint.resume=auto")
    assert resumed[-2:] == pytest.approx(ddp[-2:], rel=1e-5)
