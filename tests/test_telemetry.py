"""Telemetry (jsonl, W&B offline, console), EnergyMeter degradation and run plots, all on CPU."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from sparse_llm.telemetry import energy as energy_mod
from sparse_llm.telemetry.energy import EnergyMeter
from sparse_llm.telemetry.metrics import (
    LoggingConfig,
    Telemetry,
    format_console_line,
    read_metrics,
    resolve_wandb_mode,
)
from sparse_llm.telemetry.plots import main as plots_main
from sparse_llm.telemetry.plots import plot_run

QUIET = LoggingConfig(wandb=False, progress_bar=False, console=False)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_written_and_continued_on_resume_with_each_step_once(tmp_path: Path) -> None:
    with Telemetry(QUIET, tmp_path, {}, is_main=True, total_steps=30) as tel:
        tel.log(10, {"loss": 3.5, "backend/layer_00": "twell", "l0/layer_00": torch.tensor(12.0)})
        tel.log(20, {"loss": 3.0})
    # A resumed run starts again from step 10 and keeps writing to the same file, without the first run's step 20.
    with Telemetry(QUIET, tmp_path, {}, is_main=True, total_steps=30, start_step=10) as tel:
        tel.log(20, {"loss": 2.9})
        tel.log(30, {"loss": 2.5})

    lines = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [10, 20, 30]
    assert lines[0] == {"step": 10, "loss": 3.5, "backend/layer_00": "twell", "l0/layer_00": 12.0}
    merged = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in merged] == [(10, 3.5), (20, 2.9), (30, 2.5)]


def test_each_line_is_flushed_before_close(tmp_path: Path) -> None:
    tel = Telemetry(QUIET, tmp_path, {}, is_main=True, total_steps=10)
    tel.log(1, {"loss": 1.0})
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]
    tel.close()
    tel.close()  # idempotent


def test_log_rejects_bad_metrics(tmp_path: Path) -> None:
    with Telemetry(QUIET, tmp_path, {}, is_main=True, total_steps=10) as tel:
        with pytest.raises(ValueError, match="'step'"):
            tel.log(1, {"step": 1})
        with pytest.raises(TypeError, match="'loss'"):
            tel.log(1, {"loss": [1.0]})
    with pytest.raises(ValueError, match="logging.every"):
        Telemetry(LoggingConfig(every=0), tmp_path, {}, is_main=True, total_steps=10)


def test_non_main_process_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any W&B import attempt would warn; none must happen
    run_dir = tmp_path / "run"
    tel = Telemetry(LoggingConfig(), run_dir, {"a": 1}, is_main=False, total_steps=10)
    tel.advance(1, {"loss": 1.0})
    tel.log(1, {"loss": 1.0})
    tel.close()
    assert not run_dir.exists()


def test_should_log_every_n_and_last_step() -> None:
    tel = Telemetry(LoggingConfig(every=4), Path("unused"), {}, is_main=False, total_steps=10)
    assert [s for s in range(1, 11) if tel.should_log(s)] == [4, 8, 10]


def test_wandb_offline_run_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = LoggingConfig(progress_bar=False, console=False)
    with Telemetry(cfg, tmp_path, {"model": "tiny"}, is_main=True, total_steps=2) as tel:
        assert tel._wandb_run is not None
        tel.log(1, {"loss": 2.0, "backend/layer_00": "torch"})
        tel.log(2, {"loss": 1.5, "val/ce": 1.6})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))
    assert len(_lines(tmp_path / "metrics.jsonl")) == 2


def test_wandb_disabled_or_missing_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with Telemetry(QUIET, tmp_path / "off", {}, is_main=True, total_steps=1) as t:
        t.log(1, {"loss": 1.0})
    assert not (tmp_path / "off" / "wandb").exists()

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    cfg = LoggingConfig(wandb_mode="offline", progress_bar=False, console=False)
    with caplog.at_level(logging.WARNING, logger="sparse_llm.telemetry.metrics"):
        with Telemetry(cfg, tmp_path / "missing", {}, True, 1) as t:
            t.log(1, {"loss": 1.0})
    assert "wandb is not installed" in caplog.text
    assert _lines(tmp_path / "missing" / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


def test_wandb_mode_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_wandb_mode(None) == "offline"
    assert resolve_wandb_mode("online") == "offline"  # no key: never online
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == "disabled"
    assert resolve_wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("online") == "online"
    with pytest.raises(ValueError, match="logging.wandb_mode"):
        resolve_wandb_mode("sometimes")


def test_console_line_shows_present_metrics_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = format_console_line(
        20, 1000, {"loss": 3.21, "sparsity/mean": 0.978, "tokens_per_s": 12345.0, "mj_per_token": 1.5}
    )
    assert line == "step   20/1000 | loss 3.2100 | sparsity 97.8% | 12.3k tok/s | 1.5 mJ/tok"
    timed = {"tokens_per_s": 12345.0, "step_time_s": 0.25}
    assert format_console_line(20, 1000, timed) == "step   20/1000 | 12.3k tok/s | eta 4m05s"
    assert format_console_line(0, 40000, timed).endswith("eta 2h46m")
    assert format_console_line(990, 1000, timed).endswith("eta 2s")
    assert "eta" not in format_console_line(1000, 1000, timed)
    cfg = LoggingConfig(wandb=False, progress_bar=True, console=True)
    with Telemetry(cfg, tmp_path, {}, is_main=True, total_steps=1000) as tel:
        tel.advance(20, {"loss": 3.21})
        tel.log(20, {"loss": 3.21, "dead/mean": 0.5})
    assert "step   20/1000 | loss 3.2100 | dead 50.0%" in capsys.readouterr().out


def test_energy_meter_on_cpu_returns_none() -> None:
    meter = EnergyMeter(torch.device("cpu"))
    assert not meter.available and meter.unavailable_reason
    assert meter.lap() is None
    assert meter.power_w() is None
    meter.close()


class _FakeNVMLError(Exception):
    pass


def _fake_nvml(readings_mj: list[int], mig: bool = False) -> types.ModuleType:
    """A pynvml stand-in for a GPU whose UUID is GPU-abc and whose energy counter yields ``readings_mj``."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _FakeNVMLError
    nvml.NVML_DEVICE_MIG_ENABLE = 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None

    def by_uuid(uuid: str) -> str:
        if uuid != "GPU-abc":
            raise _FakeNVMLError("not found")
        return "handle"

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetMigMode = lambda h: (1, 1) if mig else (0, 0)
    counter = iter(readings_mj)
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(counter)
    nvml.nvmlDeviceGetPowerUsage = lambda h: 612_500
    return nvml


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(energy_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(energy_mod.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(energy_mod.torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="abc"))


def test_energy_meter_laps_counter_deltas(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([10_000, 11_500, 11_500, 5_000, 6_000]))
    meter = EnergyMeter(torch.device("cuda", 0))
    assert meter.available
    assert meter.lap() == pytest.approx(1.5)
    assert meter.lap() == 0.0
    assert meter.lap() is None  # counter went backwards (driver reload): no value, new baseline
    assert meter.lap() == pytest.approx(1.0)
    assert meter.power_w() == pytest.approx(612.5)
    assert meter.lap() is None  # a failing read (here: exhausted counter) must not raise


def test_energy_meter_none_under_mig(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([0], mig=True))
    meter = EnergyMeter(torch.device("cuda", 0))
    assert not meter.available and "MIG" in meter.unavailable_reason
    assert meter.lap() is None


def _write_synthetic_run(run_dir: Path) -> None:
    """Steps 10..60, then a resume from step 30 that rewrites 40..60, plus val lines and a cut-off line."""
    run_dir.mkdir()
    lines = []
    for attempt, steps in enumerate((range(10, 70, 10), range(40, 70, 10))):
        for step in steps:
            record = {"step": step, "loss": 5.0 - step / 20 - attempt, "ce": 4.9 - step / 20 - attempt}
            record |= {f"l0/layer_{i:02d}": 1000.0 / (step * (i + 1)) for i in range(3)}
            record["backend/layer_00"] = "torch"
            lines.append(json.dumps(record))
    lines.append(json.dumps({"step": 60, "val/ce": 2.5, "val/ppl": 12.2}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 70, "lo')


def test_plot_run_writes_png_from_resumed_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_synthetic_run(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert records[-1]["loss"] == pytest.approx(5.0 - 3 - 1)  # the resumed attempt wins
    assert records[-1]["val/ce"] == 2.5  # the val line joins the training line of its step

    out = plot_run(run_dir)
    assert out == run_dir / "training.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_run_single_line_without_layers(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 4.0, "l0/mean": 0.0}) + "\n")
    assert plot_run(tmp_path).stat().st_size > 0


def test_plot_cli_missing_metrics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        plots_main([str(tmp_path)])
    assert "metrics.jsonl not found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
