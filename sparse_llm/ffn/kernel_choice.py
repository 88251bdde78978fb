"""The values of `kernel=` (train.py, eval.py, generate.py) and their check, apart from the dispatcher so that an
entry point names a bad value before torch loads."""

from __future__ import annotations

KERNEL_CHOICES = ("auto", "torch", "twell")


def validate_kernel(kernel: str) -> None:
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel={kernel!r} is not a valid choice; use one of {list(KERNEL_CHOICES)}.")
