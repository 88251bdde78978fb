"""CPU tests of scripts/profile_train_step.py: a training step's phases, host time against device time."""

import json
import runpy
from pathlib import Path

import pytest

from sparse_llm.bench import train_step
from sparse_llm.ffn import backend

ROOT = Path(__file__).resolve().parents[1]
profile_train_step = runpy.run_path(str(ROOT / "scripts" / "profile_train_step.py"))

TINY = "--size tiny --seq-len 16 --train-batch 2 --warmup 0 --device cpu".split()


@pytest.fixture(autouse=True)
def _records_in_tmp(tmp_path, monkeypatch):
    """Runs without a --record-dir write their record under the test's own folder, not the checkout's docs/records/."""
    monkeypatch.chdir(tmp_path)


def test_cpu_run_lists_every_phase_of_each_step_and_skips_what_cannot_run(capsys, tmp_path):
    profile_train_step["main"]([*TINY, "--accumulate", "3", "--steps", "2", "--record-dir", str(tmp_path / "rec")])
    out = capsys.readouterr().out
    phases = [line.split(" | ")[0].removeprefix("| ") for line in out.splitlines() if line.startswith("| micro")]
    assert phases == [f"micro-batch {i} {part}" for i in range(3) for part in ("forward", "backward")]
    optimizer = next(line for line in out.splitlines() if line.startswith("| optimizer"))
    host_ms, wait_ms, device_ms = optimizer.strip("| ").split(" | ")[1:]
    assert float(host_ms) > 0 and float(wait_ms) == 0 and device_ms == "-"  # no GPU: no device times
    steps = next(line for line in out.splitlines() if line.startswith("torch: step ms"))
    assert len(steps.split(": ")[-1].split(", ")) == 2
    assert "twell: skipped (" in out
    (record_file,) = (tmp_path / "rec").glob("profile_train_step-*.json")
    record = json.loads(record_file.read_text())
    assert record["settings"]["accumulate"] == 3 and record["settings"]["kernels"] == ["torch", "twell"]
    phases = [row["phase"] for row in record["results"] if row["kernel"] == "torch"]
    assert phases == [f"micro-batch {i} {part}" for i in range(3) for part in ("forward", "backward")] + [
        "optimizer",
        "whole step",
    ]
    assert len(record["results"][-2]["step_ms"]) == 2 and "CUDA" in record["results"][-1]["skipped"]


def test_count_waits_are_measured_around_each_phase(monkeypatch):
    """A phase's count waits are what `landed` added to HostWaits while it ran."""

    def waits_a_while():
        backend.HostWaits.seconds += 0.25

    monkeypatch.setattr(backend.HostWaits, "seconds", 1.0)
    _, phase = profile_train_step["timed_phase"](waits_a_while, cuda=False)
    assert phase.wait_ms == pytest.approx(250.0) and phase.device_ms() is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--kernels", "stock"], "--kernels stock: choose from torch,twell"),
        (["--accumulate", "0"], "--accumulate must be >= 1"),
        (["--cuda-graphs"], "--cuda-graphs replays the compiled layers: add --compile"),
        (["--compile", "--cuda-graphs", "--warmup", "1"], "--cuda-graphs needs --warmup 2 or more"),
        (["--compile", "--cuda-graphs", "--warmup", "2"], "--cuda-graphs needs a CUDA GPU"),
        (["--checkpoint", "x"], "not allowed with argument --size"),
    ],
)
def test_bad_arguments_are_named(extra, message, capsys):
    with pytest.raises(SystemExit):
        profile_train_step["main"]([*TINY, *extra])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("off", [False, True])
def test_step_scope_is_entered_once_per_step_unless_switched_off(off, monkeypatch, capsys):
    entered = []
    real = train_step.optimizer_step
    monkeypatch.setattr(train_step, "optimizer_step", lambda **kw: entered.append(kw) or real(**kw))
    profile_train_step["main"](
        [*TINY, "--accumulate", "2", "--steps", "2", "--kernels", "torch", *(["--no-step-scope"] if off else [])]
    )
    assert entered == ([] if off else [{"reuse_casts": True, "add_into_grads": True, "graph_forwards": False}] * 2)
    assert ("no step scope" in capsys.readouterr().out) == off
