"""Pretrained checkpoint directories read as a stock `LlamaForCausalLM`, and written back as plain HF Llama ones.

What `read_checkpoint` takes (config.json's `model_type`):

    llama               as it is: Llama 2/3, SmolLM2, TinyLlama, and what train.py writes
    llama_sparse_relu   the paper's released checkpoints. The reference code's config class adds `sparsity_*` fields,
                        an `auto_map` to its custom model code, and keeps `hidden_act: "silu"` although its MLP always
                        applies ReLU. Read as LlamaForCausalLM(hidden_act="relu") whose FFN width is
                        `sparsity_new_intermediate_size` where set. Its MLP names its weights as the stock one does
                        (gate_proj, up_proj, down_proj); runs with `sparsity_use_hybrid_kernel` may have saved
                        down_proj transposed ([N, K]), which is turned back.
    mistral             a Llama with sliding-window attention: within the window the two compute alike, so the
                        context is capped at `sliding_window`.

Refused, with the reason: non-gated reference checkpoints (`sparsity_gated_mlp: false`), Qwen2 (biases on q/k/v but
none on o_proj: a Llama attention has all four or none) and Qwen3 (a norm on q and k in every attention layer).

    python -m sparse_llm.model.convert <src> <dst>   # src: a directory or a cached hub id; dst: plain HF Llama
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)

REFERENCE_TYPE = "llama_sparse_relu"
READABLE_TYPES = ("llama", REFERENCE_TYPE, "mistral")
# Why a family that looks close to Llama is not read as one.
REFUSED_TYPES = {
    "qwen2": "Qwen2's attention has biases on q_proj/k_proj/v_proj and none on o_proj; a Llama attention has a bias "
    "on all four or on none",
    "qwen2_sparse_relu": "the reference code's sparse Qwen2 keeps Qwen2's attention: biases on q_proj/k_proj/v_proj "
    "and none on o_proj, which a Llama attention cannot hold",
    "qwen3": "Qwen3 normalises q and k in every attention layer (q_norm, k_norm), which a Llama attention lacks",
}
# config.json keys LlamaConfig reads (older files spell the rotary settings rope_theta / rope_scaling); the rest
# (architectures, auto_map, sparsity_*, sliding_window, ...) describe the source and are dropped.
LLAMA_KEYS = (set(LlamaConfig().to_dict()) | {"rope_theta", "rope_scaling"}) - {
    "model_type",
    "architectures",
    "transformers_version",
    "_name_or_path",
    "dtype",
}
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Files besides the weights that a model directory carries for its users: the tokenizer's and the decoding defaults.
COMPANION_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template*",
    "generation_config.json",
)
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a stock Llama; the message names the field or weight."""


@dataclass
class Checkpoint:
    """A checkpoint directory and how it reads as a stock Llama.

    Attributes:
        path: the directory (config.json, weights, usually the tokenizer).
        config: the LlamaConfig its weights load into.
        model_type: config.json's `model_type`.
        mapping: one sentence on what was mapped to read it as a stock Llama (None for a plain Llama).
        hybrid_layout: written by the reference code with its hybrid training kernel, which may have saved down_proj
            as [N, K]; where N == K the shape cannot tell, and this flag decides.
    """

    path: Path
    config: LlamaConfig
    model_type: str
    mapping: str | None
    hybrid_layout: bool = False

    @property
    def has_tokenizer(self) -> bool:
        return any(
            (self.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )


def resolve_model_dir(name: str, key: str = "init") -> Path:
    """The directory `name` names: a local directory, or a hub id found in the Hugging Face cache (fetched only where
    the hub is not switched off, HF_HUB_OFFLINE=0)."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{key}={name!r} is not a model directory in HF layout (no config.json in it). "
                "Pass a directory holding config.json and the weights, or a hub id."
            )
        return path
    from huggingface_hub import constants, snapshot_download

    try:
        found = Path(
            snapshot_download(name, local_files_only=constants.HF_HUB_OFFLINE, allow_patterns=list(HUB_PATTERNS))
        )
    except Exception as error:  # noqa: BLE001 (not cached, unknown repository, network: one message for all)
        raise FileNotFoundError(
            f"{key}={name!r} is neither a local directory nor a model in the Hugging Face cache ({type(error).__name__}"
            f"). Download it where there is network (`huggingface-cli download {name}`), or set HF_HUB_OFFLINE=0."
        ) from None
    if not (found / "config.json").is_file():
        raise FileNotFoundError(f"{key}={name!r}: the cached snapshot {found} has no config.json.")
    return found


def read_checkpoint(path: str | Path) -> Checkpoint:
    """How the checkpoint directory `path` reads as a stock `LlamaForCausalLM` (its config only, no weights).

    Raises CheckpointError naming the config field that cannot be mapped, FileNotFoundError without config.json."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model directory in HF layout (no config.json).")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    if model_type in REFUSED_TYPES:
        raise CheckpointError(
            f"{config_file}: model_type={model_type!r} is not supported: {REFUSED_TYPES[model_type]}."
            f" Readable: {', '.join(READABLE_TYPES)}."
        )
    if model_type not in READABLE_TYPES:
        raise CheckpointError(
            f"{config_file}: model_type={model_type!r} is not a Llama-architecture model. "
            f"Readable: {', '.join(READABLE_TYPES)}."
        )
    missing = [key for key in REQUIRED_KEYS if not isinstance(raw.get(key), int)]
    if missing:
        raise CheckpointError(f"{config_file} lacks {', '.join(missing)} (an integer each).")
    fields = {key: value for key, value in raw.items() if key in LLAMA_KEYS}
    mapping = None
    if model_type == REFERENCE_TYPE:
        mapping = _reference_fields(raw, fields, config_file)
    elif model_type == "mistral":
        mapping = _mistral_fields(raw, fields)
    if fields.get("mlp_bias"):
        raise CheckpointError(f"{config_file}: mlp_bias=true; the FFN blocks here have no biases.")
    hybrid = model_type == REFERENCE_TYPE and raw.get("sparsity_use_hybrid_kernel") is True
    return Checkpoint(path, LlamaConfig(**fields), model_type, mapping, hybrid)


def _reference_fields(raw: dict[str, Any], fields: dict[str, Any], config_file: Path) -> str:
    """Map the reference code's config fields onto `fields` (in place); returns what was mapped."""
    if raw.get("sparsity_gated_mlp", True) is not True:
        raise CheckpointError(
            f"{config_file}: sparsity_gated_mlp={raw['sparsity_gated_mlp']!r} is a non-gated FFN (relu(x Wu^T) Wd^T); "
            "the models and kernels here are gated (relu(x Wg^T) * x Wu^T) only."
        )
    width = raw.get("sparsity_new_intermediate_size")
    if width is not None:
        if not isinstance(width, int) or width <= 0:
            raise CheckpointError(
                f"{config_file}: sparsity_new_intermediate_size={width!r}; give a positive integer "
                "or null (then intermediate_size holds the FFN width)."
            )
        fields["intermediate_size"] = width
    act = raw.get("hidden_act")
    fields["hidden_act"] = "relu"
    return (
        f"the reference format ({REFERENCE_TYPE}) read as a stock LlamaForCausalLM(hidden_act='relu', "
        f"intermediate_size={fields['intermediate_size']}); its hidden_act={act!r} is a leftover that the "
        "reference MLP never applied"
    )


def _mistral_fields(raw: dict[str, Any], fields: dict[str, Any]) -> str:
    window = raw.get("sliding_window")
    context = fields.get("max_position_embeddings", LlamaConfig().max_position_embeddings)
    if window is None or window >= context:
        return "a Mistral checkpoint read as a stock LlamaForCausalLM (no sliding window applies)"
    fields["max_position_embeddings"] = window
    return (
        f"a Mistral checkpoint read as a stock LlamaForCausalLM with its context capped at sliding_window={window}"
        f" (from {context}): within the window both attend alike"
    )


def read_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the stock Llama names and layouts, checked against its config: a missing,
    misshapen or unknown tensor is a CheckpointError naming it."""
    state = _load_tensors(checkpoint.path)
    state = {key: value for key, value in state.items() if not key.endswith("rotary_emb.inv_freq")}  # older files
    config = checkpoint.config
    with torch.device("meta"):
        expected = {key: tuple(value.shape) for key, value in LlamaForCausalLM(config).state_dict().items()}
    down_KN = (config.hidden_size, config.intermediate_size)
    square = down_KN[0] == down_KN[1]
    transposed = [
        key
        for key, value in state.items()
        if key.endswith("mlp.down_proj.weight")
        and tuple(value.shape) == down_KN[::-1]
        and (not square or checkpoint.hybrid_layout)
    ]
    if transposed:
        # The reference's hybrid training kernel keeps down_proj as [N, K], and its runs saved it so.
        log.info(
            "%s: %d down_proj weights stored as [N, K] (the reference's hybrid-kernel layout), transposed back",
            checkpoint.path,
            len(transposed),
        )
        state.update({key: state[key].t().contiguous() for key in transposed})
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [key for key in expected if key not in state and key not in optional]
    unexpected = [key for key in state if key not in expected]
    misshapen = [
        f"{key} {tuple(state[key].shape)} (config says {expected[key]})"
        for key in expected
        if key in state and tuple(state[key].shape) != expected[key]
    ]
    problems = [
        f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
        for what, keys in (("missing", missing), ("misshapen", misshapen), ("unexpected", unexpected))
        if keys
    ]
    if problems:
        raise CheckpointError(f"{checkpoint.path}: the weights do not fit its config.json ({'; '.join(problems)}).")
    return state


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weight files (one file, or the shards its index lists)."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            break
    else:
        raise CheckpointError(f"{path} has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}).")
    files = [name]
    if name.endswith(".index.json"):
        files = sorted(set(json.loads((path / name).read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not (path / file).is_file():
            raise CheckpointError(f"{path / file} is missing: its index lists it. Download the checkpoint again.")
        if file.endswith(".safetensors"):
            state.update(load_file(path / file))
        else:
            state.update(torch.load(path / file, map_location="cpu", weights_only=True))
    return state


def load_stock(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The checkpoint's model as a stock `LlamaForCausalLM` in `dtype` (no module swapped in)."""
    return LlamaForCausalLM.from_pretrained(
        None, config=checkpoint.config, state_dict=read_weights(checkpoint), dtype=dtype
    )


def stored_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype config.json says the weights were saved in (float32 when it says none)."""
    raw = json.loads((checkpoint.path / "config.json").read_text())
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else torch.float32


def convert(src: str | Path, dst: str | Path) -> Path:
    """Write the checkpoint `src` to `dst` as a plain HF Llama directory (loads with AutoModelForCausalLM, no custom
    code), in its stored dtype, with its tokenizer and generation defaults copied alongside."""
    checkpoint = read_checkpoint(src)
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; pass a new directory.")
    if checkpoint.mapping:
        log.info("%s: %s", checkpoint.path, checkpoint.mapping)
    model = load_stock(checkpoint, stored_dtype(checkpoint))
    model.save_pretrained(dst, safe_serialization=True)
    copied = [
        shutil.copy2(file, dst / file.name)
        for pattern in COMPANION_PATTERNS
        for file in checkpoint.path.glob(pattern)
        if file.is_file() and not (dst / file.name).exists()
    ]
    if not checkpoint.has_tokenizer:
        log.warning(
            "%s holds no tokenizer, and so neither does %s: give the one it was trained with "
            "(data.tokenizer=..., tokenizer=...) wherever it is used.",
            checkpoint.path,
            dst,
        )
    log.info(
        "Wrote %s: a stock LlamaForCausalLM (hidden_act=%s, %d layers, FFN width %d) and %d companion files",
        dst,
        model.config.hidden_act,
        model.config.num_hidden_layers,
        model.config.intermediate_size,
        len(copied),
    )
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_llm.model.convert",
        description="Write a Llama-architecture checkpoint (the paper's released format included) as a plain HF "
        "Llama directory: config.json, model.safetensors and the tokenizer.",
    )
    parser.add_argument("src", help="checkpoint directory, or a hub id in the Hugging Face cache")
    parser.add_argument("dst", help="new output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert(resolve_model_dir(args.src, key="src"), args.dst)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"convert: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
