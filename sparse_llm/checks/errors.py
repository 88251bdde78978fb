"""Errors a user can fix, and how train.py, eval.py and generate.py report them.

A bad input (an empty, binary, truncated or wrongly shaped file, a setting out of range, a full disk) is raised as
`UserInputError(path, what, fix)` where the file is opened or the setting read: one message that names the thing,
says what is wrong with it and what to do. The entry points run their work inside `exit_on_input_error`, which prints
that message and exits with code 2: a traceback would only hide it. Ctrl-C that reaches the body (KeyboardInterrupt)
ends it with one line and the shell's code for SIGINT, 130.

Debug switch: with HYDRA_FULL_ERROR=1 in the environment (Hydra's own switch for its full error reports) the error
propagates unchanged, traceback included:

    HYDRA_FULL_ERROR=1 python train.py data=local 'data.paths=[corpus.jsonl]'
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

DEBUG_VARIABLE = "HYDRA_FULL_ERROR"
INPUT_ERROR_EXIT = 2
INTERRUPTED_EXIT = 128 + 2  # the shell's code for death by SIGINT


class UserInputError(Exception):
    """`path` (a file, directory or config key) is unusable: `what` is wrong with it, `fix` says what to do.

    The three parts are the exception's args, so it pickles (ranks send it to each other) and compares as data."""

    def __init__(self, path: str | Path, what: str, fix: str) -> None:
        super().__init__(str(path), what.rstrip(". "), fix)

    @property
    def path(self) -> str:
        return self.args[0]

    @property
    def what(self) -> str:
        return self.args[1]

    @property
    def fix(self) -> str:
        return self.args[2]

    def __str__(self) -> str:
        return f"{self.path}: {self.what}. {self.fix}"


# Besides UserInputError: what the code raises for settings and files it checks itself (its messages name the key or
# file and the fix), and an unreachable data source.
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    UserInputError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    ConnectionError,
)


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_input_error(
    script: str,
    also: tuple[type[BaseException], ...] = (),
    report: Callable[[str], None] = _print_to_stderr,
    after_interrupt: str = "",
) -> Iterator[None]:
    """Run the body; an input error (INPUT_ERRORS, or a type in `also`) ends the process with one message through
    `report` and exit code 2, unless HYDRA_FULL_ERROR=1 asks for the traceback. KeyboardInterrupt ends it with
    "interrupted" and `after_interrupt` (what is left and how to go on) and exit code 130."""
    try:
        yield
    except (*INPUT_ERRORS, *also) as error:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        report(f"{script}: {error}\n({DEBUG_VARIABLE}=1 shows the traceback)")
        sys.exit(INPUT_ERROR_EXIT)
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        report(f"{script}: interrupted (Ctrl-C).{' ' + after_interrupt if after_interrupt else ''}")
        sys.exit(INTERRUPTED_EXIT)
