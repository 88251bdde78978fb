"""Checkpoints of a training run: atomic, resumable, with the model in plain HF layout.

Layout of `<run>/checkpoints/step_<N>/`:
    model/              HF layout (config.json + model.safetensors + tokenizer): loads with
                        AutoModelForCausalLM.from_pretrained, no custom code; a resume reads the weights from here
    accelerator/        accelerate's save_state: optimizer, scheduler and RNG states of every rank; the model too
                        under FSDP (sharded), and in checkpoints written before model/ was the only copy
    trainer_state.json  step, tokens seen, per-rank data-loader positions
    rank_<r>.pt         what else each rank needs to continue exactly (its open sparsity windows)
A checkpoint is written under `step_<N>.partial/` and renamed once complete, so a crash mid-write never
leaves a directory that `resume=auto` would pick up.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


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
    """The checkpoint to resume from: None for a fresh run."""
    if resume in ("", "none", "None"):
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a complete checkpoint (no {STATE_FILE} in it). Pass a "
            "'<run>/checkpoints/step_N' directory, or checkpoint.resume=auto with the run's run_name."
        )
    return path


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
    one complete one while it is written (so a crash mid-write still leaves one to resume from). A write that fails
    (a full disk) removes its partial directory and raises CheckpointWriteError saying what to change."""
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process:
        if keep_last > 0:  # room first: a 2B model's checkpoint with its AdamW state is ~25 GB
            for old in list_checkpoints(run_dir)[: -max(keep_last - 1, 1)]:
                shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with written_or_removed(partial, final, run_dir, keep_last):
        skip = accelerator.register_save_state_pre_hook(_skip_model_weights)
        try:
            accelerator.save_state(str(partial / "accelerator"), safe_serialization=True)
        finally:
            skip.remove()
        torch.save(rank_state, partial / f"rank_{accelerator.process_index}.pt")
        export_model(accelerator, model, tokenizer, partial / "model")
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class CheckpointWriteError(RuntimeError):
    """A step checkpoint or the final model could not be written (its partial directory is removed)."""


@contextlib.contextmanager
def written_or_removed(partial: Path, target: Path, run_dir: Path, keep_last: int) -> Iterator[None]:
    """Around the writes into `partial` (renamed to `target`, a step checkpoint or final/, once complete): an OSError
    (a full disk) removes `partial` and becomes a CheckpointWriteError saying what to change."""
    try:
        yield
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(err, target, run_dir, keep_last)) from err


def _write_failure(err: OSError, target: Path, run_dir: Path, keep_last: int) -> str:
    """What a failed write of `target` (a step checkpoint or final/) says: the error, the disk's free space against the
    last checkpoint's size, the checkpoint a resume would start from, and the settings that need less disk."""
    complete = list_checkpoints(run_dir)
    free_gb = shutil.disk_usage(run_dir).free / 1e9
    if complete:
        size_gb = sum(f.stat().st_size for f in complete[-1].rglob("*") if f.is_file()) / 1e9
        last = f"{complete[-1]} ({size_gb:.1f} GB) is complete: checkpoint.resume=auto resumes from it"
    else:
        last = "no complete checkpoint exists yet"
    return (
        f"Writing {target} failed: {err}. {free_gb:.1f} GB are free there; {last}. Free disk space, lower "
        f"checkpoint.keep_last (now {keep_last}: a run holds that many checkpoints between writes, and at least two "
        "while one is written), raise checkpoint.every, or put the run on a larger disk."
    )


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
            raise FileNotFoundError(f"{model_dir / name} is missing: the checkpoint is incomplete; resume from "
                                    "another one (checkpoint.resume=<run>/checkpoints/step_N).")
        state.update(load_file(model_dir / name))
    own = module.state_dict()
    reshaped = [f"{key} {tuple(value.shape)} for {tuple(own[key].shape)}" for key, value in state.items()
                if key in own and value.shape != own[key].shape]
    loaded = {own[key].data_ptr() for key in state if key in own}
    missing = [key for key in own if key not in state and own[key].data_ptr() not in loaded]
    unexpected = [key for key in state if key not in own]
    if reshaped or missing or unexpected:
        found = ", ".join(f"{what} {keys[:3]}" for what, keys in (("shapes", reshaped), ("missing", missing),
                                                                  ("unexpected", unexpected)) if keys)
        raise ValueError(f"{model_dir} does not hold this model's weights ({found}): resume with the model settings "
                         "the checkpoint was trained with (its config.json has them).")
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
