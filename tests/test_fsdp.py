"""train.py under FSDP2 on 2 CPU ranks (gloo): one process's losses, sharded checkpoints, and an exact resume.

The ranks run train.py through tests/fsdp_cpu_train.py, which gives their accelerators the shipped
configs/accelerate/fsdp.yaml settings (accelerate itself runs FSDP only on GPUs). Covered: accelerate's sharding of
this model (the fused decoder layers, which hand their FFN output on to the next unit, and the tied embeddings), the
trainer's AdamW on the sharded parameters, the gradient norm and clipping, the L1 term, and the sharded state dict.
"""

import json
import shutil
import subprocess
import sys

import pytest
from test_distributed import ENV, ROOT, SMALL, _losses, _run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH"),
]


def _fsdp_run(tmp_path, name: str, *overrides: str) -> list[float]:
    command = [shutil.which("torchrun") or sys.executable, "--nproc_per_node", "2", "tests/fsdp_cpu_train.py",
               *SMALL, *overrides, f"hydra.run.dir={tmp_path / name}"]
    out = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(tmp_path / name)


def test_fsdp_ranks_match_one_process_and_resume_from_sharded_checkpoints(tmp_path):
    single = _run(tmp_path, "single", 1, "trainer.max_steps=6")
    fsdp = _fsdp_run(tmp_path, "fsdp", "trainer.max_steps=6")
    assert fsdp == pytest.approx(single, rel=1e-5)
    log = (tmp_path / "fsdp" / "train.log").read_text()
    assert "2 ranks" in log
    shards = tmp_path / "fsdp" / "checkpoints" / "step_3" / "accelerator" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    _fsdp_run(tmp_path, "cut", "trainer.max_steps=3")
    resumed = _fsdp_run(tmp_path, "cut", "trainer.max_steps=6", "checkpoint.resume=auto")
    assert resumed[-2:] == pytest.approx(fsdp[-2:], rel=1e-5)


def test_fsdp_reinitialises_dead_neurons_as_one_process(tmp_path):
    """Dead-neuron reinit under FSDP2: every rank draws the noise of all the dead gate rows, as one process does, and
    mixes in the rows of its shard, so the run follows one process's. A steep L1 with a quick learning rate kills
    neurons in both ranks' shards within a few steps."""
    overrides = ("trainer.max_steps=8", "sparsity.reinit_dead=true", "l1=3", "trainer.lr=1e-2",
                 "trainer.warmup_steps=1", "logging.every=1")
    single = _run(tmp_path, "single", 1, *overrides)
    fsdp = _fsdp_run(tmp_path, "fsdp", *overrides)
    assert fsdp == pytest.approx(single, rel=1e-5)
    metrics = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["reinit_neurons"] for r in metrics) >= 256  # a whole layer's width or more: rows of both shards
