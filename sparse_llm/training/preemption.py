"""A graceful stop on SIGTERM / SIGUSR1: finish the optimizer steps in flight, write a checkpoint, exit.

Schedulers send SIGTERM before they kill a job (SLURM's `--signal=USR1@<seconds>` sends SIGUSR1), and
`timeout` sends SIGTERM. Without a handler the process dies mid-step and every step since the last periodic
checkpoint is lost. The handler only sets a flag that the training loop reads between optimizer steps. Repeated
signals change nothing: launchers forward a signal that the whole process group has already received, so a
process often gets two. SIGINT (Ctrl-C) and SIGKILL still stop at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(RuntimeError):
    """Training stopped on a signal after saving `checkpoint` at `step`; resume with checkpoint.resume=auto.

    `signum` is the signal this process received, None on a rank that stopped because another rank got one.
    """

    def __init__(self, signum: int | None, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        cause = signal.Signals(signum).name if signum is not None else "a stop signal on another rank"
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

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = signum
            log.warning(
                "%s received: stopping within two optimizer steps with a checkpoint (Ctrl-C stops at once).",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
