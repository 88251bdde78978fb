"""Benchmark records: one JSON file per benchmark run, the data that docs/benchmarks.md is generated from.

A record is
    {"schema": 1, "bench": "<script name>", "time": "<UTC, ISO 8601>", "hardware": {...}, "commit": "<sha or null>",
     "command": "<the command line>", "settings": {...}, "results": [{...}, ...]}
plus any keys a benchmark adds (e.g. "source": where a number was first written down). `settings` holds what
defines the measurement (shapes, model, densities, batch, timing options), never output paths: two runs with equal
settings on the same GPU measure the same thing, and the report keeps the newer. Each `results` entry is one table
row: scalars, and optionally nested detail (per-layer statistics, time breakdowns) that stays in the file.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import math
import platform
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from sparse_llm.bench.timing import hardware_summary

SCHEMA = 1
DEFAULT_RECORD_DIR = "docs/records"
CHECKOUT = Path(__file__).resolve().parents[2]  # the source tree this package runs from


def _driver_version() -> str | None:
    """The NVIDIA driver's version from NVML, None without pynvml or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no package, no driver, no NVML library: the record says null
        return None
    return version.decode() if isinstance(version, bytes) else version


def _cupy_version() -> str | None:
    """The installed CuPy's version (whichever cupy-cuda* wheel provides it), without importing it."""
    for distribution in importlib.metadata.packages_distributions().get("cupy", []):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_block(device: torch.device | str) -> dict[str, Any]:
    """The device and software stack a measurement ran on: GPU name and SM count (None on a CPU), driver, CUDA,
    torch and CuPy versions, the host's CPU, and `timing.hardware_summary`'s one-line form."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    return {
        "summary": hardware_summary(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if cuda else None,
        "driver": _driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "cupy": _cupy_version(),
        "cpu": _cpu_name(),
    }


def git_commit(checkout: Path = CHECKOUT) -> str | None:
    """The commit checked out at `checkout`, with "+dirty" where tracked files differ from it (the code that ran is
    then not that commit's); None outside a git checkout (an installed wheel) or without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return f"{head}+dirty" if changed else head


def _plain(value: Any) -> Any:
    """value with NaN and infinities as None (JSON has neither) and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def make_record(
    bench: str,
    settings: Mapping[str, Any],
    results: Sequence[Mapping[str, Any]],
    device: torch.device | str,
    argv: Sequence[str],
    **extra: Any,
) -> dict[str, Any]:
    """The record of one run of scripts/<bench>.py with command-line arguments `argv`, measured on `device` now."""
    now = datetime.datetime.now(datetime.UTC)
    record = {
        "schema": SCHEMA,
        "bench": bench,
        "time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware_block(device),
        "commit": git_commit(),
        "command": f"python scripts/{bench}.py {shlex.join(argv)}".rstrip(),
        "settings": dict(settings),
        "results": [dict(row) for row in results],
        **extra,
    }
    return _plain(record)


def record_file_name(record: Mapping[str, Any]) -> str:
    """<bench>-<UTC time, compact>-<first 8 hex digits of the content's SHA-256>.json: sorted by time within a
    bench, and two records of one second apart in name."""
    stamp = record["time"].replace("-", "").replace(":", "")
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:8]
    return f"{record['bench']}-{stamp}-{digest}.json"


def write_record(record_dir: str | Path, record: Mapping[str, Any]) -> Path:
    """Write `record` into record_dir (created if missing); returns the file's path."""
    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)
    path = record_dir / record_file_name(record)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"record: {path}", flush=True)
    return path


def read_records(record_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Every record in record_dir, by file name (sorted); a file of another schema is an error that names it."""
    records = {}
    for path in sorted(Path(record_dir).glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {record.get('schema')!r}, this reader knows schema {SCHEMA}")
        records[path.name] = record
    return records
