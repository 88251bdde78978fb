"""Checkpoint integrity: manifests, resume=auto over damaged checkpoints, failed writes on a real full disk, and one
metrics history after a resume."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from test_bad_inputs import SMALL
from test_train import small_config

from sparse_llm.checks.errors import UserInputError, exit_on_input_error
from sparse_llm.telemetry.metrics import drop_steps_after, read_metrics
from sparse_llm.training import checkpoint, manifest
from sparse_llm.training.checkpoint import CheckpointWriteError, list_checkpoints, resolve_resume
from sparse_llm.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def fake_checkpoint(run: Path, step: int, with_manifest: bool = True) -> Path:
    """A step checkpoint as resume=auto sees it: trainer_state.json, a weights-sized file, and its manifest."""
    path = checkpoint.checkpoint_dir(run, step)
    (path / "accelerator").mkdir(parents=True)
    (path / "accelerator" / "weights.dat").write_bytes(os.urandom(3 << 20))
    (path / checkpoint.STATE_FILE).write_text(json.dumps({"step": step, "loaders": [], "world_size": 1}))
    if with_manifest:
        manifest.write_manifest(path)
    return path


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------------------------------
# The manifest


def test_the_manifest_lists_every_file_and_names_each_kind_of_damage(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    listed = json.loads((path / manifest.MANIFEST_FILE).read_text())["files"]
    assert sorted(listed) == ["accelerator/weights.dat", "trainer_state.json"]
    assert listed["accelerator/weights.dat"]["bytes"] == 3 << 20
    manifest.verify(path, "fix it")
    weights = path / "accelerator" / "weights.dat"
    flip_one_byte(weights)  # same size: only the checksum sees it
    with pytest.raises(UserInputError, match=r"weights.dat: has changed since it was written .*\. fix it$"):
        manifest.verify(path, "fix it")
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserInputError, match=r"weights.dat: holds 1000 bytes where manifest.json lists 3145728"):
        manifest.verify(path, "fix it")
    weights.unlink()
    with pytest.raises(UserInputError, match="weights.dat: is missing"):
        manifest.verify(path, "fix it")


def test_a_model_dir_inside_a_step_checkpoint_is_verified_by_the_checkpoints_manifest(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    assert manifest.model_dir_root(path / "accelerator") == (path / "accelerator", "")
    (path / "model").mkdir()
    (path / "model" / "config.json").write_text("{}")
    manifest.write_manifest(path)
    assert manifest.model_dir_root(path / "model") == (path, "model")
    flip_one_byte(path / "accelerator" / "weights.dat")  # outside model/: not the model's business
    manifest.verify(path, "", under="model")


def test_a_checkpoint_without_a_manifest_gets_format_checks_and_one_log_line(tmp_path, caplog):
    path = fake_checkpoint(tmp_path, 2, with_manifest=False)
    with caplog.at_level(logging.INFO):
        manifest.verify(path, "")
    assert [r.message for r in caplog.records if "has no manifest.json" in r.message] != []
    (path / checkpoint.STATE_FILE).write_text('{"step": 2,')
    with pytest.raises(UserInputError, match=r"trainer_state.json: is not valid JSON \(line 1, column 12"):
        manifest.verify(path, "")


# ----------------------------------------------------------------------------------------------------
# resume=auto


def test_resume_auto_sets_a_damaged_newest_checkpoint_aside_and_takes_the_one_before(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    flip_one_byte(newest / "accelerator" / "weights.dat")
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == checkpoint.checkpoint_dir(tmp_path, 2)
    assert "step_4/accelerator/weights.dat: has changed since it was written" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2"]
    assert (tmp_path / "checkpoints" / "step_4.damaged" / "accelerator" / "weights.dat").is_file()


def test_resume_auto_refuses_when_no_checkpoint_is_intact_and_again_on_the_next_try(tmp_path):
    for step in (2, 4):
        (fake_checkpoint(tmp_path, step) / checkpoint.STATE_FILE).write_text("garbage")
    with pytest.raises(UserInputError, match=r"checkpoints: holds no intact checkpoint .*step_4/trainer_state.json"):
        resolve_resume("auto", tmp_path)
    # The damaged checkpoints are aside now: a requeued job must not take the empty list for a run never checkpointed.
    with pytest.raises(
        UserInputError,
        match=r"holds no intact checkpoint to resume from \(step_2.damaged; "
        r"step_4.damaged\)",
    ):
        resolve_resume("auto", tmp_path)


def test_a_damaged_checkpoint_named_by_path_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 2)
    (path / "accelerator" / "weights.dat").write_bytes(b"")
    with pytest.raises(UserInputError, match=r"weights.dat: holds 0 bytes .* checkpoint.resume=auto, which resumes"):
        resolve_resume(str(path), tmp_path)


# ----------------------------------------------------------------------------------------------------
# Failed writes


def test_a_failed_write_exits_with_code_2_and_its_message():
    error = CheckpointWriteError("run/checkpoints/step_4", "writing it failed (OSError: disk full)", "Free space.")
    with pytest.raises(SystemExit) as stopped, exit_on_input_error("train.py"):
        raise error
    assert stopped.value.code == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MB tmpfs: room for one checkpoint of the smallest model (~8.5 MB), not for a second beside it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_keeps_the_last_checkpoint_and_stops_with_code_2(small_disk, entry_points, tmp_path):
    run = small_disk / "run"
    overrides = [o for o in SMALL if not o.startswith("checkpoint.keep_last")] + ["checkpoint.keep_last=1"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    done = entry_points.run(["train.py", *overrides, f"hydra.run.dir={run}"], env, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    # torch.save on a full disk says only "unexpected pos ..." (RuntimeError): the free space tells the story.
    for part in (
        "checkpoints/step_4: writing it failed (RuntimeError",
        "MB are free there",
        "checkpoints/step_2 (",
        "MB) is complete: checkpoint.resume=auto resumes from it",
    ):
        assert part in output, (part, output[-4000:])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    checkpoint.verify_checkpoint(run / "checkpoints" / "step_2", "")


# ----------------------------------------------------------------------------------------------------
# metrics.jsonl: one history


def test_metrics_past_the_resumed_step_and_a_torn_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    drop_steps_after(path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    drop_steps_after(path, 0)
    assert path.read_text() == ""


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(tmp_path):
    common = ["trainer.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=0", "logging.every=1"]
    train(small_config(*common), tmp_path)
    train(small_config(*common, f"checkpoint.resume={checkpoint.checkpoint_dir(tmp_path, 2)}"), tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == steps
