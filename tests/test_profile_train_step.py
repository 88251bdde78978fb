"""CPU tests of scripts/profile_train_step.py: a training step's phases, host time against device time."""


import pytest

from sparse_llm.ffn import backend

from script_modules import load_script

profile_train_step = load_script("profile_train_step")
bench_model = load_script("bench_model")

TINY = "--size tiny --seq-len 16 --train-batch 2 --warmup 0 --device cpu".split()


def test_cpu_run_lists_every_phase_of_each_step_and_skips_what_cannot_run(capsys):
    profile_train_step.main([*TINY, "--accumulate", "3", "--steps", "2"])
    out = capsys.readouterr().out
    phases = [line.split(" | ")[0].removeprefix("| ") for line in out.splitlines() if line.startswith("| micro")]
    assert phases == [f"micro-batch {i} {part}" for i in range(3) for part in ("forward", "backward")]
    optimizer = next(line for line in out.splitlines() if line.startswith("| optimizer"))
    host_ms, wait_ms, device_ms = optimizer.strip("| ").split(" | ")[1:]
    assert float(host_ms) > 0 and float(wait_ms) == 0 and device_ms == "-"  # no GPU: no device times
    steps = next(line for line in out.splitlines() if line.startswith("torch: step ms"))
    assert len(steps.split(": ")[-1].split(", ")) == 2
    assert "twell: skipped (" in out


def test_count_waits_are_measured_around_each_phase(monkeypatch):
    """A phase's count waits are what `landed` added to HostWaits while it ran."""

    def waits_a_while():
        backend.HostWaits.seconds += 0.25

    monkeypatch.setattr(backend.HostWaits, "seconds", 1.0)
    _, phase = profile_train_step.timed_phase(waits_a_while, cuda=False)
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
        profile_train_step.main([*TINY, *extra])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("off", [False, True])
def test_step_scope_is_entered_once_per_step_unless_switched_off(off, monkeypatch, capsys):
    entered = []
    real = bench_model.optimizer_step
    monkeypatch.setattr(bench_model, "optimizer_step", lambda **kw: entered.append(kw) or real(**kw))
    profile_train_step.main([*TINY, "--accumulate", "2", "--steps", "2", "--kernels", "torch",
                             *(["--no-step-scope"] if off else [])])  # fmt: skip
    assert entered == ([] if off else [{"reuse_casts": True, "add_into_grads": True, "graph_forwards": False}] * 2)
    assert ("no step scope" in capsys.readouterr().out) == off
