"""Typed configuration schema of eval.py (configs/eval.yaml), registered in Hydra's ConfigStore.

Apart from the evaluation code (sparse_llm/evaluation/evaluate.py) and free of torch, transformers and lm-eval, so
that `eval.py --help`, `--cfg job` and a rejected override answer without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from sparse_llm.data.config import DataConfig
from sparse_llm.telemetry.metrics import LoggingConfig


@dataclass
class HeldOutTaskConfig:
    """The ``heldout_continuation`` benchmark (``heldout.*``).

    Attributes:
        examples: number of examples (at most; fewer if the held-out text has fewer passages).
        context_words: words of passage shown to the model.
        continuation_words: words of each candidate continuation.
        choices: candidates per example (1 true + choices-1 from other documents).
        seed: seed of the example subset, the distractors and the answer positions.
        max_tokens: longest request in tokens (passage + " " + a candidate). None: the evaluated model's
            context length (``max_position_embeddings``; the smallest of ``checkpoint`` and ``compare``).
            Passages that would exceed it lose words from their start, so lm-eval truncates no request.
    """

    examples: int = 300
    context_words: int = 40
    continuation_words: int = 12
    choices: int = 4
    seed: int = 0
    max_tokens: int | None = None


@dataclass
class EvalConfig:
    """Options of eval.py (configs/eval.yaml).

    Attributes:
        checkpoint: model directory in HF layout (a run's ``final/`` or ``checkpoints/step_N/model``; a run
            directory or ``step_N`` directory is resolved to those). "" = the newest ``outputs/*/final``.
        compare: checkpoints evaluated the same way and shown beside the first: one path, a list of
            paths (``compare=[a,b]``) or "" (none).
        tasks: task name, comma-separated names or a list: any lm-eval task, ``heldout_continuation``,
            ``embedded`` (= heldout_continuation), ``paper`` (the paper's seven zero-shot tasks) or ``none``
            (held-out perplexity and sparsity only; needs no lm-eval).
        task_data: task name -> local .json/.jsonl/.parquet file with the split the task evaluates, in the
            schema of its Hugging Face dataset (for machines without the hub). eval.yaml lists the paper's
            tasks with null values, so ``task_data.piqa=<file>`` needs no ``+``; other tasks do.
        kernel: FFN backend: auto | torch | twell.
        batch_size: sequences per forward, for perplexity and for lm-eval.
        device: auto (cuda if present, else cpu) | cpu | cuda | cuda:N.
        dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16.
        limit: score at most this many examples per lm-eval task (None: all). For quick checks only.
        num_fewshot: few-shot examples (None: each task's default, 0 for the paper's tasks).
        seq_len: perplexity window in tokens (None: the model's context length).
        perplexity_tokens: score at most this many held-out tokens (None: all).
        tokenizer: tokenizer to use ("" = the one saved with the checkpoint).
        hub_timeout_s: how long to wait for the Hugging Face hub before failing.
        out: output directory (results.json, the held-out task's data, W&B files).
        heldout: the held-out continuation benchmark.
        data: where the held-out text comes from (its validation split; same keys as train.py's ``data``).
            Unless set on eval.py's command line, the ``data`` section of the checkpoint's run
            (``<run>/.hydra/config.yaml``) replaces eval.yaml's default (embedded).
        logging: W&B settings (``logging.wandb=false`` turns it off).
    """

    checkpoint: str = ""
    compare: Any = ""
    tasks: Any = "embedded"
    task_data: dict[str, str | None] = field(default_factory=dict)
    kernel: str = "auto"
    batch_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    limit: int | None = None
    num_fewshot: int | None = None
    seq_len: int | None = None
    perplexity_tokens: int | None = None
    tokenizer: str = ""
    hub_timeout_s: float = 10.0
    out: str = "outputs/eval/${now:%Y-%m-%d_%H-%M-%S}"
    heldout: HeldOutTaskConfig = field(default_factory=HeldOutTaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_eval_configs() -> None:
    """Register the schema of configs/eval.yaml; call before ``@hydra.main`` runs."""
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
