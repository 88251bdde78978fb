"""The server of tests/helpers/entry_points.py: `python tests/helpers/fork_server.py FD`, FD a listening Unix socket.

It imports what the entry points and the ranks' scripts import, then serves each connection in a forked supervisor,
which receives the run (argv, working directory, environment, and the stdin, stdout and stderr to use), forks the
run's process, answers with its pid, and, once the run ends, with its wait status. A client that goes away takes its
run with it (the supervisor kills the run). The server ends when its stdin closes.
"""

import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback

from sparse_llm.cli import env as entry_env

# What the entry points import before they read their arguments, the optional packages their runs load, and the
# ranks' libraries.
PRELOADED = (
    "accelerate",
    "datasets",
    "hydra",
    "lm_eval",
    "torch",
    "transformers",
    "sparse_llm.evaluation.evaluate",
    "sparse_llm.generation.generate",
    "sparse_llm.training.trainer",
)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line, sent with the run's stdin, stdout and stderr."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the client went away before its request was whole")
        data += more
    return json.loads(data), fds


def run(request: dict, fds: list[int]) -> None:
    """In the run's process: become `python <argv>` in the request's directory and environment; never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.nice(request.get("nice", 0))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` puts the script's folder first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # as the interpreter reads sys.exit's argument
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def supervise(conn: socket.socket) -> None:
    """In a forked supervisor: run one request and report its pid, then its wait status; never returns."""
    try:
        request, fds = receive(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            run(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        exited = os.pidfd_open(pid)
        if exited not in select.select([conn, exited], [], [])[0]:
            os.kill(pid, signal.SIGKILL)  # the client closed its end: nobody waits for this run any more
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"status": status}).encode() + b"\n")
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def serve(listener: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the supervisors
    while True:
        ready = select.select([listener, sys.stdin], [], [])[0]
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return
        if listener in ready:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                supervise(conn)
            conn.close()


if __name__ == "__main__":
    # The checkout, not tests/helpers, whose modules could shadow a library's (each run sets its script's folder).
    sys.path[0] = os.getcwd()
    entry_env.apply_defaults([])  # offline, as the entry points set it before importing the HF libraries
    for module in PRELOADED:
        importlib.import_module(module)
    serve(socket.socket(fileno=int(sys.argv[1])))
