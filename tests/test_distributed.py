"""Two-process data-parallel training on CPU (gloo) through `accelerate launch`, as users launch it.

The same global batch split over 2 ranks must give the losses of a single process, only rank 0 may
log, a resumed 2-rank run must continue exactly, and a stop signal to one rank stops both at one checkpoint.
The run that is stopped has ranks of their own, as users' runs do; the others' ranks are forked from the entry-point
server (tests/helpers/entry_points.py), which saves each launch the ranks' ~10 s of imports.
"""

import shutil
import signal
import subprocess
import time

import psutil
import pytest
from helpers.runs import (
    ACCELERATE_LAUNCH,
    FORKED_RANK,
    PARALLEL_REFERENCE,
    ROOT,
    child_env,
    logged_losses,
    rank_reduced_statistics,
    run_train_py,
    train_py_command,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not on PATH"),
]


def _rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("LOCAL_RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} process under the launcher")


def test_two_ranks_match_one_process_and_resume(tmp_path, one_process_run, entry_points, both_cores):
    """The same global batch over 2 ranks gives one process's losses, and its rank-reduced statistics: the layers'
    L1 weights (layer_balance, from all ranks' non-zeros) and the dead neurons re-initialised."""
    ddp = run_train_py(tmp_path / "ddp", 2, *PARALLEL_REFERENCE, entry_points=entry_points)
    assert len(ddp) == 3  # one line per logging step: rank 1 wrote nothing
    assert ddp == pytest.approx(logged_losses(one_process_run), rel=1e-5)
    (weights, reinit), (reference_weights, reference_reinit) = map(
        rank_reduced_statistics, (tmp_path / "ddp", one_process_run)
    )
    assert weights == pytest.approx(reference_weights, rel=1e-5) and weights[0] != pytest.approx(1.0)
    assert reinit == reference_reinit > 0
    log = (tmp_path / "ddp" / "train.log").read_text()
    assert "2 ranks" in log

    # A new run resumed from the step-3 checkpoint continues as the run that wrote it did.
    step_3 = tmp_path / "ddp" / "checkpoints" / "step_3"
    resumed = run_train_py(
        tmp_path / "resumed", 2, *PARALLEL_REFERENCE, f"checkpoint.resume={step_3}", entry_points=entry_points
    )
    assert resumed == pytest.approx(ddp[-2:], rel=1e-5)


def test_a_signal_to_one_rank_stops_both_at_one_checkpoint(tmp_path, entry_points, both_cores):
    run_dir = tmp_path / "stopped"
    launcher = subprocess.Popen(
        train_py_command(run_dir, 2, "trainer.max_steps=400", "checkpoint.every=0"),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    resume = (f"trainer.max_steps={step + 2}", "checkpoint.every=0", "checkpoint.resume=auto")
    losses = run_train_py(run_dir, 2, *resume, entry_points=entry_points)
    assert len(losses) > 0 and (run_dir / "final").is_dir()


def test_distributed_step_check_passes_where_ranks_agree(entry_points, both_cores):
    launcher = [
        *ACCELERATE_LAUNCH,
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--dynamo_backend",
        "no",
        "--no_python",
        *FORKED_RANK,
        "scripts/dist_step_check.py",
        "--mixed-precision",
        "no",
        "--tol",
        "1e-4",
    ]
    out = entry_points.launch(launcher)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MULTI_CPU x 2" in out.stdout and "worst over 38 parameters" in out.stdout
