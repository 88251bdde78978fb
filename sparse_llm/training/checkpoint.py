"""Checkpoints of a training run: atomic, resumable, with the model in plain HF layout.

Layout of `<run>/checkpoints/step_<N>/`:
    model/              HF layout (config.json + model.safetensors + tokenizer): loads with
                        AutoModelForCausalLM.from_pretrained, no custom code; a resume reads the weights from here
    accelerator/        accelerate's save_state: optimizer, scheduler and RNG states of every rank; the model too
                        under FSDP (sharded), and in checkpoints written before model/ was the only copy
    trainer_state.json  step, tokens seen, per-rank data-loader positions
    rank_<r>.pt         what else each rank needs to continue exactly (its open sparsity windows)
    manifest.json       size and sha256 of every other file (sparse_llm/training/manifest.py), written last
A checkpoint is written under `step_<N>.partial/` and renamed once complete, so a crash mid-write never
leaves a directory that `resume=auto` would pick up. A write that fails for any reason removes its partial directory
and raises CheckpointWriteError. `resume=auto` verifies the newest checkpoint against its manifest and, where a file
is damaged, says which, moves that checkpoint aside to `step_<N>.damaged/` and takes the one before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from sparse_llm.checks.errors import UserInputError
from sparse_llm.checks.files import read_json_object
from sparse_llm.training import manifest

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
STATE_KEYS = ("step", "loaders", "world_size")
DAMAGED_SUFFIX = ".damaged"

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, verified (None for a fresh run, or `auto` before the first checkpoint).

    `auto` takes the newest intact checkpoint: each damaged one newer than it is named in the log and moved aside
    (`step_N.damaged/`, left for the user to inspect or delete), so that later checkpoints of the resumed run do not
    count it among those `keep_last` keeps. With every checkpoint damaged it refuses rather than start over. A
    checkpoint named by path must be intact."""
    if resume in ("", "none", "None"):
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        damaged = []
        for path in reversed(found):
            try:
                verify_checkpoint(path, "")
            except UserInputError as damage:
                aside = path.with_name(path.name + DAMAGED_SUFFIX)
                log.warning(
                    "Checkpoint %s is damaged: %s: %s. Moved aside to %s; trying the checkpoint before it.",
                    path,
                    damage.path,
                    damage.what,
                    aside.name,
                )
                path.rename(aside)
                damaged.append(f"{damage.path}: {damage.what}")
                continue
            if damaged:
                log.warning("Resuming from %s, the newest intact checkpoint", path)
            return path
        set_aside = sorted(p.name for p in (run_dir / "checkpoints").glob(f"step_*{DAMAGED_SUFFIX}"))
        if damaged or set_aside:  # never a silent start from scratch over a run whose checkpoints are all damaged
            raise UserInputError(
                run_dir / "checkpoints",
                f"holds no intact checkpoint to resume from ({'; '.join(damaged or set_aside)})",
                f"The damaged ones are kept as step_N{DAMAGED_SUFFIX}/. Start the run over with another run_name, or "
                "restore a checkpoint from a copy and pass checkpoint.resume=<its path>.",
            )
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a complete checkpoint (no {STATE_FILE} in it). Pass a "
            "'<run>/checkpoints/step_N' directory, or checkpoint.resume=auto with the run's run_name."
        )
    verify_checkpoint(
        path,
        f"Pass another checkpoint (checkpoint.resume={path.parent}/step_N), or "
        "checkpoint.resume=auto, which resumes from the run's newest intact one.",
    )
    return path


class ResumeCheck:
    """`resolve_resume` in a background thread of the main process, started with the Trainer so that hashing a large
    checkpoint overlaps building the data and the model (other ranks take the main process's answer)."""

    def __init__(self, resume: str, run_dir: Path, verify_here: bool) -> None:
        self._outcome: tuple[Path | None, Exception | None] = (None, None)
        self._thread = None
        if verify_here:
            self._thread = threading.Thread(target=self._run, args=(resume, run_dir), name="resume-check", daemon=True)
            self._thread.start()

    def _run(self, resume: str, run_dir: Path) -> None:
        try:
            self._outcome = (resolve_resume(resume, run_dir), None)
        except Exception as error:  # handed to the caller of outcome(), on every rank
            self._outcome = (None, error)

    def outcome(self) -> tuple[Path | None, Exception | None]:
        """(the checkpoint to resume from or None, the error that stops the resume or None)."""
        if self._thread is not None:
            self._thread.join()
        return self._outcome


def verify_checkpoint(path: Path, fix: str) -> None:
    """Raise UserInputError (with `fix`) naming the first damaged file of step checkpoint `path`."""
    manifest.verify(path, fix)
    read_json_object(path / STATE_FILE, fix, keys=STATE_KEYS)


def save_checkpoint(
    accelerator: Accelerator,
    model: Any,
    tokenizer: Any,
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write the checkpoint of `step` on all ranks (collective: every rank must call it).

    keep_last > 0: at most that many step checkpoints on disk, the one being written included, but never fewer than
    one complete one while it is written (so a crash mid-write still leaves one to resume from). The manifest is
    written last, before the rename. A write that fails for any reason removes its partial directory and raises
    CheckpointWriteError saying what to change."""
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    with written_or_removed(partial, final, run_dir, keep_last):
        if accelerator.is_main_process:
            if keep_last > 0:  # room first: a 2B model's checkpoint with its AdamW state is ~25 GB
                for old in list_checkpoints(run_dir)[: -max(keep_last - 1, 1)]:
                    shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        accelerator.wait_for_everyone()
        skip = accelerator.register_save_state_pre_hook(_skip_model_weights)
        try:
            accelerator.save_state(str(partial / "accelerator"), safe_serialization=True)
        finally:
            skip.remove()
        torch.save(rank_state, partial / f"rank_{accelerator.process_index}.pt")
        export_model(accelerator, model, tokenizer, partial / "model")  # ends with every rank's files written
        if accelerator.is_main_process:
            (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
            manifest.write_manifest(partial)
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
    if accelerator.is_main_process:
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class CheckpointWriteError(UserInputError):
    """A step checkpoint or the final model could not be written (its partial directory is removed): the message
    names the disk's free space and the checkpoint to resume from."""


@contextlib.contextmanager
def written_or_removed(partial: Path, target: Path, run_dir: Path, keep_last: int) -> Iterator[None]:
    """Around the writes into `partial` (renamed to `target`, a step checkpoint or final/, once complete): any failure
    (a full disk, a permission, an I/O error, torch.save's RuntimeError) removes `partial` and becomes a
    CheckpointWriteError saying what to change."""
    try:
        yield
    except Exception as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise _write_failure(err, target, run_dir, keep_last) from err


def _write_failure(err: Exception, target: Path, run_dir: Path, keep_last: int) -> CheckpointWriteError:
    """What a failed write of `target` (a step checkpoint or final/) says: the error, the disk's free space against the
    last checkpoint's size, the checkpoint a resume would start from, and the settings that need less disk."""
    complete = list_checkpoints(run_dir)
    try:
        free = f"{_in_units(shutil.disk_usage(run_dir).free)} are free there"
    except OSError as usage_error:
        free = f"the free space is unknown ({usage_error})"
    if complete:
        size = sum(f.stat().st_size for f in complete[-1].rglob("*") if f.is_file())
        last = f"{complete[-1]} ({_in_units(size)}) is complete: checkpoint.resume=auto resumes from it"
    else:
        last = "no complete checkpoint exists yet"
    reason = " ".join(str(err).split()) or type(err).__name__  # torch.save's messages span lines
    return CheckpointWriteError(
        target,
        f"writing it failed ({type(err).__name__}: {reason}); {free}",
        f"{last[0].upper()}{last[1:]}. Free disk space, lower checkpoint.keep_last (now {keep_last}: a run holds "
        "that many checkpoints between writes, and at least two while one is written), raise checkpoint.every, or "
        "put the run on a larger disk.",
    )


def _in_units(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def export_model(accelerator: Accelerator, model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Save the (unwrapped, gathered) model and tokenizer in HF layout; collective under FSDP."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    accelerator.wait_for_everyone()


def _skip_model_weights(models: list[Any], weights: list[dict[str, torch.Tensor]], output_dir: str) -> None:
    """save_state pre-hook: accelerate writes no model weights, as model/ holds the same tensors (a 2B model's
    fp32 weights are 8.2 GB a checkpoint). Under FSDP accelerate writes its sharded model itself and passes no
    weights here."""
    weights.clear()


def _weights_from_model_dir(accelerator: Accelerator, model_dir: Path, models: list[Any], input_dir: str) -> None:
    """load_state pre-hook: the prepared model's weights come from `model_dir` (HF layout), and accelerate loads no
    model. A checkpoint whose accelerator/ still holds the model (written before model/ was the only copy) is left to
    accelerate, and so is FSDP's sharded model, which accelerate loads before it calls this hook with no models."""
    if not models or any((Path(input_dir) / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        return
    (model,) = models
    load_hf_weights(accelerator.unwrap_model(model), model_dir)
    models.clear()


def load_hf_weights(module: torch.nn.Module, model_dir: Path) -> None:
    """Copy the weights that `save_pretrained` wrote to `model_dir` (one safetensors file, or shards listed in its
    index) into `module`. Every parameter and buffer of the module must come from there, except those tied to
    one that does (the LM head tied to the embedding, which save_pretrained writes once)."""
    index = model_dir / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (model_dir / name).is_file():
            raise FileNotFoundError(
                f"{model_dir / name} is missing: the checkpoint is incomplete; resume from "
                "another one (checkpoint.resume=<run>/checkpoints/step_N)."
            )
        state.update(load_file(model_dir / name))
    own = module.state_dict()
    reshaped = [
        f"{key} {tuple(value.shape)} for {tuple(own[key].shape)}"
        for key, value in state.items()
        if key in own and value.shape != own[key].shape
    ]
    loaded = {own[key].data_ptr() for key in state if key in own}
    missing = [key for key in own if key not in state and own[key].data_ptr() not in loaded]
    unexpected = [key for key in state if key not in own]
    if reshaped or missing or unexpected:
        found = ", ".join(
            f"{what} {keys[:3]}"
            for what, keys in (("shapes", reshaped), ("missing", missing), ("unexpected", unexpected))
            if keys
        )
        raise ValueError(
            f"{model_dir} does not hold this model's weights ({found}): resume with the model settings "
            "the checkpoint was trained with (its config.json has them)."
        )
    module.load_state_dict(state, strict=False)


def load_checkpoint(accelerator: Accelerator, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Restore model/optimizer/scheduler/RNG in place; returns (trainer state, this rank's state or None)."""
    hook = functools.partial(_weights_from_model_dir, accelerator, path / "model")
    weights = accelerator.register_load_state_pre_hook(hook)
    try:
        accelerator.load_state(str(path / "accelerator"))
    finally:
        weights.remove()
    rank_file = path / f"rank_{accelerator.process_index}.pt"
    rank_state = torch.load(rank_file, weights_only=False) if rank_file.is_file() else None
    return json.loads((path / STATE_FILE).read_text()), rank_state
