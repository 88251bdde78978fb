"""A graceful stop on SIGTERM / SIGUSR1 / SIGINT: finish the optimizer steps in flight, write a checkpoint, exit.

Schedulers send SIGTERM before they kill a job (SLURM's `--signal=USR1@<seconds>` sends SIGUSR1), `timeout` sends
SIGTERM, and a user at the terminal presses Ctrl-C (SIGINT). Without a handler the process dies mid-step and every
step since the last periodic checkpoint is lost. The handler only sets a flag that the training loop reads between
optimizer steps. Repeated signals change nothing: launchers forward a signal that the whole process group has already
received, so a process often gets two. The exception is SIGINT after a first stop signal in a process that no launcher
forwards signals to: it stops at once (KeyboardInterrupt, nothing saved), the way out for a user who will not wait for
the checkpoint. Under torchrun's agent (`accelerate launch` of several processes) the agent's kill after its shutdown
timeout is that way out. SIGKILL always stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Set in the workers of torchrun's agent, which sends them each signal it gets (the terminal's Ctrl-C included)
FORWARDING_LAUNCHER_VARIABLE = "TORCHELASTIC_RUN_ID"


def signal_name(signum: int) -> str:
    """SIGTERM, SIGUSR1, or "Ctrl-C (SIGINT)": the name a user knows the signal by."""
    name = signal.Signals(signum).name
    return f"Ctrl-C ({name})" if signum == signal.SIGINT else name


class TrainingStopped(RuntimeError):
    """Training stopped on a signal after saving `checkpoint` at `step`; resume with checkpoint.resume=auto.

    `signum` is the signal this process received, None on a rank that stopped because another rank got one.
    """

    def __init__(self, signum: int | None, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        cause = signal_name(signum) if signum is not None else "a stop signal on another rank"
        super().__init__(
            f"Stopped by {cause} after step {step}; checkpoint {checkpoint}. "
            "Continue with the same command plus checkpoint.resume=auto."
        )

    @property
    def exit_code(self) -> int:
        """The shell's code for death by this signal (128 + its number; SIGTERM's when it came from elsewhere)."""
        return 128 + (self.signum if self.signum is not None else signal.SIGTERM)


class StopSignals:
    """Context manager: `requested` holds the first stop signal received inside it (None before one arrives).

    Outside the main thread Python cannot install handlers; there the context does nothing (`requested`
    stays None) and the process keeps the default behaviour.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, interrupt_twice: bool | None = None) -> None:
        """interrupt_twice: whether a SIGINT after the first stop signal stops at once; None: unless a launcher
        forwards signals here."""
        self.signals = signals
        if interrupt_twice is None:
            interrupt_twice = FORWARDING_LAUNCHER_VARIABLE not in os.environ
        self.interrupt_twice = interrupt_twice
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            return
        self.requested = signum
        if not self.interrupt_twice:
            then = "the launcher's shutdown timeout ends the workers if that takes too long"
        elif signal.SIGINT in self._previous:
            # the next Ctrl-C raises KeyboardInterrupt where the program is, as Python's own handler does
            signal.signal(signal.SIGINT, signal.default_int_handler)
            then = f"Ctrl-C{' again' if signum == signal.SIGINT else ''} stops at once"
        else:  # Ctrl-C ignored since the start
            then = "SIGKILL stops at once"
        log.warning(
            "%s received: stopping within two optimizer steps with a checkpoint (%s).", signal_name(signum), then
        )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                # a process started with Ctrl-C ignored (a shell's background job) keeps ignoring it
                if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
