"""Stop signals during training (sparse_llm/training/preemption.py) and Ctrl-C in the entry points
(sparse_llm/checks/errors.py). The end-to-end stop with a checkpoint: tests/test_train.py (SIGTERM, one process) and
tests/test_distributed.py (two ranks)."""

import signal

import pytest

from sparse_llm.checks.errors import INTERRUPTED_EXIT, exit_on_input_error
from sparse_llm.training.preemption import FORWARDING_LAUNCHER_VARIABLE, StopSignals, TrainingStopped


@pytest.fixture
def default_ctrl_c():
    """SIGINT handled as Python handles it by default, whatever the test runner installed, and restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_first_ctrl_c_asks_for_a_stop_and_the_second_stops_at_once(default_ctrl_c, monkeypatch):
    monkeypatch.delenv(FORWARDING_LAUNCHER_VARIABLE, raising=False)
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGINT)  # delivered to this thread before raise_signal returns
        assert stop.requested == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert stop.requested == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_under_a_launcher_that_forwards_signals_a_second_ctrl_c_is_its_echo(default_ctrl_c, monkeypatch):
    monkeypatch.setenv(FORWARDING_LAUNCHER_VARIABLE, "run")  # as torchrun's agent sets it in its workers
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGINT)  # from the terminal
        signal.raise_signal(signal.SIGINT)  # forwarded by the agent
        assert stop.requested == signal.SIGINT


def test_after_sigterm_one_ctrl_c_stops_at_once(default_ctrl_c, monkeypatch):
    monkeypatch.delenv(FORWARDING_LAUNCHER_VARIABLE, raising=False)
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert stop.requested == signal.SIGTERM


def test_repeated_sigterm_keeps_the_first_request_and_the_handler():
    with StopSignals() as stop:
        handler = signal.getsignal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_process_that_ignores_ctrl_c_goes_on_ignoring_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert stop.requested is None
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stop_by_ctrl_c_names_it_and_exits_with_the_shells_code():
    stopped = TrainingStopped(signal.SIGINT, 30, "outputs/demo/checkpoints/step_30")
    assert str(stopped).startswith(
        "Stopped by Ctrl-C (SIGINT) after step 30; checkpoint outputs/demo/checkpoints/step_30"
    )
    assert "checkpoint.resume=auto" in str(stopped)
    assert stopped.exit_code == 130


def test_ctrl_c_in_an_entry_point_ends_with_one_line_and_code_130(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    lines = []
    with (
        pytest.raises(SystemExit) as exited,
        exit_on_input_error("train.py", report=lines.append, after_interrupt="Go on."),
    ):
        raise KeyboardInterrupt
    assert exited.value.code == INTERRUPTED_EXIT == 130
    assert lines == ["train.py: interrupted (Ctrl-C). Go on."]


def test_ctrl_c_keeps_its_traceback_when_asked_for(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(KeyboardInterrupt), exit_on_input_error("eval.py"):
        raise KeyboardInterrupt
