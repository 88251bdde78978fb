"""train.py under FSDP2 on 2 CPU ranks (gloo): one process's losses, sharded checkpoints, and an exact resume.

The ranks run train.py through tests/helpers/fsdp_cpu_train.py, which gives their accelerators the shipped
configs/accelerate/fsdp.yaml settings (accelerate itself runs FSDP only on GPUs). Covered: accelerate's sharding of
this model (the fused decoder layers, which hand their FFN output on to the next unit, and the tied embeddings), the
trainer's AdamW on the sharded parameters, the gradient norm and clipping, the L1 term with the layers' balance, the
re-initialisation of dead neurons across shards, and the sharded state dict.
"""

import shutil
import sys
from pathlib import Path

import pytest
from helpers.entry_points import FORKED_RANK, EntryPoints
from helpers.runs import PARALLEL_REFERENCE, SMALL, logged_losses, rank_reduced_statistics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH"),
]


def _fsdp_run(entry_points: EntryPoints, run_dir: Path, *overrides: str) -> list[float]:
    """The ranks are forked from the entry-point server (tests/helpers/entry_points.py): no ~10 s of imports each."""
    command = [
        shutil.which("torchrun") or sys.executable,
        "--nproc_per_node",
        "2",
        "--no-python",
        *FORKED_RANK,
        "tests/helpers/fsdp_cpu_train.py",
        *SMALL,
        *PARALLEL_REFERENCE,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    out = entry_points.launch(command)
    assert out.returncode == 0, out.stderr[-3000:]
    return logged_losses(run_dir)


def test_fsdp_ranks_match_one_process_and_resume_from_sharded_checkpoints(
    tmp_path, one_process_run, entry_points, both_cores
):
    fsdp = _fsdp_run(entry_points, tmp_path / "fsdp")
    assert fsdp == pytest.approx(logged_losses(one_process_run), rel=1e-5)
    (weights, reinit), (reference_weights, reference_reinit) = map(
        rank_reduced_statistics, (tmp_path / "fsdp", one_process_run)
    )
    assert weights == pytest.approx(reference_weights, rel=1e-5) and weights[0] != pytest.approx(1.0)
    # Every rank draws the noise of all the dead gate rows and mixes in those of its shard, as one process does: a
    # layer's width or more re-initialised takes rows of both shards.
    assert reinit == reference_reinit >= 256
    log = (tmp_path / "fsdp" / "train.log").read_text()
    assert "2 ranks" in log
    step_3 = tmp_path / "fsdp" / "checkpoints" / "step_3"
    shards = step_3 / "accelerator" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # A new run resumed from the step-3 checkpoint continues as the run that wrote it did.
    resumed = _fsdp_run(entry_points, tmp_path / "resumed", f"checkpoint.resume={step_3}")
    assert resumed == pytest.approx(fsdp[-2:], rel=1e-5)
