"""The model a benchmark measures: built or loaded, made sparse on request, and switched between FFN paths.

`make_sparse` gives a random-init model a chosen number of non-zeros per token without changing any cost of the
dense path. Llama MLPs have no bias, so a constant input feature stands in for one, with a negative weight on it
in every gate row:
1. Feature 0 of the residual stream is made constant: embedding column 0 is set to the init std c, and row 0 of
   every attention o_proj and MLP down_proj is zeroed, so no layer writes to it. (With tied embeddings this adds
   c * h[0] to every logit of a token, which leaves the softmax unchanged.)
2. After RMSNorm the MLP input's feature 0 is s_m = c * w_norm[0] / rms(h_m) > 0: constant up to the token's
   residual norm. Setting gate_proj.weight[:, 0] = -t shifts every gate pre-activation of token m down by t * s_m.
3. t is solved per layer by bisection on the layer's real inputs so that the mean count of positive gate
   pre-activations per token is T (calibrated in one forward pass, in layer order, so each layer sees the
   already-sparse outputs of the layers before it). Tokens with a small residual norm get a larger shift, so L0
   varies across tokens; the benchmarks report the p99 and max that result.
The model's function changes, which is irrelevant for speed; L0 is always measured, never assumed.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from sparse_llm.bench.timing import l0_summary
from sparse_llm.data.pipeline import read_token_file
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.ffn.backend import Tail
from sparse_llm.ffn.dispatch import density_of
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.ffn.registry import get_backend
from sparse_llm.ffn.twell.graphs import release_graphs
from sparse_llm.ffn.twell.validation import shape_unsupported_reason
from sparse_llm.model.llama import (
    FUSED_CLASSES,
    ModelConfig,
    build_model,
    load_pretrained,
    sparse_mlps,
    sparsify,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model"
SIZES = ("tiny", "0.5b", "1b", "1.5b", "2b")
STOCK = "stock"  # transformers' LlamaMLP and stock modules: the plain dense baseline
CALIBRATION_TOKENS = 8192  # tokens per layer used to solve the gate shift (more adds nothing but memory)


@dataclass
class LayerStats:
    """Sparsity and path of one FFN layer in its latest call."""

    l0_mean: float
    l0_p99: float
    l0_max: float
    path: str
    overflow_rows: int
    tail: Tail  # the heavy tokens' shares of the layer's tokens and non-zeros


def size_config(size: str, vocab_size: int | None) -> ModelConfig:
    """The `model:` section of configs/model/<size>.yaml; a null vocabulary takes `vocab_size` or the
    embedded tokenizer's size (the one the tiny default run trains with)."""
    path = CONFIGS / f"{size}.yaml"
    if not path.is_file():
        raise ValueError(f"--size {size}: no {path}; choose one of {list(SIZES)} or pass --checkpoint.")
    section = OmegaConf.to_container(OmegaConf.load(path).model, resolve=True)
    cfg = ModelConfig(**section)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    elif cfg.vocab_size is None:
        cfg.vocab_size = len(load_tokenizer("embedded"))
    return cfg


def load_model(
    device: torch.device, *, checkpoint: str | None, size: str | None, vocab_size: int | None, seed: int
) -> LlamaForCausalLM:
    """The model of `checkpoint`, or a random-init `size` model, in fp32 on `device` (fp32 is the master copy that
    training starts from)."""
    torch.manual_seed(seed)
    if checkpoint:
        return load_pretrained(checkpoint, kernel="torch", dtype=torch.float32, device=str(device))
    with torch.device(device):
        return build_model(size_config(size, vocab_size), kernel="torch")


def decoder_layers(model: LlamaForCausalLM) -> nn.ModuleList:
    return model.model.layers


def forward_with_mlp_hooks(
    model: LlamaForCausalLM, input_ids: torch.Tensor, hook_for: Callable[[int], Callable[..., None]]
) -> None:
    """One core-model forward of input_ids [B, T] (no lm_head) with hook_for(i) as a forward pre-hook on layer i's
    MLP, removed afterwards: the hook sees each layer's FFN input as the model computes it."""
    layers = decoder_layers(model)
    handles = [layer.mlp.register_forward_pre_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        model.model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def model_and_batch(
    device: torch.device,
    *,
    checkpoint: str | None,
    size: str | None,
    vocab_size: int | None,
    seed: int,
    batch: int,
    seq_len: int,
    tokens: str | None,
    density_l0: float | None,
) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """(model in eval mode, input_ids [batch, seq_len] on `device`) for a study of one forward pass: the model as
    `load_model` builds it, made sparse to `density_l0` if given (random-init models), and `make_inputs`' batch."""
    model = load_model(device, checkpoint=checkpoint, size=size, vocab_size=vocab_size, seed=seed).eval()
    input_ids = make_inputs(batch, seq_len, model.config.vocab_size, tokens=tokens, seed=seed).to(device)
    if density_l0 is not None:
        make_sparse(model, density_l0, input_ids[: max(1, CALIBRATION_TOKENS // seq_len)])
    return model, input_ids


@torch.no_grad()
def make_sparse(model: LlamaForCausalLM, target_l0: float, input_ids: torch.Tensor) -> list[float]:
    """Give a random-init model ~`target_l0` positive gate pre-activations per token in every layer.

    See the module docstring for the construction. input_ids [B, T] is the calibration batch. Returns
    the gate shift t of each layer.
    """
    layers = decoder_layers(model)
    n = layers[0].mlp.intermediate_size
    if not 0 < target_l0 < n / 2:
        raise ValueError(f"--density-l0 {target_l0}: use a mean non-zero count in (0, {n // 2}) (FFN width {n}).")
    c = model.config.initializer_range
    model.model.embed_tokens.weight[:, 0] = c
    for layer in layers:
        layer.self_attn.o_proj.weight[0].zero_()
        layer.mlp.down_proj.weight[0].zero_()
        if layer.post_attention_layernorm.weight[0] <= 0:
            raise ValueError(
                "make_sparse needs a positive post-attention norm weight on feature 0 (random init has 1)."
            )

    shifts: list[float] = []

    def calibrate(mlp: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x_MK = args[0].reshape(-1, args[0].shape[-1])[:CALIBRATION_TOKENS].float()
        w_NK = mlp.gate_proj.weight.float()
        z_MN = x_MK[:, 1:] @ w_NK[:, 1:].T  # pre-activations without the shift feature
        s_M1 = x_MK[:, :1]
        lo, hi = 0.0, float(z_MN.abs().max() / s_M1.min()) + 1.0  # at hi no pre-activation is positive
        for _ in range(50):
            t = (lo + hi) / 2
            l0 = (z_MN > t * s_M1).sum(dim=1, dtype=torch.float32).mean().item()
            lo, hi = (t, hi) if l0 > target_l0 else (lo, t)
        mlp.gate_proj.weight[:, 0] = -hi
        shifts.append(hi)

    forward_with_mlp_hooks(model, input_ids, lambda _: calibrate)
    return shifts


# The SparseMLP each decoder layer had before `use_stock_modules`, restored by `set_kernel` (no new weights).
_SPARSE_MLPS: weakref.WeakKeyDictionary[nn.Module, SparseMLP] = weakref.WeakKeyDictionary()


def use_stock_modules(model: LlamaForCausalLM) -> None:
    """Swap every SparseMLP for transformers' LlamaMLP on the same Linear modules, and every fused module
    back to its stock class (in place): transformers' own model on the same weights."""
    stock_classes = {fused: stock for stock, fused in FUSED_CLASSES.items()}
    for module in model.modules():
        module.__class__ = stock_classes.get(type(module), type(module))
    for layer in decoder_layers(model):
        old = layer.mlp
        if not isinstance(old, SparseMLP):
            continue
        with torch.device("meta"):  # its own Linear layers are replaced at once: allocate nothing
            new = LlamaMLP(model.config)
        new.gate_proj, new.up_proj, new.down_proj = old.gate_proj, old.up_proj, old.down_proj
        _SPARSE_MLPS[layer] = old
        layer.mlp = new


def set_kernel(model: LlamaForCausalLM, kernel: str, observed: list[LayerStats] | None) -> None:
    """Route every FFN through `kernel` (or the stock MLP); `auto` layers decide from `observed`.

    Self-observation is switched off so that no layer changes its mind (or syncs the host) mid-timing.
    """
    if kernel == STOCK:
        use_stock_modules(model)
        return
    for layer in decoder_layers(model):
        if layer in _SPARSE_MLPS:  # it shares its Linear modules (and so any dtype change) with the stock MLP
            layer.mlp = _SPARSE_MLPS.pop(layer)
    sparsify(model, kernel)  # resets each layer's dispatcher
    for i, mlp in enumerate(sparse_mlps(model)):
        mlp.self_observe = False
        if observed is not None:
            mlp.dispatcher.observe(observed[i].l0_mean, observed[i].l0_max, observed[i].tail)


def layer_stats(model: LlamaForCausalLM) -> list[LayerStats]:
    """Each SparseMLP's L0 and path in its last call (which must have recorded statistics)."""
    stats = []
    for mlp in sparse_mlps(model):
        result = mlp.last_result
        mean, p99, top = l0_summary(result.l0_M)
        stats.append(LayerStats(mean, p99, top, result.path, result.dense_rows(), density_of(result.l0_M)[2]))
    return stats


def kernel_unavailable_reason(kernel: str, model: LlamaForCausalLM, device: torch.device) -> str | None:
    """Why a forced kernel cannot run this model here (None if it can); `stock`, `auto` and `torch` always run."""
    if kernel in (STOCK, "torch", "auto"):
        return None
    reason = get_backend(kernel).unavailable_reason(device)
    if reason is None and kernel == "twell":
        reason = shape_unsupported_reason(model.config.hidden_size, model.config.intermediate_size)
    return reason


def make_inputs(rows: int, seq_len: int, vocab_size: int, *, tokens: str | None = None, seed: int = 0) -> torch.Tensor:
    """[rows, seq_len] token ids: uniform random ids (seeded), or consecutive blocks of the token file `tokens`."""
    if not tokens:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    _meta, train, val = read_token_file(tokens)
    source = val if len(val) >= rows * seq_len else train
    if len(source) < rows * seq_len:
        raise ValueError(f"--tokens {tokens}: {len(source)} tokens, fewer than {rows} x {seq_len}.")
    ids = source.blocks(range(0, rows * seq_len, seq_len), seq_len)
    if int(ids.max()) >= vocab_size:
        raise ValueError(f"--tokens {tokens} holds ids >= the model's vocabulary ({vocab_size}): wrong tokenizer.")
    return ids


def free_memory(model: LlamaForCausalLM, device: torch.device) -> None:
    """Drop what a variant's calls left in the model and return its cached GPU blocks, so each variant's peak
    starts from the same state. Each SparseMLP keeps its last call's result, whose L1 sum holds that call's
    autograd graph until a backward frees it: after a step that ran out of memory midway, the whole step's saved
    activations, which the next variant would otherwise start with."""
    for mlp in sparse_mlps(model):
        mlp.last_result = None
    release_graphs()  # the training op's forward graphs and their buffers
    if device.type == "cuda":  # gc.collect() takes seconds in a big process: only where memory is measured
        gc.collect()
        torch.cuda.empty_cache()
