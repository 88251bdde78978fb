"""Runs that start from a pretrained checkpoint (train.py init=<directory or hub id>), and sparsifying a dense one.

The checkpoint decides the model: its shape (a `model=` or `model.*` setting that disagrees is an error), its
weights, and the tokenizer the data is tokenized with (a `data=tokens` file made with another tokenizer is an
error). Any checkpoint `sparse_llm.model.convert` reads will do: Llama 2/3, SmolLM2, TinyLlama, Mistral, the
paper's released ones. A resumed run takes its weights from its own checkpoint, never from the init.

`sparsify.relu=true` (or recipe=sparsify, which also sets continued-training defaults) turns a dense model's SiLU or
GELU gate into a ReLU before training; the L1 term and its warm-up then make the activations sparse (ProSparse-style
progressive L1: sparsity.l1_warmup_shape=sine). The run logs, at step 0, the dense source model's validation CE
(`val/ce_dense_source`) beside the swapped model's (`val/ce`), on the same batches.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from transformers import LlamaForCausalLM

from sparse_llm.data.pipeline import DataConfig
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.model.convert import Checkpoint, load_stock, resolve_model_dir
from sparse_llm.model.llama import ModelConfig, model_config_of, open_checkpoint

log = logging.getLogger(__name__)


# ModelConfig fields a checkpoint fixes (name and init_std describe the run, not the weights).
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "tie_embeddings",
    "hidden_act",
)


def open_init(init: str) -> Checkpoint:
    """The checkpoint that `init` (a directory or a cached hub id) names, read as a stock Llama (config only)."""
    return open_checkpoint(resolve_model_dir(init, key="init"))


def _field(cfg: ModelConfig, name: str) -> Any:
    if name == "num_kv_heads":  # None means as many as the query heads
        return cfg.num_kv_heads or cfg.num_heads
    return getattr(cfg, name)


def checked_model_config(given: ModelConfig, checkpoint: Checkpoint, init: str) -> ModelConfig:
    """The ModelConfig of the checkpoint's model. A field of `given` that differs from it and from its default (the
    default group's, configs/model/tiny.yaml) was set by the user: a ValueError names every such field."""
    found = model_config_of(checkpoint.config, name=checkpoint.path.name)
    default = ModelConfig()
    conflicts = [
        f"model.{name}={_field(given, name)!r} (the checkpoint has {_field(found, name)!r})"
        for name in SHAPE_FIELDS
        if _field(given, name) != _field(found, name) and _field(given, name) != _field(default, name)
    ]
    if conflicts:
        raise ValueError(
            f"init={init}: the model comes from the checkpoint, and the model settings disagree with it: "
            f"{'; '.join(conflicts)}. Drop the model=/model.* overrides; the checkpoint's config.json "
            "sets the shape."
        )
    return dataclasses.replace(found, init_std=given.init_std)


def choose_tokenizer(data: DataConfig, checkpoint: Checkpoint) -> None:
    """Point `data` at the checkpoint's tokenizer (in place). A token file keeps the tokenizer it records, which
    `check_tokenizer` compares with the checkpoint's once loaded."""
    if data.name == "tokens":
        return
    if not checkpoint.has_tokenizer:
        log.warning(
            "init: %s holds no tokenizer; the data is tokenized with data.tokenizer=%s, which must be the "
            "one the checkpoint was trained with.",
            checkpoint.path,
            data.tokenizer,
        )
        return
    if data.tokenizer != str(checkpoint.path):
        log.info(
            "init: tokenizing the data with the checkpoint's tokenizer (%s), not data.tokenizer=%s",
            checkpoint.path,
            data.tokenizer,
        )
    data.tokenizer = str(checkpoint.path)


def check_tokenizer(tokenizer: Any, data: DataConfig, checkpoint: Checkpoint) -> None:
    """Raise ValueError where the data's tokenizer cannot feed the checkpoint's model: more entries than its
    embedding, or (a token file) a vocabulary other than the checkpoint's own tokenizer's."""
    if data.name == "tokens" and checkpoint.has_tokenizer:
        own = load_tokenizer(str(checkpoint.path))
        if own.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"data.paths={data.paths[0]} was tokenized with {tokenizer.name_or_path} ({len(tokenizer)} entries), "
                f"not with the tokenizer of init's checkpoint {checkpoint.path} ({len(own)} entries). Tokenize the "
                f"corpus with it: scripts/tokenize_corpus.py data.tokenizer={checkpoint.path} ..."
            )
    if len(tokenizer) > checkpoint.config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} entries, more than the {checkpoint.config.vocab_size} "
            f"rows of the embedding of {checkpoint.path}: use the tokenizer the checkpoint was trained "
            "with."
        )


def stock_model(checkpoint: Checkpoint, weights: bool) -> LlamaForCausalLM:
    """The checkpoint's model as a stock fp32 `LlamaForCausalLM`: its weights, or (`weights=False`, for a resumed run
    whose own checkpoint holds them) freshly initialised ones."""
    if weights:
        return load_stock(checkpoint, torch.float32)
    return LlamaForCausalLM(checkpoint.config)
