"""Run train.py, eval.py, generate.py and the ranks of distributed runs as a user's shell runs them, many times, at a
fraction of the start-up cost.

A fresh interpreter spends seconds importing torch, transformers and hydra before a script reads its first argument,
which is most of the time of a run that stops at a bad input. Here one server process (tests/helpers/fork_server.py)
imports them once and forks a child per run. The child is a real process: it runs the script as ``__main__`` with
its own argv, working directory, environment and stdin/stdout/stderr, and ends with the script's exit code (an
uncaught exception prints its traceback and exits 1, as Python does), so a test sees what the shell would. Fork needs
a POSIX system; the server does nothing with torch before forking, so no thread pool is copied into the children.
The HF libraries read the offline defaults when the server imports them: runs that need the hub
(`data=fineweb_edu`) do not belong here.

    with EntryPoints(ROOT) as entry:
        done = entry.run(["eval.py", "checkpoint=..."], env={...}, scratch=tmp_path)  # a CompletedProcess

The ranks of `accelerate launch` and `torchrun` come from the server too: with `rank_env(env)` for the launcher's
environment and `FORKED_RANK` as the command of its ranks (tests/helpers/forked.py), each rank asks the server for
its process.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers.forked import SERVER as SERVER_VARIABLE

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent
# A launcher's rank command after its no-python option: `python forked.py SCRIPT ARGS` (tests/helpers/forked.py).
FORKED_RANK = [sys.executable, str(HELPERS / "forked.py")]
# Runs may start from a background thread (helpers/background.py) while a test refuses this process's connections
# (test_data.py's `offline` patches socket.socket.connect): they connect with the method as it is now.
_connect = socket.socket.connect


def child_env(gpu: bool = False) -> dict[str, str]:
    """The environment for a process the tests start: no GPU unless `gpu`, one intra-op thread (as tests/conftest.py
    sets for this process), and this checkout's sparse_llm ahead of an installed one (a script's own folder comes
    first on its path, then site-packages)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class Run:
    """A run started by `EntryPoints.start`; `wait()` gives its CompletedProcess."""

    def __init__(self, server: EntryPoints, conn: socket.socket, argv: list[str], stdout: Path, stderr: Path) -> None:
        self._server, self._conn, self._argv = server, conn, argv
        self._stdout, self._stderr = stdout, stderr

    def wait(self) -> subprocess.CompletedProcess:
        with self._conn, self._conn.makefile("r") as replies:
            started, ended = replies.readline(), replies.readline()
        if not (started and ended):
            raise RuntimeError(f"the entry-point server stopped before the run ended: {self._server.log_tail()}")
        code = os.waitstatus_to_exitcode(json.loads(ended)["status"])
        return subprocess.CompletedProcess(self._argv, code, self._stdout.read_text(), self._stderr.read_text())


class EntryPoints:
    """The server and its clients' side; use as a context manager (it stops the server on exit). The server starts
    importing at once: runs asked for before it is ready wait in its socket's queue."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self._folder = Path(tempfile.mkdtemp(prefix="sparse_llm_entry_points_"))
        self.address = str(self._folder / "socket")
        server_env = dict(os.environ if env is None else env)
        server_env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(self.root), server_env.get("PYTHONPATH"))))
        # Bound and listening before the server starts: a client may connect at once, and the server's end is the
        # only one left, so that a server that died refuses clients instead of leaving them waiting.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(self.address)
            listener.listen(64)
            with open(self._folder / "server.log", "wb") as log:
                self._server = subprocess.Popen(
                    [sys.executable, str(HELPERS / "fork_server.py"), str(listener.fileno())],
                    cwd=self.root,
                    env=server_env,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=[listener.fileno()],
                )
        self._runs = itertools.count(1)  # next() is atomic: runs may start from several threads

    def rank_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a launcher whose ranks are FORKED_RANK: it tells them the server's address."""
        return {**env, SERVER_VARIABLE: self.address}

    def launch(self, command: list[str]) -> subprocess.CompletedProcess:
        """Run a launcher (`torchrun`, `accelerate launch`) whose ranks are FORKED_RANK, in the root with the test
        children's environment, to its end; its captured output."""
        env = self.rank_env(child_env())
        return subprocess.run(command, cwd=self.root, env=env, capture_output=True, text=True, timeout=300)

    def start(self, argv: list[str], env: dict[str, str], scratch: Path, nice: int = 0) -> Run:
        """Start `argv` (a script under the root, then its arguments) in a forked child with environment `env` and
        `nice` added to its niceness; its output goes through files under `scratch`. Runs may overlap."""
        number = next(self._runs)
        stdout, stderr = scratch / f"run{number}.out", scratch / f"run{number}.err"
        request = {"argv": argv, "cwd": str(self.root), "env": env, "nice": nice}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect(conn, self.address)
            with open(os.devnull, "rb") as stdin, open(stdout, "wb") as out, open(stderr, "wb") as err:
                fds = [stdin.fileno(), out.fileno(), err.fileno()]
                socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        except OSError as error:
            conn.close()
            raise RuntimeError(f"the entry-point server is not running ({error}): {self.log_tail()}") from None
        return Run(self, conn, argv, stdout, stderr)

    def run(self, argv: list[str], env: dict[str, str], scratch: Path, nice: int = 0) -> subprocess.CompletedProcess:
        """`start` and wait for the run to end."""
        return self.start(argv, env, scratch, nice).wait()

    def log_tail(self) -> str:
        """The end of the server's own output, and its exit code if it ended."""
        log = (self._folder / "server.log").read_text(errors="replace")[-3000:]
        return f"exit code {self._server.poll()}; its output ends:\n{log}"

    def close(self) -> None:
        """Stop the server (every run waited for has ended; it holds nothing else) and remove its folder."""
        if self._server.poll() is None:
            self._server.kill()
        self._server.wait()
        self._server.stdin.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> EntryPoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
