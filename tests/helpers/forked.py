"""A launcher's rank as a process forked from the tests' entry-point server (tests/helpers/entry_points.py):
`python tests/helpers/forked.py SCRIPT ARGS...` runs `python SCRIPT ARGS...` there, with this process's working
directory, environment (the rank's), stdin, stdout and stderr, and ends as it ends.

Launchers start it with their option for a command that is not a Python script (`accelerate launch --no_python`,
`torchrun --no-python`). A fresh rank imports torch and transformers for ~10 s before it reads its arguments, and two
of them share two cores; a forked one starts at once. The signals a launcher sends this process go on to the run.
It imports nothing heavy itself.
"""

import contextlib
import json
import os
import signal
import socket
import sys

SERVER = "SPARSE_LLM_TEST_FORK_SERVER"  # the server's socket, set by EntryPoints.rank_env
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _usable(fd: int) -> int:
    """`fd`, or /dev/null where it is closed (a launcher may start its ranks without a stdin)."""
    try:
        os.fstat(fd)
    except OSError:
        return os.open(os.devnull, os.O_RDWR)
    return fd


def main() -> None:
    run_pid: int | None = None
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if run_pid is None:
            pending.append(signum)  # sent before the run started: it gets it once it has
            return
        with contextlib.suppress(ProcessLookupError):  # the run has just ended
            os.kill(run_pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SERVER])
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [_usable(fd) for fd in (0, 1, 2)])
    replies = conn.makefile("r")
    started = replies.readline()
    if not started:
        sys.exit("forked.py: the entry-point server closed the connection before starting the run")
    run_pid = json.loads(started)["pid"]
    for signum in pending:
        os.kill(run_pid, signum)
    ended = replies.readline()
    if not ended:
        sys.exit("forked.py: the entry-point server closed the connection before the run ended")
    code = os.waitstatus_to_exitcode(json.loads(ended)["status"])
    if code < 0:  # killed by a signal: so is this process, for the launcher to see
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is to go on: end as a shell reports it
    sys.exit(code)


if __name__ == "__main__":
    main()
