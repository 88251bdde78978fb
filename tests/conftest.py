"""Fixtures shared by the test files: tiny runs trained once per pytest run (helpers/runs.py makes them), in the
background while other tests run (helpers/background.py), and the entry-point server (helpers/entry_points.py). The
runs are read-only: a test that changes a run copies it to its tmp_path first."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from helpers.entry_points import ROOT, EntryPoints, child_env

# Started before this process imports torch and transformers below, so that the server imports them on the other
# core meanwhile (~13 s each); the `entry_points` fixture hands it out.
ENTRY_POINTS = EntryPoints(ROOT, child_env())
atexit.register(ENTRY_POINTS.close)
# The environment of the runs made in the background, taken before any test sets variables of its own.
BACKGROUND_ENV = child_env()

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import background  # noqa: E402
from helpers.runs import PARALLEL_REFERENCE, SMALL, TRAINED, train_py_command  # noqa: E402

# The tests' models are tiny: one intra-op thread runs them faster than several, which spin waiting for each other on
# a busy machine (10 steps of helpers.runs.SMALL in this process: 1.3 s of CPU with one thread, 13 s with two, on 2
# cores shared with other work), and their sums are then the same on any machine. helpers.runs.child_env sets the
# same for the processes the tests start.
torch.set_num_threads(1)


def _scratch(prefix: str) -> Path:
    """A folder for a run made in the background (where no tmp_path_factory is at hand)."""
    folder = Path(tempfile.mkdtemp(prefix=f"sparse_llm_test_{prefix}_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def background_work(request: pytest.FixtureRequest) -> None:
    """Start the offered work of the fixtures the collected tests use (helpers/background.py), in the order they are
    first used."""
    used = (item for item in request.session.items if not item.get_closest_marker("skip"))
    background.start(name for item in used for name in getattr(item, "fixturenames", ()))


@pytest.fixture
def both_cores() -> Iterator[None]:
    """For a test whose own processes keep both cores busy (a distributed run's ranks): no background job starts a
    process meanwhile (helpers/background.py)."""
    with background.paused():
        yield


@background.offer("trained_run")
def _train_trained_run() -> Path:
    # The trainer called as in this process (helpers/train_config.py), in a process forked from the entry-point
    # server: the ~10 s run goes on while the tests before the first that needs it run.
    run_dir = _scratch("runs") / "trained"
    command = ["tests/helpers/train_config.py", str(run_dir), *SMALL, *TRAINED]
    done = ENTRY_POINTS.run(command, BACKGROUND_ENV, run_dir.parent, nice=background.NICE)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def trained_run() -> Path:
    """The run directory of TRAINED (no step checkpoints): its metrics.jsonl, training.png and final/, for the tests
    of training, evaluation and finished runs."""
    return background.result("trained_run")


@pytest.fixture(scope="session")
def entry_points() -> EntryPoints:
    """train.py, eval.py, generate.py, scripts/ and the ranks of distributed runs run in forked children of one
    process that imported torch, transformers, hydra and lm-eval once: each run is a process of its own with its exit
    code and output, without seconds of start-up per run (tests/helpers/entry_points.py)."""
    return ENTRY_POINTS


@background.offer("one_process_run")
def _train_one_process_run() -> Path:
    # `python train.py ...` (the command after its interpreter), forked from the entry-point server.
    run_dir = _scratch("one_process") / "run"
    command = train_py_command(run_dir, 1, *PARALLEL_REFERENCE)[1:]
    done = ENTRY_POINTS.run(command, BACKGROUND_ENV, run_dir.parent, nice=background.NICE)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def one_process_run() -> Path:
    """The run directory of train.py in one process, SMALL with PARALLEL_REFERENCE: the losses, layer weights and
    re-initialised neurons the 2-rank DDP and FSDP runs of the same settings must reproduce."""
    return background.result("one_process_run")
