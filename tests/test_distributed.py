"""Two-process data-parallel training on CPU (gloo) through `accelerate launch`, as users launch it.

The same global batch split over 2 ranks must give the losses of a single process, only rank 0 may
log, a resumed 2-rank run must continue exactly, and a stop signal to one rank stops both at one checkpoint.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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


def _command(run_dir: Path, processes: int, *overrides: str) -> list[str]:
    launcher = ["python", "train.py"]
    if processes > 1:
        launcher = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"]
    launcher[0] = shutil.which(launcher[0]) or sys.executable
    return [*launcher, *SMALL, *overrides, f"hydra.run.dir={run_dir}"]


ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, name: str, processes: int, *overrides: str) -> list[float]:
    out = subprocess.run(_command(tmp_path / name, processes, *overrides), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(tmp_path / name)


def _rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} process under the launcher")


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


def test_two_ranks_weigh_the_layers_as_one_process_does(tmp_path):
    """sparsity.layer_balance moves the layers' L1 weights from the non-zeros of all ranks' tokens, so two ranks keep
    one process's weights and losses."""
    balance = ("trainer.max_steps=4", "sparsity.layer_balance=0.5")
    single = _run(tmp_path, "single", 1, *balance)
    ddp = _run(tmp_path, "ddp", 2, *balance)
    assert ddp == pytest.approx(single, rel=1e-5)
    last = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1]) for name in ("single", "ddp")]
    weights = [[record[f"l1_weight/layer_{layer:02d}"] for layer in (0, 1)] for record in last]
    assert weights[0] == pytest.approx(weights[1], rel=1e-5) and weights[0][0] != pytest.approx(1.0)


def test_a_signal_to_one_rank_stops_both_at_one_checkpoint(tmp_path):
    run_dir = tmp_path / "stopped"
    launcher = subprocess.Popen(_command(run_dir, 2, "trainer.max_steps=400", "checkpoint.every=0"), cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text()) and launcher.poll() is None:
            assert time.monotonic() < deadline, "the run logged no step in time"
            time.sleep(0.2)
        _rank_process(launcher, 1).send_signal(signal.SIGTERM)  # rank 0 gets nothing
        _, stderr = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    log = (run_dir / "train.log").read_text()
    assert "Stopped by a stop signal on another rank after step" in log, stderr[-3000:]
    step = int(log.split("on another rank after step ")[1].split(";")[0])
    assert 2 <= step < 400
    checkpoint = run_dir / "checkpoints" / f"step_{step}"
    assert checkpoint.is_dir() and not (run_dir / "final").exists()
    # Both ranks wrote their part of it (sparsity statistics, RNG states), and the run continues from it.
    assert sorted(p.name for p in checkpoint.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    assert len(list(checkpoint.glob("accelerator/random_states_*.pkl"))) == 2
    losses = _run(tmp_path, "stopped", 2, f"trainer.max_steps={step + 2}", "checkpoint.every=0",
                  "checkpoint.resume=auto")
    assert len(losses) > 0 and (run_dir / "final").is_dir()


def test_distributed_step_check_passes_where_ranks_agree():
    launcher = [shutil.which("accelerate") or sys.executable, "launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--dynamo_backend", "no", "scripts/dist_step_check.py",
                "--mixed-precision", "no", "--tol", "1e-4"]
    out = subprocess.run(launcher, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MULTI_CPU x 2" in out.stdout and "worst over 38 parameters" in out.stdout
