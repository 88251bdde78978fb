"""nvcc builds of the kernel files for sm_90a, for the CPU tier's compile checks (nvcc runs without a GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from helpers import background
from sparse_llm.cuda import runtime as cuda

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
_ENV = dict(os.environ)  # taken at collection: the builds may run while a test has variables of its own set


def build_for_sm90a(filenames: Sequence[str], flags: Sequence[str] = ()) -> dict[str, subprocess.CompletedProcess]:
    """nvcc on each file's source as the runtime compiles it (local headers inlined), one after another, at low
    priority (helpers/background.py: done while other tests run); empty without nvcc."""
    builds = {}
    with tempfile.TemporaryDirectory() as folder:
        for filename in filenames if NVCC is not None else ():
            background.step()
            src = Path(folder) / filename
            src.write_text(cuda.kernel_source(filename))
            cubin = str(Path(folder) / "k.cubin")
            cmd = [
                NVCC,
                "-gencode=arch=compute_90a,code=sm_90a",
                "-std=c++17",
                "--cubin",
                *flags,
                "-o",
                cubin,
                str(src),
            ]
            builds[filename] = subprocess.run(
                background.low_priority(cmd), capture_output=True, text=True, timeout=300, env=_ENV
            )
    return builds
