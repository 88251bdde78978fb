"""train.py under FSDP2 on 2 CPU ranks (gloo): one process's losses, sharded checkpoints, and an exact resume.

The ranks run train.py through tests/helpers/fsdp_cpu_train.py, which gives their accelerators the shipped
configs/accelerate/fsdp.yaml settings (accelerate itself runs FSDP only on GPUs). Covered: accelerate's sharding of
this model (the fused decoder layers, which hand their FFN output on to the next unit, and the tied embeddings), the
trainer's AdamW on the sharded parameters, the gradient norm and clipping, the L1 term, and the sharded state dict.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import ROOT, SMALL, child_env, logged_losses, run_train_py

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH"),
]
EVERY_3 = "checkpoint.every=3"


def _fsdp_run(run_dir: Path, *overrides: str) -> list[float]:
    command = [
        shutil.which("torchrun") or sys.executable,
        "--nproc_per_node",
        "2",
        "tests/helpers/fsdp_cpu_train.py",
        *SMALL,
        EVERY_3,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    out = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return logged_losses(run_dir)


def test_fsdp_ranks_match_one_process_and_resume_from_sharded_checkpoints(tmp_path, one_process_run):
    fsdp = _fsdp_run(tmp_path / "fsdp", "trainer.max_steps=6")
    assert fsdp == pytest.approx(logged_losses(one_process_run), rel=1e-5)
    log = (tmp_path / "fsdp" / "train.log").read_text()
    assert "2 ranks" in log
    step_3 = tmp_path / "fsdp" / "checkpoints" / "step_3"
    shards = step_3 / "accelerator" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # A new run resumed from the step-3 checkpoint continues as the run that wrote it did.
    resumed = _fsdp_run(tmp_path / "resumed", "trainer.max_steps=6", f"checkpoint.resume={step_3}")
    assert resumed == pytest.approx(fsdp[-2:], rel=1e-5)


def test_fsdp_reinitialises_dead_neurons_as_one_process(tmp_path):
    """Dead-neuron reinit under FSDP2: every rank draws the noise of all the dead gate rows, as one process does, and
    mixes in the rows of its shard, so the run follows one process's. A steep L1 with a quick learning rate kills
    neurons in both ranks' shards within a few steps."""
    overrides = (
        "trainer.max_steps=8",
        "sparsity.reinit_dead=true",
        "l1=3",
        "trainer.lr=1e-2",
        "trainer.warmup_steps=1",
        "logging.every=1",
    )
    single = run_train_py(tmp_path / "single", 1, EVERY_3, *overrides)
    fsdp = _fsdp_run(tmp_path / "fsdp", *overrides)
    assert fsdp == pytest.approx(single, rel=1e-5)
    metrics = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["reinit_neurons"] for r in metrics) >= 256  # a whole layer's width or more: rows of both shards
