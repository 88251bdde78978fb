"""Run-time compiled CUDA kernels: find the sources, compile them with NVRTC through CuPy, launch them.

Kernels live as .cu/.cuh files in the top-level `kernels/` directory of a source checkout (editable
install) or in `sparse_llm/_kernels/` inside a built wheel. They are compiled with CuPy's `RawModule`
(NVRTC backend, `-arch=sm_90a`, needed for wgmma) into CuPy's on-disk cache (`CUPY_CACHE_DIR`, default
`~/.cupy/kernel_cache`; set it before the first import of cupy). NVRTC has crashed a whole process on
malformed wgmma code before, so the first compile of each kernel version runs in a child process; only
after the child succeeds does this process compile (then a cache hit). Set SPARSE_LLM_COMPILE_INPROCESS=1
to skip the child (e.g. under compute-sanitizer).

Launches go to torch's current CUDA stream. Tensors are passed as raw device pointers; nothing is
converted to CuPy arrays and CuPy allocates no memory.

This module imports without a GPU, CUDA toolkit or cupy; `unavailable_reason` says what is missing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparse_llm.cuda.kernel_constants import cuda_defines

log = logging.getLogger(__name__)

NVRTC_OPTIONS: tuple[str, ...] = ("-arch=sm_90a", "-std=c++17")
REQUIRED_CAPABILITY = (9, 0)

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # sparse_llm/
# Wheel layout first, then the source checkout's top-level kernels/ directory.
KERNEL_DIRS: tuple[Path, ...] = (_PACKAGE_DIR / "_kernels", _PACKAGE_DIR.parent / "kernels")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_path(filename: str) -> Path:
    """Where the kernel source `filename` (e.g. "dense_rows.cu") is; FileNotFoundError lists the places tried."""
    for directory in KERNEL_DIRS:
        candidate = directory / filename
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(d) for d in KERNEL_DIRS)
    raise FileNotFoundError(
        f"CUDA kernel source {filename!r} not found in {tried}. Reinstall the package "
        "(`pip install -e .` from a source checkout) so that the kernels directory ships with it."
    )


def kernel_source(filename: str) -> str:
    """The source of `filename` with its local `#include "x.cuh"` headers inlined (once each), after the #define lines
    of the constants it shares with Python (`kernel_constants.cuda_defines`).

    Inlining makes the full text part of CuPy's cache key, so editing a header or a shared constant recompiles its
    users.
    """
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = kernel_path(name).read_text()
        return _INCLUDE.sub(lambda match: expand(match.group(1)), text)

    return cuda_defines() + expand(filename)


def _import_cupy() -> Any:
    """cupy, or None if it is not installed or cannot see a GPU."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return None
    return cupy


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None if the CUDA kernels can run on `device` (default: current CUDA device), else why not."""
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
        # A CUDA tensor's device, asked on every layer call: with CUDA initialised the GPU is there, and the answer
        # for its index is cached (a layer's every call pays this check on the host).
        if torch.cuda.is_initialized():
            return _cuda_device_reason(device.index)
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"tensors are on {device}, the kernels need a CUDA device"
    return _cuda_device_reason(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_device_reason(index: int) -> str | None:
    """unavailable_reason for CUDA device `index`; cached (it does not change while the process runs)."""
    device = torch.device("cuda", index)
    capability = torch.cuda.get_device_capability(device)
    if capability != REQUIRED_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} has compute capability {capability}; the kernels use sm_90a (Hopper: H100/H200) instructions"
    cupy = _import_cupy()
    if cupy is None:
        return "cupy is not installed; `pip install 'sparse-llm[cuda]'` (cupy-cuda13x)"
    try:
        if not cupy.cuda.is_available():
            return "cupy is installed but sees no CUDA device (driver/toolkit mismatch?)"
    except Exception as error:  # pragma: no cover - depends on the driver
        return f"cupy cannot use the GPU: {error}"
    return None


def cache_dir() -> Path:
    """Where CuPy keeps compiled kernels (CUPY_CACHE_DIR, else CuPy's default)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def compiles_in_children() -> bool:
    """Whether first compiles run in child processes (not with SPARSE_LLM_COMPILE_INPROCESS=1)."""
    return os.environ.get("SPARSE_LLM_COMPILE_INPROCESS") != "1"


def _marker(source: str, name: str) -> Path:
    digest = hashlib.sha256("\0".join((source, name, *NVRTC_OPTIONS)).encode()).hexdigest()[:24]
    return cache_dir() / f"sparse_llm-compiled-{digest}.ok"


def is_compiled(filename: str, name: str) -> bool:
    """Whether a child process has compiled this version of kernel `name` of `filename` into the cache."""
    return _marker(kernel_source(filename), name).exists()


def _compile_in_child(filename: str, name: str) -> None:
    """Compile in a child process once per kernel version, so an NVRTC crash cannot kill this process."""
    if not compiles_in_children():
        return
    marker = _marker(kernel_source(filename), name)
    if marker.exists():
        return
    # A cold cache costs several seconds a kernel: say so, rather than leave the first step silent.
    log.info("compiling CUDA kernel %s of %s (first use of this version; cached in %s)", name, filename, cache_dir())
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache_dir()), SPARSE_LLM_COMPILE_INPROCESS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(_PACKAGE_DIR.parent), env.get("PYTHONPATH"))))
    child = subprocess.run(
        [sys.executable, "-m", "sparse_llm.cuda.runtime", filename, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode != 0:
        detail = (child.stderr or child.stdout)[-3000:]
        raise RuntimeError(
            f"Compiling CUDA kernel {name!r} from {filename} failed in a child process "
            f"(exit code {child.returncode}):\n{detail}"
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def precompile(
    kernels: Sequence[tuple[str, str]],
    workers: int | None = None,
    done: Callable[[str, str, Exception | None], None] | None = None,
) -> dict[tuple[str, str], Exception]:
    """Compile each (source file, kernel name) not compiled yet, in child processes `workers` at a time (default: up
    to 8, no more than the CPU count). Each child pays for its own imports and NVRTC run, so a cold cache costs about
    one round of them rather than one per kernel in turn; later `get_function` calls load from the cache.
    `done(filename, name, error)` is called as each one finishes (error None on success, from a worker thread).
    Returns the failures, keyed like `kernels`. With SPARSE_LLM_COMPILE_INPROCESS=1 it does nothing (no callbacks):
    `get_function` then compiles in this process."""
    if not compiles_in_children():
        return {}
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    failures: dict[tuple[str, str], Exception] = {}

    def compile_one(filename: str, name: str) -> None:
        error: Exception | None = None
        try:
            _compile_in_child(filename, name)
        except Exception as caught:  # reported per kernel: the others still compile
            error = failures[filename, name] = caught
        if done is not None:
            done(filename, name, error)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(compile_one, filename, name) for filename, name in kernels]:
            future.result()
    return failures


@functools.cache
def _function(device_index: int, filename: str, name: str) -> Any:
    cupy = _import_cupy()
    if cupy is None:
        raise RuntimeError("cupy is not installed; `pip install 'sparse-llm[cuda]'` to use the CUDA kernels.")
    _compile_in_child(filename, name)
    templated = "<" in name
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=kernel_source(filename),
            options=NVRTC_OPTIONS,
            backend="nvrtc",
            name_expressions=[name] if templated else None,
        )
        return module.get_function(name)


def get_function(filename: str, name: str, device: torch.device | None = None) -> Any:
    """The compiled kernel `name` of source `filename` on `device` (a cupy.RawKernel), built on first use.

    `name` is an `extern "C"` symbol or a template instantiation such as "gate_up_down_heavy<8>".
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    return _function(device.index if device.index is not None else torch.cuda.current_device(), filename, name)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device`, for sizing grids (looked up once per device: launchers call
    this on every layer call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


DEFAULT_DYNAMIC_SMEM = 48 * 1024  # dynamic shared memory a launch may use without raising the kernel's limit


def set_dynamic_smem(kernel: Any, nbytes: int) -> None:
    """Allow `kernel` nbytes of dynamic shared memory: raises its limit where nbytes is above the default 48 KiB
    (free below it: no driver query)."""
    if nbytes > DEFAULT_DYNAMIC_SMEM and kernel.max_dynamic_shared_size_bytes < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes


def ptr(tensor: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument; None gives the null pointer (an optional operand)."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def launch(
    kernel: Any,
    grid: Sequence[int],
    block: Sequence[int],
    args: Sequence[Any],
    device: torch.device,
    shared_mem: int = 0,
) -> None:
    """Launch `kernel` on torch's current stream of `device`.

    Python ints in `args` must already be numpy scalars of the kernel's parameter types (np.int32 for
    `int`): a bare Python int or float would be passed as 64 bits and shift every later argument.
    CuPy raises if the launch itself is rejected; errors inside the kernel surface at the next sync.
    """
    current = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python layers
    index = device.index if device.index is not None else current
    # The raw pointer of torch's current stream, without building a torch.cuda.Stream object per launch; the
    # compiled function takes the stream as an argument, so no stream context is entered and left per launch.
    stream = _cupy_stream(index, torch._C._cuda_getCurrentRawStream(index))
    if index == current:  # torch and CuPy share the runtime's current device
        kernel.kernel(tuple(grid), tuple(block), tuple(args), shared_mem, stream)
    else:
        with _import_cupy().cuda.Device(index):
            kernel.kernel(tuple(grid), tuple(block), tuple(args), shared_mem, stream)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` where CUDA `device` is not the current device; where it is (the usual case), a
    context that does nothing (1 against 3 us a call on an H200's host)."""
    if device.index is None or device.index == torch._C._cuda_getDevice():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.cache
def side_stream(device_index: int) -> torch.cuda.Stream:
    """A high-priority stream of the device, for short kernels issued beside a long one on the current stream:
    the block scheduler dispatches their blocks ahead of the long kernel's pending ones, so they run in the
    slots its finished blocks free instead of after it."""
    return torch.cuda.Stream(device=device_index, priority=-1)


@functools.lru_cache(maxsize=64)
def _cupy_stream(device_index: int, stream_ptr: int) -> Any:
    """A CuPy view of a torch stream (cached: wrapping costs microseconds on every launch otherwise)."""
    cupy = _import_cupy()
    with cupy.cuda.Device(device_index), warnings.catch_warnings():
        # ExternalStream is deprecated in CuPy 14 in favour of Stream.from_external(obj), which needs the
        # torch stream object itself; the raw-pointer form is what a cache keyed on the pointer can use.
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream_ptr, device_index)


def _compile_main(argv: list[str]) -> int:
    """Child-process entry: compile one kernel (`python -m sparse_llm.cuda.runtime FILE NAME`)."""
    filename, name = argv
    _function(torch.cuda.current_device(), filename, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(_compile_main(sys.argv[1:]))
