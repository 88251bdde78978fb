"""Build and load ReLU-gated Llama models whose MLPs are `SparseMLP`s.

A ReGLU Llama is a stock `LlamaForCausalLM` with `hidden_act="relu"`: the model we train is that class
with each `LlamaMLP` swapped for a `SparseMLP` of the same parameter names, so checkpoints are plain HF
Llama checkpoints (`AutoModelForCausalLM.from_pretrained` loads them with no custom code) and sparsity is
a runtime property of the loaded model. A model of another activation (the dense SiLU baseline, a pretrained
model before `swap_to_relu`) keeps the stock `LlamaMLP` and runs on the torch path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaModel,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from sparse_llm.ffn.dispatch import LayerDispatcher
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.ffn.torch_backend import add_linear_
from sparse_llm.ffn.twell.backend import shape_unsupported_reason
from sparse_llm.model.config import ModelConfig
from sparse_llm.model.convert import Checkpoint, load_stock, read_checkpoint
from sparse_llm.model.rope import kernel_applies, rotate_half_qk

log = logging.getLogger(__name__)


def llama_config(cfg: ModelConfig, vocab_size: int | None = None) -> LlamaConfig:
    """The HF config of `cfg`; `vocab_size` fills in a `cfg.vocab_size` of None."""
    vocab = cfg.vocab_size or vocab_size
    if vocab is None:
        raise ValueError("model.vocab_size is unset and no tokenizer size was given; set model.vocab_size=<int>.")
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} is not divisible by model.num_heads={cfg.num_heads}.")
    if cfg.hidden_act not in ACT2FN:
        raise ValueError(
            f"model.hidden_act={cfg.hidden_act!r} is not an activation transformers knows; use relu "
            "(sparse FFNs), silu or gelu (dense baselines)."
        )
    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        vocab_size=vocab,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        attention_bias=False,
        mlp_bias=False,
    )


def model_config_of(config: LlamaConfig, name: str) -> ModelConfig:
    """The ModelConfig that describes the HF config `config` (the inverse of `llama_config`, for the fields a
    ModelConfig holds; a checkpoint may set more, e.g. rope scaling or a head width of its own)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return ModelConfig(
        name=name,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=None if kv_heads in (None, heads) else kv_heads,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=float(config.rope_parameters["rope_theta"]),
        rms_norm_eps=config.rms_norm_eps,
        tie_embeddings=config.tie_word_embeddings,
        init_std=config.initializer_range,
        hidden_act=config.hidden_act,
    )


class FusedRMSNorm(LlamaRMSNorm):
    """`LlamaRMSNorm` through `F.rms_norm`: one fused kernel on CUDA where the stock module runs five.

    Same parameter and math (x / sqrt(mean(x^2) + eps) * weight, statistics in float32). When the input and
    the weight share a dtype (bf16 inference, float32 master weights under autocast) the fused op applies;
    otherwise the stock forward keeps its exact cast order (normalise, cast to the input dtype, then scale).
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            return super().forward(hidden_states)
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)

    def fused_params(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) where this norm of `hidden_states` is F.rms_norm's (what a kernel that stores the rows can
        apply beside them, `SparseMLP`'s next_norm); None where the stock cast order applies."""
        return (self.weight, self.variance_epsilon) if hidden_states.dtype == self.weight.dtype else None


class FusedRopeAttention(LlamaAttention):
    """`LlamaAttention` whose rotary embedding of q and k is one CUDA kernel (`sparse_llm.model.rope`).

    The forward is transformers' (5.x) with the rotation swapped: q and k are rotated in the projections'
    [B, S, heads, D] layout, then viewed as [B, heads, S, D] for the cache and the attention function. Where
    the kernel cannot run (CPU, other dtypes) transformers' own `apply_rotary_pos_emb` does it.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        residual_BSK: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o_proj's output, attention weights); with `residual_BSK` (which the caller gives up) the first is
        residual_BSK + o_proj's output, added in its memory by the projection's GEMM (`torch_backend.add_linear_`)."""
        input_shape = hidden_states.shape[:-1]
        heads_shape = (*input_shape, -1, self.head_dim)
        q_BSHD = self.q_proj(hidden_states).view(heads_shape)
        k_BSHD = self.k_proj(hidden_states).view(heads_shape)
        v_BHSD = self.v_proj(hidden_states).view(heads_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if kernel_applies(q_BSHD, cos):
            q_BSHD, k_BSHD = rotate_half_qk(q_BSHD, k_BSHD, cos, sin)
            q_BHSD, k_BHSD = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2)
        else:
            q_BHSD, k_BHSD = apply_rotary_pos_emb(q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2), cos, sin)
        if past_key_values is not None:
            k_BHSD, v_BHSD = past_key_values.update(k_BHSD, v_BHSD, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out_BSHD, weights = attend(
            self,
            q_BHSD,
            k_BHSD,
            v_BHSD,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out_BSK = out_BSHD.reshape(*input_shape, -1).contiguous()
        if residual_BSK is None:
            return self.o_proj(out_BSK), weights
        residual_MK = residual_BSK.reshape(-1, residual_BSK.shape[-1])
        add_linear_(residual_MK, out_BSK.view(residual_MK.shape[0], -1), self.o_proj.weight, self.o_proj.bias)
        return residual_MK.view(residual_BSK.shape), weights


class FusedDecoderLayer(LlamaDecoderLayer):
    """`LlamaDecoderLayer` (same computation) whose FFN residual add happens in the SparseMLP call: under
    `compile_layers` the layer's graph then ends at the FFN, where tracing stops anyway, instead of a second compiled
    graph that only adds the residual (its own host call forward and backward in every layer), and the sparse
    inference kernels add the residual as they write their output (no pass of its own).

    Without autograd (and outside torch.compile's tracing) the residual adds write into the residual stream's memory:
    the attention's output projection and the dense FFN path's down projection add into it by their GEMMs
    (`torch_backend.add_linear_`), one [M, K] pass less each per layer. The stream after the attention is the layer's
    own; its input it overwrites only with `own_input=True`, which the caller passes when it no longer needs the
    tensor it gave (not when it keeps per-layer hidden states, for example).

    With `next_norm` (the next layer's input norm, or the model's final one) an inference call returns
    (hidden_states, normed): normed is next_norm(hidden_states) where the FFN's kernels wrote it as they stored the
    rows (`SparseMLP`'s next_norm), else None. The next layer takes it as `normed_input` and skips its own input norm,
    a pass over [M, K] that would read the rows back.

    With `defer_ffn_add=True` the layer instead returns (hidden_states, ffn_output) without adding them, and the
    next layer adds its `ffn_output` argument first (`CausalLlamaModel` does this in training). The training kernels
    cannot add the residual as they write y; left to the next layer, the add (a float32 residual stream under
    autocast) fuses into that layer's compiled norm, and the FFN output's gradient arrives from its compiled
    backward already in bf16, instead of two eager passes over [M, K] per layer and step.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        ffn_output: torch.Tensor | None = None,
        defer_ffn_add: bool = False,
        own_input: bool = False,
        normed_input: torch.Tensor | None = None,
        next_norm: FusedRMSNorm | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if ffn_output is not None:  # the previous layer's FFN output, deferred to here
            hidden_states = hidden_states + ffn_output
        if not isinstance(self.mlp, SparseMLP):
            if defer_ffn_add:
                raise ValueError("defer_ffn_add=True needs the layer's MLP to be a SparseMLP (see sparse_llm.sparsify)")
            hidden_states = super().forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            return hidden_states if next_norm is None else (hidden_states, None)
        in_place = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        attend = dict(
            hidden_states=self.input_layernorm(hidden_states) if normed_input is None else normed_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if in_place and own_input:
            hidden_states, _ = self.self_attn(**attend, residual_BSK=hidden_states)
        else:
            attended, _ = self.self_attn(**attend)
            hidden_states = hidden_states + attended
        ffn_input = autocast_input(self.post_attention_layernorm(hidden_states))
        if defer_ffn_add:
            return hidden_states, self.mlp(ffn_input)
        if next_norm is None:
            return self.mlp(ffn_input, residual=hidden_states, residual_writable=in_place)
        handed = next_norm.fused_params(hidden_states) if in_place else None
        if handed is None:
            return self.mlp(ffn_input, residual=hidden_states, residual_writable=in_place), None
        return self.mlp(ffn_input, residual=hidden_states, residual_writable=in_place, next_norm=handed)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on (the dtype every FFN path computes in), else x.

    The FFN paths would cast it themselves, but the SparseMLP call runs outside the layer's compiled graph
    (`compile_layers`): cast here, the cast fuses into the norm's kernel (which then writes bf16) and its backward
    into the norm's backward, instead of two passes of their own over [M, K] in float32 per layer and step."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


# Attention functions that apply the causal mask themselves when given none (`is_causal`).
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


class CausalLlamaModel(LlamaModel):
    """`LlamaModel` whose forward without padding or cache (training, scoring whole sequences) builds no mask.

    Without a cache, transformers' mask builder checks the position ids for packed sequences, and the check reads
    a GPU value on the host: each training forward waited for the GPU to finish the previous step (its optimizer)
    before issuing its first kernel. With no padding mask, cache or given position ids the mask is the plain
    causal one, which sdpa and flash attention apply from `is_causal` when given none: this forward passes none.
    Any other call (padding, caching, another attention function, extra outputs requested) is transformers' own.
    """

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        plain = (
            attention_mask is None
            and position_ids is None
            and past_key_values is None
            and use_cache is False
            and not kwargs
            and not (self.config.output_hidden_states or self.config.output_attentions)
            and self.config._attn_implementation in CAUSAL_WITHOUT_MASK
            and (input_ids is None) != (inputs_embeds is None)
        )
        if not plain:
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_BSK = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_ids = torch.arange(hidden_BSK.shape[1], device=hidden_BSK.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_BSK, position_ids=position_ids)
        layers = self.layers[: self.config.num_hidden_layers]
        common = dict(
            attention_mask=None,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=False,
        )
        # In training each layer leaves its FFN output for the next one to add (FusedDecoderLayer); inference keeps
        # the add in the FFN call, where the sparse inference kernels fold it into their output.
        # Eager inference hands each layer's FFN the next norm (the next layer's input norm, after the last layer the
        # model's), which the sparse kernels write beside the rows they store (FusedDecoderLayer, next_norm).
        fused = all(isinstance(layer, FusedDecoderLayer) and isinstance(layer.mlp, SparseMLP) for layer in layers)
        defer = torch.is_grad_enabled() and fused
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        hand_norms = (
            not torch.is_grad_enabled()
            and fused
            and all(layer.mlp.compile_backend is None for layer in layers)
            and all(isinstance(norm, FusedRMSNorm) for norm in norms)
        )
        ffn_output_BSK = normed_BSK = None
        for i, layer in enumerate(layers):
            own_input = i > 0 or inputs_embeds is None  # a layer's output only the next one reads; not the caller's
            if defer:
                hidden_BSK, ffn_output_BSK = layer(hidden_BSK, ffn_output=ffn_output_BSK, defer_ffn_add=True, **common)
            elif hand_norms:
                hidden_BSK, normed_BSK = layer(
                    hidden_BSK, own_input=own_input, normed_input=normed_BSK, next_norm=norms[i], **common
                )
            else:
                hidden_BSK = layer(hidden_BSK, own_input=own_input, **common)
        if ffn_output_BSK is not None:
            hidden_BSK = hidden_BSK + ffn_output_BSK
        last_BSK = self.norm(hidden_BSK) if normed_BSK is None else normed_BSK
        return BaseModelOutputWithPast(last_hidden_state=last_BSK, past_key_values=None)


# transformers looks up what a model can record (output_hidden_states=True, ...) by the name of the class it was built
# as; the swapped-in class records what LlamaModel does.
_CAN_RECORD_REGISTRY[str(CausalLlamaModel)] = LlamaModel._can_record_outputs


# Modules `sparsify` gives a faster forward by a class swap: same attributes, parameters and state-dict keys.
FUSED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    LlamaRMSNorm: FusedRMSNorm,
    LlamaAttention: FusedRopeAttention,
    LlamaModel: CausalLlamaModel,
    LlamaDecoderLayer: FusedDecoderLayer,
}


def sparsify(model: LlamaForCausalLM, kernel: str = "auto") -> LlamaForCausalLM:
    """Swap every `LlamaMLP` of `model` for a `SparseMLP` that reuses the same weight tensors, and each
    module of `FUSED_CLASSES` for its fused twin (in place; parameters and state-dict keys are unchanged).
    kernel: every layer's backend choice (`LayerDispatcher`)."""
    if model.config.hidden_act != "relu":
        raise ValueError(
            f"The model's hidden_act is {model.config.hidden_act!r}; sparse FFNs need a ReLU gate "
            "(hidden_act='relu'). Sparsify it first: python train.py init=<its directory> recipe=sparsify."
        )
    for layer in model.model.layers:
        old = layer.mlp
        if isinstance(old, SparseMLP):
            old.dispatcher = LayerDispatcher(kernel)
            continue
        if getattr(old.gate_proj, "bias", None) is not None:
            raise ValueError("SparseMLP has no biases; this checkpoint has mlp_bias=True.")
        with torch.device("meta"):  # its own Linear layers are replaced at once: don't allocate or init them
            new = SparseMLP(old.hidden_size, old.intermediate_size, kernel)
        new.gate_proj, new.up_proj, new.down_proj = old.gate_proj, old.up_proj, old.down_proj
        layer.mlp = new
    return fuse_layers(model)


def fuse_layers(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Swap each module of `FUSED_CLASSES` for its fused twin (in place; parameters and state-dict keys unchanged)."""
    for module in model.modules():
        fused = FUSED_CLASSES.get(type(module))
        if fused is not None:
            module.__class__ = fused  # same attributes; only the forward differs
    # The unit that must stay on one device (and that FSDP wraps when its config names no class) is now the fused
    # layer: the stock name would match no module.
    model._no_split_modules = [FusedDecoderLayer.__name__]
    return model


def prepare_model(model: LlamaForCausalLM, kernel: str = "auto") -> LlamaForCausalLM:
    """`sparsify` a ReLU model; a model of another activation (a dense baseline) keeps its `LlamaMLP`s, which run
    on the torch path, and only its other modules are fused: kernel=twell is an error for it."""
    if model.config.hidden_act == "relu":
        return sparsify(model, kernel)
    if kernel == "twell":
        raise ValueError(
            f"kernel=twell needs a ReLU model; this one has hidden_act={model.config.hidden_act!r}, whose "
            "dense FFNs run on the torch path only. Use kernel=auto or kernel=torch, or sparsify it "
            "first (recipe=sparsify)."
        )
    return fuse_layers(model)


def swap_to_relu(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Make a dense model's FFN gate a ReLU (in place, weights unchanged): the start of sparsifying it."""
    for layer in model.model.layers:
        layer.mlp.act_fn = ACT2FN["relu"]
    model.config.hidden_act = "relu"
    return model


def kernel_width_note(config: LlamaConfig, kernel: str) -> str | None:
    """None where the sparse kernels take the model's widths, else why they do not: an error for kernel=twell (which
    would fail at the first forward), a note to log for kernel=auto (whose layers then stay on the torch path)."""
    if config.hidden_act != "relu":
        return None
    reason = shape_unsupported_reason(config.hidden_size, config.intermediate_size)
    if reason is None:
        return None
    if kernel == "twell":
        raise ValueError(
            f"kernel=twell cannot run this model: {reason}. Use kernel=auto or kernel=torch (the torch "
            "path takes any width)."
        )
    return f"the sparse kernels will not run on this model ({reason}): every FFN layer takes the torch path"


def build_model(cfg: ModelConfig, vocab_size: int | None = None, kernel: str = "auto") -> LlamaForCausalLM:
    """A freshly initialised sparse Llama (weights ~ N(0, init_std^2), as in the paper); kernel as `sparsify` takes
    it.

    Build it under `torch.device("meta")` to count parameters without allocating them.
    """
    model = LlamaForCausalLM(llama_config(cfg, vocab_size))
    return prepare_model(model, kernel)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """`convert.read_checkpoint`, logging in one line what it mapped to read the directory as a stock Llama."""
    checkpoint = read_checkpoint(path)
    if checkpoint.mapping:
        log.info("%s: %s", checkpoint.path, checkpoint.mapping)
    return checkpoint


def load_pretrained(
    path: str | Path, kernel: str = "auto", dtype: torch.dtype | None = None, device: str | None = None
) -> LlamaForCausalLM:
    """Load a ReLU checkpoint (ours, any ReLU Llama, the paper's released format: `sparse_llm.model.convert`) and
    make its MLPs sparse."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a model directory in HF layout (no config.json). Pass a run's `final/` or "
            "`checkpoints/step_N/model` directory."
        )
    checkpoint = open_checkpoint(path)
    note = kernel_width_note(checkpoint.config, kernel)
    if note:
        log.warning("%s: %s", path, note)
    model = load_stock(checkpoint, dtype or torch.float32)
    if device is not None:
        model.to(device)
    return sparsify(model, kernel)


def compile_layers(model: LlamaForCausalLM, backend: str = "inductor", cuda_graphs: bool = False) -> LlamaForCausalLM:
    """torch.compile every decoder layer in place (`nn.Module.compile`; parameters and state-dict keys unchanged).

    A layer's norms, attention (projections, rotary embedding, the attention kernel) and residual adds become a
    few fused kernels behind one host call, forward and backward; its `SparseMLP` runs eagerly in between (its
    forward is excluded from tracing: the backend choice is host-side state), so every FFN backend works as it does
    without compiling, and the torch backend compiles its own block (`torch_backend.dense_block`). The layers share
    their compiled code: the first call compiles it once (a minute or so on a GPU host, `backend="aot_eager"`
    traces without generating kernels, for debugging).
    """
    for layer in model.model.layers:
        layer.compile(backend=backend, mode="reduce-overhead" if cuda_graphs else None)
        if isinstance(layer.mlp, SparseMLP):
            layer.mlp.compile_backend = backend
    return model


def sparse_mlps(model: nn.Module) -> list[SparseMLP]:
    """The model's SparseMLP modules in layer order (works through DDP/FSDP wrappers)."""
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())
