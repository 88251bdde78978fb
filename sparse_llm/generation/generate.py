"""Sample text from a trained checkpoint (generate.py): the quick look at what a run learnt, with the decoding
speed and the FFN path every layer took.

Each prompt is read as the start of a document: training joins documents with the end-of-document token, so
the prompt goes after one. Prompts of different lengths are padded on the left and decoded as one batch.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.evaluation.evaluate import check_kernel, resolve_checkpoint, resolve_device, resolve_dtype
from sparse_llm.ffn import kernel_set
from sparse_llm.generation.config import GenerateConfig
from sparse_llm.generation.decoding import decode
from sparse_llm.model.llama import load_pretrained, sparse_mlps

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """What generate() sampled: one continuation per prompt, and how fast."""

    prompts: list[str]
    continuations: list[str]
    new_tokens: int  # summed over the prompts
    seconds: float  # the whole call: the prompts' forward and the first steps' setup included
    step_ms: float | None  # per decoding step after the first ones (decoding.SETUP_STEPS); None if none ran
    ffn_paths: dict[str, int]  # backend of each FFN layer's last call (a decoding step) -> layers

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def _prompt_list(prompts: Any) -> list[str]:
    listed = [prompts] if isinstance(prompts, str) else list(prompts)
    if not listed or not all(isinstance(p, str) for p in listed):
        raise ValueError(f"prompts={prompts!r}: pass a string or a list of strings (prompts=[first,second])")
    if not all(p.strip() for p in listed):
        # The model would sample from the start of a document with nothing to continue: almost always a prompt
        # lost to shell quoting.
        raise ValueError(
            f'prompts={prompts!r}: a prompt is empty; pass text to continue, e.g. prompts="The" '
            "(quote it for the shell and for Hydra: 'prompts=\"two words\"')"
        )
    return listed


def _check_sampling(cfg: GenerateConfig) -> None:
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={cfg.max_new_tokens} must be at least 1")
    if cfg.temperature < 0:
        raise ValueError(f"temperature={cfg.temperature} must be >= 0 (0 decodes greedily)")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_p={cfg.top_p} must be in (0, 1]")


def encode_prompts(tokenizer: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both int64 [prompts, longest]: each prompt after an end-of-document token,
    padded on the left so that every row's last token is where decoding continues."""
    ids = [[tokenizer.eos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]] for p in prompts]
    longest = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), longest), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(ids):
        input_ids[row, longest - len(tokens) :] = torch.tensor(tokens)
        attention_mask[row, longest - len(tokens) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def generate(cfg: GenerateConfig) -> Generation:
    prompts = _prompt_list(cfg.prompts)
    _check_sampling(cfg)
    model_dir = resolve_checkpoint(cfg.checkpoint)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_kernel(cfg.kernel, device, dtype)
    tokenizer = load_tokenizer(cfg.tokenizer or str(model_dir))
    model = load_pretrained(model_dir, kernel=cfg.kernel, dtype=dtype, device=str(device)).eval()
    kernel_set.warm(model, device, training=False)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but {model_dir} was built for "
            f"{model.config.vocab_size}; pass the tokenizer the model was trained with"
        )

    input_ids, attention_mask = encode_prompts(tokenizer, prompts)
    longest = input_ids.shape[1]
    context = model.config.max_position_embeddings
    if longest + cfg.max_new_tokens > context:
        raise ValueError(
            f"the longest prompt has {longest - 1} tokens; with max_new_tokens={cfg.max_new_tokens} "
            f"that exceeds the model's context of {context}. Shorten it or lower max_new_tokens."
        )

    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    decoded = decode(
        model,
        input_ids,
        attention_mask,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_p,
        end_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        cuda_graph=cfg.cuda_graph,
    )
    new_ids = decoded.new_ids_BT.cpu()
    seconds = time.perf_counter() - start  # .cpu() waited for the GPU

    # A row that ended its document early is padded after its end token: count only what was sampled.
    ended = new_ids == tokenizer.eos_token_id
    first_end = torch.where(ended.any(dim=1), ended.int().argmax(dim=1) + 1, new_ids.shape[1])
    continuations = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new_ids, first_end)]
    paths = collections.Counter(mlp.dispatcher.current for mlp in sparse_mlps(model))
    return Generation(prompts, continuations, int(first_end.sum()), seconds, decoded.step_ms, dict(paths.most_common()))


def report(result: Generation) -> str:
    """The prompts and their continuations, then one line of speed and FFN paths."""
    blocks = [f"--- {prompt}\n{prompt}{text}" for prompt, text in zip(result.prompts, result.continuations)]
    paths = ", ".join(f"{path} x{n}" for path, n in result.ffn_paths.items())
    together = f"{len(result.prompts)} prompts decoded together" if len(result.prompts) > 1 else "one prompt"
    steady = "" if result.step_ms is None else f", then {result.step_ms:.2f} ms a step"
    blocks.append(
        f"{result.new_tokens} new tokens in {result.seconds:.2f} s ({result.tokens_per_s:.1f} tokens/s, "
        f"{together}{steady}); FFN layers on: {paths}"
    )
    return "\n\n".join(blocks)
