"""The model's options (`model.*`, configs/model/<name>.yaml), apart from the model code so that composing a config
imports no torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Architecture of one model size (configs/model/<name>.yaml).

    vocab_size None means "the tokenizer's vocabulary size" (set when the data is known). The defaults are the
    default group's (configs/model/tiny.yaml): a run from a pretrained checkpoint (train.py init=...) reads a field
    that still holds its default as "not given" (`training.init.check_model_config`).
    hidden_act: relu (sparse FFNs), or silu / gelu for a dense baseline (stock LlamaMLP, torch path, no L1 term).
    """

    name: str = "tiny"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: full multi-head attention, as in the paper
    vocab_size: int | None = None
    max_position_embeddings: int = 128
    rope_theta: float = 100000.0  # the released configs use 1e5 (the paper's table says 1e4)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    hidden_act: str = "relu"
