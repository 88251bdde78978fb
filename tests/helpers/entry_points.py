"""Run train.py, eval.py and generate.py as a user's shell runs them, many times, at a fraction of the start-up cost.

A fresh interpreter spends seconds importing torch, transformers and hydra before a script reads its first argument,
which is most of the time of a run that stops at a bad input. Here one server process imports them once and forks a
child per run. The child is a real process: it runs the script as ``__main__`` with its own argv, working directory,
environment and stdout/stderr, and ends with the script's exit code (an uncaught exception prints its traceback and
exits 1, as Python does), so a test sees what the shell would. Fork needs a POSIX system; the server does nothing
with torch before forking, so no thread pool is copied into the children. The HF libraries read the offline defaults
when the server imports them: runs that need the hub (`data=fineweb_edu`) do not belong here.

    with EntryPoints(ROOT) as entry:
        done = entry.run(["eval.py", "checkpoint=..."], env={...})   # a subprocess.CompletedProcess
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SERVER = r"""
import json, os, runpy, sys, traceback
from sparse_llm.cli import env as entry_env

entry_env.apply_defaults([])  # offline, as the entry points set it before importing the HF libraries
# What the entry points import before they read their arguments, and the optional packages their runs load.
import datasets, hydra, lm_eval, torch, transformers  # noqa: F401,E401
import sparse_llm.evaluation.evaluate, sparse_llm.generation.generate, sparse_llm.training.trainer  # noqa: F401,E401

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        sys.path[0] = request["cwd"]
        code = 0
        try:
            runpy.run_path(request["argv"][0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class EntryPoints:
    """A server that forks one child per script run; use as a context manager (it stops the server on exit)."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        server_env = dict(os.environ if env is None else env)
        server_env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(self.root), server_env.get("PYTHONPATH"))))
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            cwd=self.root,
            env=server_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._runs = 0

    def run(self, argv: list[str], env: dict[str, str], scratch: Path) -> subprocess.CompletedProcess:
        """Run `argv` (a script under the root, then its arguments) in a forked child with environment `env`; its
        output goes through files under `scratch`."""
        self._runs += 1
        stdout, stderr = scratch / f"run{self._runs}.out", scratch / f"run{self._runs}.err"
        request = {"argv": argv, "cwd": str(self.root), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._server.stdout.readline()
        if not reply:
            raise RuntimeError(f"the entry-point server stopped (exit code {self._server.poll()})")
        code = json.loads(reply)["code"]
        return subprocess.CompletedProcess(argv, code, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=60)

    def __enter__(self) -> EntryPoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
