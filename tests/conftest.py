"""Fixtures shared by the test files: tiny runs trained once per session (helpers/runs.py makes them). They are
read-only: a test that changes a run copies it to its tmp_path first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.entry_points import EntryPoints
from helpers.runs import PARALLEL_REFERENCE, ROOT, TRAINED, child_env, run_train_py, small_config

from sparse_llm.training.trainer import train

# The tests' models are tiny: one intra-op thread runs them faster than several, which spin waiting for each other on
# a busy machine (10 steps of helpers.runs.SMALL in this process: 1.3 s of CPU with one thread, 13 s with two, on 2
# cores shared with other work), and their sums are then the same on any machine. helpers.runs.child_env sets the
# same for the processes the tests start.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of TRAINED (no step checkpoints): its metrics.jsonl, training.png and final/, for the tests
    of training, evaluation and finished runs."""
    run_dir = tmp_path_factory.mktemp("runs") / "trained"
    train(small_config(*TRAINED), run_dir)
    return run_dir


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of train.py in one process, SMALL with PARALLEL_REFERENCE: the losses, layer weights and
    re-initialised neurons the 2-rank DDP and FSDP runs of the same settings must reproduce."""
    run_dir = tmp_path_factory.mktemp("one_process") / "run"
    run_train_py(run_dir, 1, *PARALLEL_REFERENCE)
    return run_dir


@pytest.fixture(scope="session")
def entry_points() -> EntryPoints:
    """train.py, eval.py, generate.py and scripts/ run in forked children of one process that imported torch,
    transformers, hydra and lm-eval once: each run is a process of its own with its exit code and output, without
    seconds of start-up per run (tests/helpers/entry_points.py)."""
    with EntryPoints(ROOT, child_env()) as server:
        yield server
