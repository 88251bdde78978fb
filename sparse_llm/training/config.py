"""Typed configuration schema of train.py, registered in Hydra's ConfigStore.

Each component's options are a dataclass in a module of its package that imports no torch or transformers
(ModelConfig in model/config.py, DataConfig in data/config.py, LoggingConfig in telemetry/metrics.py; the sparsity
objective's and the trainer's here), so that `train.py --help`, `--cfg job` and a rejected override answer without
loading them; this module assembles them. Hydra merges the YAML files of configs/ onto these dataclasses in struct
mode, so a misspelt key or a value of the wrong type fails at start with a message naming it (train.py first
checks the keys against this schema to name the one a misspelt key resembles: sparse_llm/cli/overrides.py).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from sparse_llm.data.config import DataConfig
from sparse_llm.model.config import ModelConfig
from sparse_llm.telemetry.metrics import LoggingConfig


@dataclass
class SparsityConfig:
    """Options of the sparsity objective (sparse_llm/training/sparsity.py; the coefficient itself is the top-level
    `l1`)."""

    l1_warmup_steps: int = 0  # ramp of the coefficient from 0 over this many optimizer steps
    # The ramp's shape: linear, or sine (l1 * sin(pi/2 * progress): most of the coefficient early, then a slow
    # approach, as ProSparse raises its L1 factor when it sparsifies a pretrained model).
    l1_warmup_shape: str = "linear"
    dead_window_steps: int = 1  # a neuron is dead if it fired for no token over this many steps
    reinit_dead: bool = False  # paper eq. 6, applied at the end of every dead window
    reinit_mix: float = 0.1  # Wg[j] <- (1 - mix) Wg[j] + mix * N(0, reinit_std^2)
    reinit_std: float = 0.02
    # Per-layer weights of the L1 term, moved after every optimizer step by this rate toward equal L0 in all layers
    # (LayerBalance); 0 keeps the plain mean over layers.
    layer_balance: float = 0.0
    layer_balance_max: float = 8.0  # bound on a layer's weight, and its inverse below


@dataclass
class SparsifyConfig:
    """Sparsifying a dense pretrained model (train.py init=... sparsify.relu=true, or recipe=sparsify;
    sparse_llm/training/init.py)."""

    relu: bool = False  # swap the FFN gate's activation (silu, gelu) for ReLU before the first step


@dataclass
class TrainerConfig:
    """Optimisation and loop options (paper defaults: AdamW 0.9/0.95, wd 0.1, lr 1e-3, 600 warm-up steps)."""

    max_steps: int = 1000
    global_batch: int = 512  # sequences per optimizer step, summed over ranks and accumulation steps
    global_batch_tokens: int | None = None  # if set, overrides global_batch (= tokens // seq_len)
    micro_batch: int = 8  # sequences per rank per forward pass
    seq_len: int | None = None  # None: the model's max_position_embeddings
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 600
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # bound on the gradients' global norm (0: no clipping; the norm is still logged)
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer and the dense FFN block (model.compile_layers): fused norms, rotary, residual
    # adds and FFN statistics, less host time per layer; the first step compiles (about a minute on a GPU host).
    # compile_backend: inductor, or aot_eager to trace without generating kernels (to tell a compiler problem from a
    # model one). Not under FSDP.
    compile: bool = False
    compile_backend: str = "inductor"
    # With compile (inductor): replay each layer's compiled parts as CUDA graphs (torch.compile mode
    # "reduce-overhead"), taking their launch work off the host, for steps the host cannot issue as fast as the GPU
    # runs them (sparse FFNs). With several micro-batches a step each one replays the same graphs, and the gradients
    # stay allocated between steps (training.hold_gradients). Not with gradient checkpointing. null (default): on with
    # compile where graphs can run, for a model whose FFN layers may train on the sparse kernels (`graphs_by_default`).
    cuda_graphs: bool | None = None
    mixed_precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | no
    val_every: int = 100  # optimizer steps between validation passes (0: never)
    val_batches: int = 8  # micro-batches per validation pass
    cpu: bool = False  # force CPU even where a GPU is present


@dataclass
class CheckpointConfig:
    every: int = 500  # optimizer steps between checkpoints (0: only the final model)
    keep_last: int = 2  # step checkpoints kept (<= 0: all); older ones go before a new one is written, one stays
    resume: str = ""  # "" (fresh run) | auto (latest checkpoint of this run dir, if any) | <checkpoint path>


@dataclass
class TrainConfig:
    RETIRED: ClassVar[dict[str, str]] = {
        "train_kernels": "kernel=auto trains each layer on the sparse kernels once they are the cheaper path for it "
        "(drop the key); kernel=torch trains dense."
    }

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sparsify: SparsifyConfig = field(default_factory=SparsifyConfig)
    # Start from a pretrained checkpoint (a directory, or a hub id in the Hugging Face cache) instead of random weights:
    # it sets the model's shape and the tokenizer (sparse_llm/training/init.py). A resume takes the run's own weights.
    init: str = ""
    recipe: str = ""  # the configs/recipe/ group applied (recipe=sparsify), as its file records it
    l1: float = 2e-5  # L1 coefficient (normalisation: see sparse_llm/training/sparsity.py)
    kernel: str = "auto"  # auto | torch | twell
    seed: int = 0
    run_name: str = "${launch_stamp:}"  # run directory: outputs/<run_name>


# What each numeric key must hold, checked before anything is built: a value outside it names itself, where it would
# otherwise fail deep in the run (a zero micro-batch divides by zero) or train silently wrong (a negative L1 term).
# Optional keys left at None are not checked.
_RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("trainer.global_batch", lambda v: v >= 1, ">= 1"),
    ("trainer.global_batch_tokens", lambda v: v >= 1, ">= 1, or null to use trainer.global_batch"),
    ("trainer.micro_batch", lambda v: v >= 1, ">= 1"),
    ("trainer.seq_len", lambda v: v >= 1, ">= 1, or null for the model's max_position_embeddings"),
    ("trainer.lr", lambda v: v > 0, "> 0"),
    ("trainer.min_lr_ratio", lambda v: 0 <= v <= 1, "within [0, 1]"),
    ("trainer.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("trainer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("trainer.beta1", lambda v: 0 <= v < 1, "within [0, 1)"),
    ("trainer.beta2", lambda v: 0 <= v < 1, "within [0, 1)"),
    ("trainer.eps", lambda v: v > 0, "> 0"),
    ("trainer.grad_clip", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("trainer.val_every", lambda v: v >= 0, ">= 0 (0: no validation)"),
    ("trainer.val_batches", lambda v: v >= 1, ">= 1"),
    ("checkpoint.every", lambda v: v >= 0, ">= 0 (0: only the final model)"),
    ("l1", lambda v: v >= 0, ">= 0 (0: a dense run)"),
    ("sparsity.l1_warmup_steps", lambda v: v >= 0, ">= 0"),
    ("sparsity.dead_window_steps", lambda v: v >= 1, ">= 1"),
)


def check_ranges(cfg: TrainConfig) -> None:
    """Raise a ValueError naming every numeric key of `cfg` outside its range (`_RANGES`)."""
    bad = []
    for key, holds, allowed in _RANGES:
        value = functools.reduce(getattr, key.split("."), cfg)
        if value is not None and not holds(value):
            bad.append(f"{key}={value} (give a value {allowed})")
    if bad:
        raise ValueError("Out of range: " + "; ".join(bad) + ".")


def launch_stamp() -> str:
    """A timestamp that is identical on every rank of one launch.

    Each rank composes its config separately; a plain `${now:}` can differ by a second between ranks and
    split the run over two directories. Under a launcher all ranks share a parent process, whose start
    time is the stamp.
    """
    start = time.time()
    world, local_world = (int(os.environ.get(k, "1")) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if world > local_world:
        raise ValueError(
            "A run over several machines needs an explicit run_name=<name> (the same on every "
            "machine): the launch time differs between machines."
        )
    if world > 1:
        import psutil

        start = psutil.Process(os.getppid()).create_time()
    return datetime.datetime.fromtimestamp(start).strftime("%Y-%m-%d_%H-%M-%S")


def register_configs() -> None:
    """Register the schema and the resolver; call before `@hydra.main` runs."""
    if not OmegaConf.has_resolver("launch_stamp"):
        OmegaConf.register_new_resolver("launch_stamp", launch_stamp, use_cache=True)
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
