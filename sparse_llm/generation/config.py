"""Typed configuration schema of generate.py (configs/generate.yaml), registered in Hydra's ConfigStore.

Apart from the generation code (sparse_llm/generation/generate.py) and free of torch and transformers, so that
`generate.py --help`, `--cfg job` and a rejected override answer without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class GenerateConfig:
    """Options of generate.py (configs/generate.yaml).

    Attributes:
        checkpoint: model directory (a run's ``final/``, a run directory or ``checkpoints/step_N``); "" = the
            newest ``outputs/*/final``.
        prompts: one prompt or a list of prompts (``prompts=[a,b]``), decoded together.
        max_new_tokens: tokens to sample after each prompt (fewer if the model ends the document first).
        temperature: softmax temperature; 0 decodes greedily (always the most likely token).
        top_p: nucleus sampling: sample among the most likely tokens whose probabilities sum to top_p.
        seed: random seed of the sampling.
        kernel: FFN backend: auto | torch | twell.
        cuda_graph: on a GPU, replay each decoding step as one CUDA graph (the FFN backends are then chosen once,
            at the first step); false issues every kernel from Python.
        device: auto (cuda if present, else cpu) | cpu | cuda | cuda:N.
        dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16.
        tokenizer: tokenizer to use ("" = the one saved with the checkpoint).
    """

    checkpoint: str = ""
    prompts: Any = "The"
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    kernel: str = "auto"
    cuda_graph: bool = True
    device: str = "auto"
    dtype: str = "auto"
    tokenizer: str = ""


def register_generate_configs() -> None:
    """Register the schema of configs/generate.yaml; call before ``@hydra.main`` runs."""
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)
