"""Slow work in processes of its own (a training run, a fresh interpreter, nvcc), done while the tests run.

The tests run in one thread and mostly keep one of two cores busy; work that waits on another process can use the
other one. A fixture whose value is such work offers it here under its own name (`offer`); once the tests
are collected, tests/conftest.py starts the work of the fixtures they use (`start`), one job at a time in a thread of
this process, in the order the tests first use them. The fixture then asks for its value (`result`): a job not started
yet runs at once in the asking thread, one under way is waited for.

A job's value must not depend on when it runs: it works in folders of its own, takes the environment and anything
else a test may change before the tests start, and only waits on its processes (the thread holds no lock the tests
need). Its processes run at the lowest priority (`NICE`), to take the CPU the tests leave idle, not theirs; and while a
test's own processes keep both cores busy (`paused`, e.g. a distributed run's ranks, which a third process slows at
every exchange), no job starts a process (`step` between a job's processes waits).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

NICE = 19
_NICE_COMMAND = shutil.which("nice")
_offered: dict[str, Callable[[], Any]] = {}
_jobs: dict[str, Future] = {}
_claimed: set[str] = set()
_lock = threading.Lock()
_unpaused = threading.Condition(_lock)
_pauses = 0
_worker: threading.Thread | None = None
_current: str | None = None  # the job the background thread is on
_wanted: set[str] = set()  # jobs a test waits for: they go on through a pause


def offer(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Decorator: the function (no arguments) computes the value of fixture `name`."""

    def register(work: Callable[[], Any]) -> Callable[[], Any]:
        _offered[name] = work
        return work

    return register


def low_priority(command: list[str]) -> list[str]:
    """`command` run at priority NICE, as the processes of the background work run."""
    return [_NICE_COMMAND, "-n", str(NICE), *command] if _NICE_COMMAND else command


@contextmanager
def paused() -> Iterator[None]:
    """No background job starts a process meanwhile (one under way goes on)."""
    global _pauses
    with _lock:
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            _unpaused.notify_all()


def step() -> None:
    """Called by a job before each of its processes: in the background thread, waits while paused, unless a test
    waits for the job; in a test's thread (a job the test asked for before it started), goes on."""
    if threading.current_thread() is _worker:
        with _lock:
            _unpaused.wait_for(lambda: _pauses == 0 or _current in _wanted)


def _claim(name: str) -> bool:
    """Whether this thread is the one to run `name` (each job runs once)."""
    with _lock:
        if name in _claimed:
            return False
        _claimed.add(name)
        _jobs.setdefault(name, Future())
        return True


def _run(name: str) -> None:
    future = _jobs[name]
    try:
        future.set_result(_offered[name]())
    except BaseException as error:  # the fixture that asks for it raises it
        future.set_exception(error)


def start(fixture_names: Iterable[str]) -> None:
    """Start the offered work among `fixture_names` (in that order) in a background thread."""
    global _worker
    names = [name for name in dict.fromkeys(fixture_names) if name in _offered]
    with _lock:
        for name in names:
            _jobs.setdefault(name, Future())

    def work_through() -> None:
        global _current
        for name in names:
            _current = name
            step()
            if _claim(name):
                _run(name)

    if names:
        # A daemon: when pytest exits nothing waits for work no test asked for.
        _worker = threading.Thread(target=work_through, name="background work", daemon=True)
        _worker.start()


def result(name: str) -> Any:
    """The value of the offered work `name`: computed here if nobody started it, else waited for."""
    if _claim(name):
        _run(name)
    with _lock:
        _wanted.add(name)
        _unpaused.notify_all()
    return _jobs[name].result()
