r"""Integrity manifests of checkpoints: the size and sha256 of every file, written last into a checkpoint directory
(a step checkpoint or final/), before its `.partial` directory is renamed.

`verify` checks a directory against its manifest before anything loads from it: every size first (a file cut short
by a full disk or a killed copy fails in microseconds), then every sha256, the files hashed by a pool of threads
(hashlib releases the GIL on large buffers). A checkpoint written before checkpoints carried a manifest gets the checks
that need no manifest (`file_checks.check_file_format`: JSON parses, safetensors headers match the file sizes,
torch.save archives are whole) and one log line saying so. `manifest.json` may be deleted to fall back to those
checks, e.g. after editing a checkpoint's config.json on purpose.

Cost: `sha256_of` hashed a 400 MiB file from the page cache at 0.84-1.56 GB/s on one core of an AMD EPYC (SHA
extensions; 2 cores shared with other processes, 11 runs; hashlib.sha256 on the bytes in memory: 1.33-1.51 GB/s):

    head -c 400M /dev/urandom > /tmp/probe.bin
    python -c "import time; from pathlib import Path; from sparse_llm.training.manifest import sha256_of; \
        t = time.perf_counter(); sha256_of(Path('/tmp/probe.bin')); print(419.4 / (time.perf_counter() - t), 'MB/s')"

A 2B checkpoint (~24.6 GB: 8.2 GB of fp32 weights, 16.4 GB of AdamW moments in one optimizer.bin) so takes ~16-29 s
to hash on one core, and ~11-20 s, the time of optimizer.bin alone, with a core per file. A resume hashes it in a
background thread started with the Trainer, while the data and the model are built (sparse_llm/training/trainer.py);
writing a checkpoint adds that time once per checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sparse_llm.checks.errors import UserInputError
from sparse_llm.checks.files import check_file_format, read_json_object

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
HASH_CHUNK = 8 << 20  # bytes per read: large enough that hashlib drops the GIL and the reads stay sequential
HASH_THREADS = min(8, os.cpu_count() or 1)

log = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_below(root: Path) -> list[str]:
    """Every file below `root` but the manifest, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p != root / MANIFEST_FILE)


def write_manifest(root: Path) -> Path:
    """Hash every file below `root` and write `root/manifest.json` (call last, once every file is written)."""
    names = _files_below(root)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(lambda name: sha256_of(root / name), names))
    files = {
        name: {"bytes": (root / name).stat().st_size, "sha256": digest}
        for name, digest in zip(names, digests, strict=True)
    }
    path = root / MANIFEST_FILE
    path.write_text(json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1))
    return path


def _read_manifest(root: Path, fix: str) -> dict[str, dict[str, Any]]:
    path = root / MANIFEST_FILE
    manifest = read_json_object(path, fix, keys=("version", "files"))
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
        for entry in files.values()
    ):
        raise UserInputError(path, "is not a checkpoint manifest (its 'files' must map names to bytes and sha256)", fix)
    return files


def verify(root: Path, fix: str, under: str = "") -> None:
    """Check the files of checkpoint directory `root` (only those below `root/under`, if given) against its manifest,
    or, where it has none, their formats. Raises UserInputError naming the first damaged file, with `fix`."""
    if not (root / MANIFEST_FILE).is_file():
        log.info(
            "%s has no %s (written before checkpoints carried one): checking sizes and formats only, not checksums",
            root,
            MANIFEST_FILE,
        )
        for name in _files_below(root / under):
            check_file_format(root / under / name, fix)
        return
    prefix = f"{under.strip('/')}/" if under else ""
    entries = {name: entry for name, entry in _read_manifest(root, fix).items() if name.startswith(prefix)}
    for name, entry in entries.items():
        path = root / name
        if not path.is_file():
            raise UserInputError(path, f"is missing (the checkpoint's {MANIFEST_FILE} lists it)", fix)
        size = path.stat().st_size
        if size != entry["bytes"]:
            how = "cut short or overwritten" if size < entry["bytes"] else "written to since"
            raise UserInputError(
                path, f"holds {size} bytes where {MANIFEST_FILE} lists {entry['bytes']}: it was {how}", fix
            )
    names = list(entries)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(lambda name: sha256_of(root / name), names))
    for name, digest in zip(names, digests, strict=True):
        if digest != entries[name]["sha256"]:
            raise UserInputError(
                root / name, f"has changed since it was written (its sha256 differs from {MANIFEST_FILE}'s)", fix
            )


def model_dir_root(model_dir: Path) -> tuple[Path, str]:
    """The directory whose manifest covers HF model directory `model_dir`, and the model's path inside it: a step
    checkpoint's `model/` is covered by `step_N/manifest.json`, a `final/` by its own."""
    if model_dir.name == "model" and (model_dir.parent / MANIFEST_FILE).is_file():
        return model_dir.parent, "model"
    return model_dir, ""
