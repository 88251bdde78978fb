"""Whole-model benchmark: dense FFNs vs the sparse kernels, same process, same weights, same inputs.

    python scripts/bench_model.py --size 2b --density-l0 24                   # random 2b model, ~24 nnz/token
    python scripts/bench_model.py --checkpoint outputs/<run>/final --tokens data/fineweb   # a trained model
    python scripts/bench_model.py --size tiny --seq-len 64 --batch 2 --reps 2   # CPU smoke run

Options: --batch 8 --seq-len 2048 (forward and training micro-batch), --train-batch (default --batch),
--modes forward,train, --markdown BENCHMARKS.md (append the report), --json (all numbers),
--kernels (which variants, default all four), --max-train-batch (also find the largest training
micro-batch each path fits, growing by half up to this), --accumulate (training micro-batches per optimizer step),
--tokens (inputs from a token file), --profile-dir (a torch.profiler trace and top-kernel table per variant, to see
inside the breakdown), --grad-ckpt, --energy-seconds, --warmup, --reps, --l1, --lr, --seed, --device; `--help`
describes each.

What is measured, per mode and per FFN path: `stock` (transformers' own LlamaMLP, LlamaRMSNorm and
LlamaAttention on the same weights: the plain dense model, no sparsity statistics and no L1 term, i.e.
the paper's non-sparse baseline), `torch` (our model on the dense torch backend: SparseMLP, which also
computes L0/L1 statistics, FusedRMSNorm and FusedRopeAttention), `auto` (each layer picks by the cost
model from the L0 it showed on the `torch` pass) and `twell` (forced; inference only, where the TwELL
kernels can run). Speeds are given as ratios to both dense paths:
- forward: the core model (embeddings + decoder layers + final norm, no lm_head, no KV cache) on
  batch x seq_len tokens in bf16 under inference_mode, as the paper's throughput numbers are taken.
- train: one full step at the same micro-batch, as train.py runs it on a GPU: fp32 master weights,
  bf16 autocast, loss = CE + l1 * L1 term, backward, gradient clipping, AdamW step (skipped on the
  device if the loss or norm is not finite), then the previous step's loss and gradient norm read on the
  host (the trainer's one wait per step); steps issued back to back, as the trainer does, so the host can
  run up to a step ahead of the device. With --accumulate A, a step is A forward + backward passes over the
  micro-batch (each loss divided by A, as train.py divides it by global_batch / micro_batch) and one optimizer
  step: the optimizer's fixed cost is shared by A micro-batches' tokens, as in a run whose global batch holds A
  micro-batches per GPU (the paper's 512 sequences on 8 GPUs at 8 each: A = 8).
- tokens/ms from the median of CUDA-event timings after warm-up; the ratio to the dense path of the
  same run; peak allocated memory (resident weights included; in train mode also gradients and AdamW
  state); energy per token from the NVML counter over >= --energy-seconds of back-to-back calls
  (omitted on CPU or without pynvml); per-layer L0 (mean / p99 / max non-zeros of h per token on the
  benchmark inputs) and the path each layer took in its last call (with rows rerouted to the dense path).
- a time breakdown from CUDA events around the attention and FFN modules (a separate pass, so the
  events cost the throughput numbers nothing): attention, FFN gate GEMM (the [M, K] x [K, N] cuBLAS
  GEMM timed alone, times the layer count; both paths run it), the rest of the FFN (dense: up and
  down GEMMs; sparse: packing, sparse up/down, rerouted rows, statistics; in train mode also autocast's
  weight casts), other forward work (norms, embeddings, residuals, loss), and in train mode backward
  (with any gradient-checkpointing recomputation) and optimizer (gradient clipping + AdamW). Eager layers
  only: hooks around modules would split compiled graphs.
- on a GPU, the device time of one profiled call per kernel family (GEMMs, attention, the sparse FFN
  kernels, the optimizer, CUDA graphs' input copies, kernels fused by torch.compile, sorts, other;
  `benchmark.kernel_family`), the
  time any device work ran ("busy") and the rest of the timed call's median ("idle": the device waited
  for the host, so a faster host or fewer host calls would gain it). Compiled layers included.
In train mode `twell` runs once the twell backend takes training=True (until then the row says why it
was skipped), and `auto` takes a sparse path only where the backend's cost model offers one for
training; the per-layer paths in the report show what each layer ran.

Random-init models (--size) are dense-ish (half the gate pre-activations are positive). --density-l0 T
makes them sparse without changing any cost of the dense path: Llama MLPs have no bias, so we build a
constant input feature and give every gate row a negative weight on it.
1. Feature 0 of the residual stream is made constant: embedding column 0 is set to the init std c, and
   row 0 of every attention o_proj and MLP down_proj is zeroed, so no layer writes to it. (With tied
   embeddings this adds c * h[0] to every logit of a token, which leaves the softmax unchanged.)
2. After RMSNorm the MLP input's feature 0 is s_m = c * w_norm[0] / rms(h_m) > 0: constant up to the
   token's residual norm. Setting gate_proj.weight[:, 0] = -t shifts every gate pre-activation of
   token m down by t * s_m.
3. t is solved per layer by bisection on the layer's real inputs so that the mean count of positive
   gate pre-activations per token is T (calibrated in one forward pass, in layer order, so each layer
   sees the already-sparse outputs of the layers before it). Tokens with a small residual norm get a
   larger shift, so L0 varies across tokens; the report states the p99 and max that result.
The model's function changes, which is irrelevant for speed; L0 is always measured, never assumed.

Real sparsity at the paper's shapes (24-40 non-zeros per token per layer), reproducibly, in minutes of
GPU time: train from scratch with a larger L1 coefficient than the paper's 2e-5 so that L0 falls within
a few hundred steps, watch the per-layer L0 in the run's metrics.jsonl (keys `l0/layer_NN`, `l0/mean`,
`l0_p99/...`, `l0_max/...`), then benchmark the checkpoint on held-out text:

    python scripts/tokenize_corpus.py --out data/embedded      # the shipped corpus (or a fineweb_edu file)
    python train.py model=2b l1=5e-4 train_kernels=true data=tokens 'data.paths=[data/embedded.bin]' \\
        trainer.max_steps=200 trainer.global_batch=8 trainer.micro_batch=4 trainer.warmup_steps=50 seed=0
    python scripts/bench_model.py --checkpoint outputs/<run>/final --tokens data/embedded --batch 8

(`bash scripts/real_sparsity_run.sh` runs these three steps, resuming the training when re-run.)
Measured on an H100 (BENCHMARKS.md, 2026-11-27): the training takes 4 minutes (34.5k tokens/s with the sparse
training kernels, their compilation included) and ends at L0 17-25 per token in four runs of the same seed (code
changes between them, enough for the trajectories to part; 24.4-30.3 on this script's inputs), 30 with l1=4e-4 and
seed=1.
On the 1B shape l1=5e-4 gave 22 on data/embedded, and l1=2e-4 gave 25-30 on data/docs but 127 on data/embedded.
Raise L1 if `l0/mean` is still above ~40 when it stops falling, lower it if it drops under ~24; record the value,
steps and seed used next to the numbers.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import itertools
import json
import math
import statistics
import sys
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from sparse_llm.ffn.backend import Tail
from sparse_llm.ffn.registry import get_backend
from sparse_llm.bench.timing import (
    KERNEL_FAMILIES,
    Clock,
    PeakMemory,
    SectionTimer,
    device_ms_by_family,
    energy_mj_per_call,
    hardware_summary,
    l0_summary,
    profile_once,
    time_ms,
    time_samples_ms,
)
from sparse_llm.training.config import TrainConfig
from sparse_llm.data.pipeline import read_token_file
from sparse_llm.ffn.dispatch import density_of
from sparse_llm.telemetry.energy import EnergyMeter
from sparse_llm.ffn.mlp import SparseMLP, recording_statistics
from sparse_llm.model.llama import (
    FUSED_CLASSES,
    ModelConfig,
    build_model,
    compile_layers,
    load_pretrained,
    sparse_mlps,
    sparsify,
)
from sparse_llm.training.sparsity import l1_term
from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.ffn.twell.graphs import release_graphs
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.training.trainer import (
    FrozenHeap,
    HostCopy,
    defer_clipping,
    hold_gradients_for_graphs,
    make_optimizer,
    skip_update_if_non_finite,
)

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("tiny", "0.5b", "1b", "1.5b", "2b")
MODES = ("forward", "train")
STOCK = "stock"  # transformers' LlamaMLP: the plain dense baseline
# `stock` first (it needs no statistics), then `torch`, whose L0 feeds the `auto` decisions.
# A forced kernel that cannot run (no GPU, or no training path yet) is reported as skipped, with the reason.
KERNELS = (STOCK, "torch", "auto", "twell")  # both modes
BREAKDOWN_REPS = 3
CALIBRATION_TOKENS = 8192  # tokens per layer used to solve the gate shift (more adds nothing but memory)


# ----------------------------------------------------------------------------------------------- results
@dataclass
class LayerStats:
    """Sparsity and path of one FFN layer in its latest call."""

    l0_mean: float
    l0_p99: float
    l0_max: float
    path: str
    overflow_rows: int
    tail: Tail  # the heavy tokens' shares of the layer's tokens and non-zeros


@dataclass
class VariantResult:
    """One (mode, kernel, micro-batch) measurement. `skipped` holds the reason when it could not run."""

    mode: str
    kernel: str
    batch: int
    tokens: int
    ms: float | None = None
    ms_spread: tuple[float, float] | None = None  # (min, max) of the timed calls
    tokens_per_ms: float | None = None
    peak_gib: float | None = None
    mj_per_token: float | None = None
    layers: list[LayerStats] = field(default_factory=list)
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    device_ms: dict[str, float] = field(default_factory=dict)  # benchmark.device_ms_by_family of one call
    skipped: str | None = None

    def path_summary(self) -> str:
        """e.g. 'twell x6, twell+dense-rows x2 (140 rows dense)'."""
        if not self.layers:
            return "LlamaMLP (no statistics)"
        counts = collections.Counter(layer.path for layer in self.layers)
        text = ", ".join(f"{path} x{n}" for path, n in counts.most_common())
        rerouted = sum(layer.overflow_rows for layer in self.layers)
        return text + (f" ({rerouted} rows dense)" if rerouted else "")


# ------------------------------------------------------------------------------------------------- model
def size_config(size: str, vocab_size: int | None) -> ModelConfig:
    """The `model:` section of configs/model/<size>.yaml; a null vocabulary takes `vocab_size` or the
    embedded tokenizer's size (the one the tiny default run trains with)."""
    path = ROOT / "configs" / "model" / f"{size}.yaml"
    if not path.is_file():
        raise ValueError(f"--size {size}: no {path}; choose one of {list(SIZES)} or pass --checkpoint.")
    section = OmegaConf.to_container(OmegaConf.load(path).model, resolve=True)
    cfg = ModelConfig(**section)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    elif cfg.vocab_size is None:
        cfg.vocab_size = len(load_tokenizer("embedded"))
    return cfg


def load_model(args: argparse.Namespace, device: torch.device) -> LlamaForCausalLM:
    """The model in fp32 on `device` (fp32 is the master copy that training mode starts from)."""
    torch.manual_seed(args.seed)
    if args.checkpoint:
        return load_pretrained(args.checkpoint, kernel="torch", dtype=torch.float32, device=str(device))
    with torch.device(device):
        return build_model(size_config(args.size, args.vocab_size), kernel="torch")


def decoder_layers(model: LlamaForCausalLM) -> nn.ModuleList:
    return model.model.layers


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

    handles = [layer.mlp.register_forward_pre_hook(calibrate) for layer in layers]
    try:
        model.model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
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


def set_kernel(
    model: LlamaForCausalLM, kernel: str, observed: list[LayerStats] | None, train_kernels: bool = False
) -> None:
    """Route every FFN through `kernel` (or the stock MLP); `auto` layers decide from `observed`, in training only
    between the dense path and, with `train_kernels`, the sparse training kernels.

    Self-observation is switched off so that no layer changes its mind (or syncs the host) mid-timing.
    """
    if kernel == STOCK:
        use_stock_modules(model)
        return
    for layer in decoder_layers(model):
        if layer in _SPARSE_MLPS:  # it shares its Linear modules (and so any dtype change) with the stock MLP
            layer.mlp = _SPARSE_MLPS.pop(layer)
    sparsify(model, kernel, train_kernels and kernel == "auto")  # resets each layer's dispatcher
    for i, mlp in enumerate(sparse_mlps(model)):
        mlp.self_observe = False
        if observed is not None:
            mlp.dispatcher.observe(observed[i].l0_mean, observed[i].l0_max, observed[i].tail)


def layer_stats(model: LlamaForCausalLM) -> list[LayerStats]:
    stats = []
    for mlp in sparse_mlps(model):
        result = mlp.last_result
        mean, p99, top = l0_summary(result.l0_M)
        stats.append(LayerStats(mean, p99, top, result.path, result.dense_rows(), density_of(result.l0_M)[2]))
    return stats


def kernel_unavailable_reason(kernel: str, model: LlamaForCausalLM, device: torch.device) -> str | None:
    """Why a forced kernel cannot run this model here (None if it can); `auto` and `torch` always run."""
    if kernel in (STOCK, "torch", "auto"):
        return None
    reason = get_backend(kernel).unavailable_reason(device)
    if reason is None and kernel == "twell":
        from sparse_llm.ffn.twell.validation import shape_unsupported_reason

        reason = shape_unsupported_reason(model.config.hidden_size, model.config.intermediate_size)
    return reason


# ------------------------------------------------------------------------------------------------ inputs
def make_inputs(args: argparse.Namespace, rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, seq_len] token ids: uniform random ids (seeded), or consecutive blocks of a token file."""
    if not args.tokens:
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (rows, args.seq_len), generator=gen)
    _meta, train, val = read_token_file(args.tokens)
    source = val if len(val) >= rows * args.seq_len else train
    if len(source) < rows * args.seq_len:
        raise ValueError(f"--tokens {args.tokens}: {len(source)} tokens, fewer than {rows} x {args.seq_len}.")
    ids = source.blocks(range(0, rows * args.seq_len, args.seq_len), args.seq_len)
    if int(ids.max()) >= vocab_size:
        raise ValueError(f"--tokens {args.tokens} holds ids >= the model's vocabulary ({vocab_size}): wrong tokenizer.")
    return ids


# ------------------------------------------------------------------------------------------ measurements
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


def gate_gemm_ms(model: LlamaForCausalLM, tokens: int, dtype: torch.dtype, args: argparse.Namespace) -> float:
    """All layers' gate GEMMs [tokens, K] x [K, N], timed alone (cost does not depend on the values)."""
    layers = decoder_layers(model)
    w_NK = layers[0].mlp.gate_proj.weight.detach().to(dtype)
    x_MK = torch.randn(tokens, w_NK.shape[1], device=w_NK.device, dtype=dtype)
    with torch.no_grad():
        one = time_ms(lambda: F.linear(x_MK, w_NK), warmup=args.warmup + 2, reps=max(args.reps, 20), device=w_NK.device)
    return one * len(layers)


def section_timer(model: LlamaForCausalLM, device: torch.device) -> SectionTimer:
    layers = decoder_layers(model)
    return SectionTimer(
        {"attention": [layer.self_attn for layer in layers], "ffn": [layer.mlp for layer in layers]}, device
    )


def split_forward(total: float, sections: dict[str, float], gate_ms: float) -> dict[str, float]:
    return {
        "attention": sections["attention"],
        "ffn gate GEMM": gate_ms,
        "ffn rest": sections["ffn"] - gate_ms,
        "other fwd": total - sections["attention"] - sections["ffn"],
    }


def median_dicts(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: sorted(r[key] for r in rows)[len(rows) // 2] for key in rows[0]}


def bench_forward(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    kernel: str,
    observed: list[LayerStats] | None,
    meter: EnergyMeter,
    gate_ms: float,
    args: argparse.Namespace,
) -> VariantResult:
    """Core-model forward (no lm_head, no KV cache) of ids [B, T] with every FFN on `kernel`."""
    device = ids.device
    set_kernel(model, kernel, observed)
    result = VariantResult("forward", kernel, ids.shape[0], ids.numel())

    def forward() -> object:
        if args.cuda_graphs:  # a new step: this call's graphs may overwrite the last call's outputs
            torch.compiler.cudagraph_mark_step_begin()
        return model.model(input_ids=ids, use_cache=False)

    try:
        with torch.inference_mode(), PeakMemory(device) as peak:
            samples = time_samples_ms(forward, args.warmup, args.reps, device)
            with recording_statistics(model):  # the timed calls skip what only this report needs
                forward()
            result.layers = layer_stats(model)
            energy = energy_mj_per_call(meter, forward, args.energy_seconds)
        fill_timing(result, samples, peak.gib, energy)
        if not args.compile:
            clock, runs = Clock(device), []
            with torch.inference_mode(), section_timer(model, device) as timer:
                for _ in range(BREAKDOWN_REPS):
                    start = clock.mark()
                    forward()
                    total = clock.elapsed_ms(start, clock.mark())
                    runs.append({"total": total, **split_forward(total, timer.totals_ms(), gate_ms)})
            result.breakdown_ms = median_dicts(runs)
        with torch.inference_mode():
            result.device_ms = device_ms_by_family(forward, device)
        write_profile(forward, result, args)
    except torch.OutOfMemoryError:
        result.skipped = f"out of memory at micro-batch {ids.shape[0]}"
    finally:
        free_memory(model, device)
    return result


class TrainStep:
    """One training step as train.py runs it on a GPU, split in phases for the time breakdown.

    fp32 master weights; the forward under bf16 autocast (no autocast on a CPU, as train.py);
    loss = CE + l1 * L1 term (CE alone with stock MLPs, which have no L1 term); backward; clip the
    gradient norm to 1; AdamW (train.py's optimizer), skipped on the device if the loss or the norm is not
    finite; then read the previous step's loss and norm on the host and call `after()` (the trainer's
    `FrozenHeap.freeze`). As in the trainer, the host waits for the device once per step, for the step before
    the one it has just issued, so it can run up to a step ahead.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        ids: torch.Tensor,
        l1: float,
        lr: float,
        after: Callable[[], None] = lambda: None,
        cuda_graphs: bool = False,
        accumulate: int = 1,
        step_scope: bool = True,
        graph_forwards: bool | None = None,
    ) -> None:
        self.model, self.ids, self.l1, self.after, self.cuda_graphs = model, ids, l1, after, cuda_graphs
        self.accumulate = accumulate  # micro-batches (forward + backward passes) per optimizer step
        self.step_scope = step_scope  # False: casts per micro-batch, gradients through autograd (for an A/B)
        # the training op's forward as a CUDA graph per layer (`train_graphs`); by default with cuda_graphs, as the trainer
        self.graph_forwards = cuda_graphs if graph_forwards is None else graph_forwards
        cfg = TrainConfig()
        cfg.trainer.lr = lr
        self.optimizer = make_optimizer(model, cfg, ids.device)
        self.mlps = sparse_mlps(model)
        cuda = ids.device.type == "cuda"
        self.autocast: Callable[[], AbstractContextManager] = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
        )
        self.unread: HostCopy | None = None  # the last step's loss and gradient norm, on their way to the host
        self.grads_held = hold_gradients_for_graphs(model.parameters(), cuda_graphs, accumulate)  # as the trainer

    def forward(self) -> torch.Tensor:
        if self.cuda_graphs:
            # As the trainer: the last backward has run, so its graphs' outputs are free (the weight gradients are
            # held tensors the graphs' outputs were added into).
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast():
            out = self.model(input_ids=self.ids, labels=self.ids, use_cache=False)
            if not self.mlps:
                return out.loss
            return out.loss + self.l1 * l1_term([m.last_result for m in self.mlps])

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accumulate).backward()  # the step's gradient is the mean over its micro-batches

    def update(self, loss: torch.Tensor) -> None:
        norm = defer_clipping(self.optimizer, self.model.parameters(), 1.0)
        if norm is None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        values = torch.stack([loss.detach().float(), torch.as_tensor(norm, device=loss.device).float()])
        if not skip_update_if_non_finite(self.optimizer, values):
            raise RuntimeError("The benchmark's training step needs a fused AdamW (train.py's on CPU and CUDA).")
        readout = HostCopy(values)
        self.optimizer.step()
        self.optimizer.grad_scale = None
        self.optimizer.found_inf = None
        self.optimizer.zero_grad(set_to_none=not self.grads_held)
        earlier, self.unread = self.unread, readout
        if earlier is not None:
            earlier.tolist()

    def micro_batches(self) -> AbstractContextManager[None]:
        """Around a step's forwards and backwards, as the trainer of one process: `step_scope.optimizer_step`."""
        if not self.step_scope:
            return nullcontext()
        return optimizer_step(reuse_casts=True, add_into_grads=True, graph_forwards=self.graph_forwards)

    def __call__(self) -> None:
        with self.micro_batches():
            for _ in range(self.accumulate):
                loss = self.forward()
                self.backward(loss)
        self.update(loss)
        self.after()


def bench_train(
    model: LlamaForCausalLM,
    master: dict[str, torch.Tensor],
    ids: torch.Tensor,
    kernel: str,
    observed: list[LayerStats] | None,
    meter: EnergyMeter | None,
    gate_ms: float | None,
    args: argparse.Namespace,
) -> VariantResult:
    """Training steps on ids [B, T] from the master weights; energy and breakdown only when given."""
    device = ids.device
    result = VariantResult("train", kernel, ids.shape[0], ids.numel() * args.accumulate)
    model.load_state_dict(master)
    model.train()
    set_kernel(model, kernel, observed, args.train_kernels)
    step: TrainStep | None = None
    try:
        with FrozenHeap() as heap:  # as the trainer runs its steps
            with PeakMemory(device) as peak:
                step = TrainStep(
                    model, ids, args.l1, args.lr, after=heap.freeze, cuda_graphs=args.cuda_graphs,
                    accumulate=args.accumulate,
                )  # fmt: skip
                # Steps back to back, as the trainer issues them: a step's time is from its first kernel's turn on
                # the device to its last, including any wait of the device for the host within it.
                samples = time_samples_ms(step, args.warmup, args.reps, device, drain=False)
                result.layers = layer_stats(model)
                energy = energy_mj_per_call(meter, step, args.energy_seconds) if meter is not None else None
            fill_timing(result, samples, peak.reserved_gib if args.cuda_graphs else peak.gib, energy)
            if gate_ms is not None:
                if not args.compile:
                    result.breakdown_ms = train_breakdown(model, step, gate_ms)
                result.device_ms = device_ms_by_family(step, device)
                write_profile(step, result, args)
    except torch.OutOfMemoryError as exc:
        result.skipped = f"out of memory at micro-batch {ids.shape[0]}"
        print(f"train, {kernel}, micro-batch {ids.shape[0]}: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
    except NotImplementedError as exc:  # a backend without a training path says so in its error
        result.skipped = f"no training path: {exc}"
    finally:
        del step
        model.zero_grad(set_to_none=True)
        if args.cuda_graphs:
            # The graphs' memory pools outlive the variant's tensors; drop them with the compiled code (the next
            # variant compiles again), so that its peak reserve does not count this variant's pools.
            torch._dynamo.reset()
        free_memory(model, device)
    return result


def train_breakdown(model: LlamaForCausalLM, step: TrainStep, gate_ms: float) -> dict[str, float]:
    """Phase times of one step, summed over its micro-batches (forward, backward), then its optimizer step."""
    device = step.ids.device
    clock, runs = Clock(device), []
    with section_timer(model, device) as timer:
        for _ in range(BREAKDOWN_REPS):
            marks = [clock.mark()]  # then after each forward and each backward, then after the update
            with step.micro_batches():
                for _ in range(step.accumulate):
                    loss = step.forward()
                    marks.append(clock.mark())
                    timer.active = False  # gradient checkpointing re-runs module forwards inside backward
                    step.backward(loss)
                    marks.append(clock.mark())
                    timer.active = True
            step.update(loss)
            marks.append(clock.mark())
            spans = [clock.elapsed_ms(a, b) for a, b in itertools.pairwise(marks)]
            runs.append({
                "total": clock.elapsed_ms(marks[0], marks[-1]),
                **split_forward(sum(spans[0:-1:2]), timer.totals_ms(), gate_ms * step.accumulate),
                "backward": sum(spans[1:-1:2]),
                "optimizer": spans[-1],
            })  # fmt: skip
    return median_dicts(runs)


def write_profile(fn: Callable[[], object], result: VariantResult, args: argparse.Namespace) -> None:
    """With --profile-dir: one profiled call of fn, as <dir>/<mode>_<kernel>.json (trace) and .txt (top ops)."""
    if not args.profile_dir:
        return
    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{result.mode}_{result.kernel}"
    with torch.inference_mode() if result.mode == "forward" else nullcontext():
        table = profile_once(fn, stem.with_suffix(".json"), args.device, row_limit=45)
    stem.with_suffix(".txt").write_text(table)
    print(f"profile: {stem}.json / .txt", flush=True)


def fill_timing(result: VariantResult, samples: list[float], peak_gib: float | None, energy_mj: float | None) -> None:
    result.ms = statistics.median(samples)
    result.ms_spread = (min(samples), max(samples))
    result.tokens_per_ms = result.tokens / result.ms
    result.peak_gib = peak_gib
    result.mj_per_token = None if energy_mj is None else energy_mj / result.tokens


def largest_batches(
    model: LlamaForCausalLM,
    master: dict[str, torch.Tensor],
    ids: torch.Tensor,
    measured: list[VariantResult],
    observed: list[LayerStats] | None,
    meter: EnergyMeter,
    args: argparse.Namespace,
) -> list[VariantResult]:
    """Per training kernel that ran at --train-batch (`measured`), the largest micro-batch that fits in
    memory, growing it by half (rounded up, ending at --max-train-batch: 4, 6, 8 or 2, 3, 5, 8) until it runs out,
    with its throughput and energy (the measured row itself where the first step already runs out of memory); ids
    [>= max_train_batch, T] holds the inputs. Steps of a half, not doublings: a sparse path that saves a third of
    the memory fits 1.5x the batch, which doubling would miss."""
    found = []
    for best in measured:
        batch = best.batch
        while batch < args.max_train_batch:
            batch = min(max(batch + 1, math.ceil(batch * 1.5)), args.max_train_batch)
            row = bench_train(model, master, ids[:batch], best.kernel, observed, meter, None, args)
            if row.skipped:
                print(f"largest fit, {best.kernel}: stopped at micro-batch {batch} ({row.skipped})", flush=True)
                break
            best = row
        found.append(dataclasses.replace(best, mode="train (largest fit)"))
    return found


# ------------------------------------------------------------------------------------------------ report
def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summary_table(results: list[VariantResult]) -> list[str]:
    lines = [
        "| mode | kernel | micro-batch | ms/iter (min-max) | tokens/ms | vs stock | vs torch | peak GiB | mJ/token | "
        "L0 mean (layer avg) | L0 p99 (worst layer) | L0 max | layer paths |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def key(r: VariantResult) -> tuple[str, int | None]:  # largest-fit rows compare across micro-batches
        return r.mode, (r.batch if r.mode in MODES else None)

    bases = {
        (kernel, key(r)): r for r in results for kernel in (STOCK, "torch") if r.kernel == kernel and not r.skipped
    }
    for r in results:
        if r.skipped:
            lines.append(f"| {r.mode} | {r.kernel} | {r.batch} | skipped: {r.skipped} |" + " |" * 9)
            continue
        ratios = []
        for kernel in (STOCK, "torch"):
            base = bases.get((kernel, key(r)))
            ratios.append(f"{r.tokens_per_ms / base.tokens_per_ms:.3f}x" if base else "-")
        lo, hi = r.ms_spread
        if r.layers:
            l0 = (
                f"{sum(layer.l0_mean for layer in r.layers) / len(r.layers):.1f} | "
                f"{max(layer.l0_p99 for layer in r.layers):.0f} | {max(layer.l0_max for layer in r.layers):.0f}"
            )
        else:
            l0 = "- | - | -"
        lines.append(
            f"| {r.mode} | {r.kernel} | {r.batch} | {r.ms:.2f} ({lo:.2f}-{hi:.2f}) | {r.tokens_per_ms:.2f} | "
            f"{ratios[0]} | {ratios[1]} | {fmt(r.peak_gib, '.2f')} | {fmt(r.mj_per_token, '.4f')} | {l0} | "
            f"{r.path_summary()} |"
        )
    return lines


def breakdown_table(results: list[VariantResult]) -> list[str]:
    rows = [r for r in results if r.breakdown_ms]
    if not rows:
        return []
    keys = ["attention", "ffn gate GEMM", "ffn rest", "other fwd", "backward", "optimizer", "total"]
    lines = [
        "| mode | kernel | " + " | ".join(f"{k} ms" for k in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for r in rows:
        lines.append(f"| {r.mode} | {r.kernel} | " + " | ".join(fmt(r.breakdown_ms.get(k), ".2f") for k in keys) + " |")
    # The ceiling of our dense path: it shares the sparse rows' attention and norms (the stock row does not).
    dense = next((r for k in ("torch", STOCK) for r in rows if r.mode == "forward" and r.kernel == k), None)
    if dense is not None:
        lines += ["", forward_ceiling(dense.kernel, dense.breakdown_ms)]
    return lines


def device_table(results: list[VariantResult]) -> list[str]:
    """Device time of one step per kernel family, and the step's time the device sat idle waiting for the host."""
    rows = [r for r in results if r.device_ms]
    if not rows:
        return []
    families = [family for family, _ in KERNEL_FAMILIES] + ["other"]
    columns = ["mode", "kernel", "ms/iter", "device busy ms", "device idle ms", *(f"{f} ms" for f in families)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        busy = r.device_ms["busy"]
        cells = [fmt(r.ms, ".2f"), fmt(busy, ".2f"), fmt(max(0.0, r.ms - busy), ".2f")]
        cells += [fmt(r.device_ms.get(f, 0.0), ".2f") for f in families]
        lines.append(f"| {r.mode} | {r.kernel} | " + " | ".join(cells) + " |")
    return lines


def forward_ceiling(kernel: str, dense_ms: dict[str, float]) -> str:
    """The speed-up of a dense forward if its FFN past the gate GEMM cost nothing: the most any sparse FFN
    that keeps the dense gate GEMM can give; attention and the other layers bound it."""
    total, rest = dense_ms["total"], dense_ms["ffn rest"]
    return (
        f"Forward ceiling: with the FFN past its gate GEMM free, the `{kernel}` forward would take "
        f"{total - rest:.2f} of {total:.2f} ms ({total / (total - rest):.3f}x); attention "
        f"{dense_ms['attention']:.2f} ms, gate GEMM {dense_ms['ffn gate GEMM']:.2f} ms and the other layers "
        f"{dense_ms['other fwd']:.2f} ms remain."
    )


def layer_table(results: list[VariantResult]) -> list[str]:
    """Per-layer L0 of each mode's dense pass, and the path every sparse variant took in that layer."""
    ran = [r for r in results if not r.skipped and r.mode in MODES and r.layers]
    dense = [r for r in ran if r.kernel == "torch"]
    sparse = [r for r in ran if r.kernel != "torch"]
    if not dense:
        return []
    head = "| layer | " + " | ".join(f"{r.mode} L0 mean / p99 / max" for r in dense)
    head += "".join(f" | {r.mode} {r.kernel} path (dense rows)" for r in sparse) + " |"
    lines = [head, "|---|" + "---|" * (len(dense) + len(sparse))]
    for i in range(len(dense[0].layers)):
        cells = [f"{r.layers[i].l0_mean:.1f} / {r.layers[i].l0_p99:.0f} / {r.layers[i].l0_max:.0f}" for r in dense]
        cells += [f"{r.layers[i].path} ({r.layers[i].overflow_rows})" for r in sparse]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines


def render_report(results: list[VariantResult], header: list[str]) -> str:
    blocks = [header, summary_table(results), breakdown_table(results), device_table(results), layer_table(results)]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"


def report_header(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    device: torch.device,
    energy_note: str,
    shifts: list[float] | None,
) -> list[str]:
    cfg = model.config
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"random-init {args.size}"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    inputs = f"token file {args.tokens}" if args.tokens else f"uniform random token ids (seed {args.seed})"
    if shifts is not None:
        sparsity = f"made sparse with --density-l0 {args.density_l0} (gate shifts {min(shifts):.2f}-{max(shifts):.2f})"
    else:
        sparsity = "sparsity as trained" if args.checkpoint else "no sparsity imposed"
    command = f"python scripts/bench_model.py {' '.join(args.argv)}".rstrip()
    forward_dtype = "bf16" if device.type == "cuda" else "fp32"
    train_precision = "fp32 weights + bf16 autocast" if device.type == "cuda" else "fp32"
    accumulation = "one per optimizer step" if args.accumulate == 1 else f"{args.accumulate} per optimizer step"
    return [
        f"## Model-level benchmark: {what} ({date})",
        "",
        f"Hardware: {hardware_summary(device)}; attention {cfg._attn_implementation}; energy: {energy_note}.",
        f"Model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, FFN {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}; {sparsity}.",
        f"Settings: `{command}`; inputs: {inputs}; "
        f"forward: micro-batch {args.batch} x {args.seq_len} tokens, {forward_dtype}, core model (no lm_head), "
        "L0 statistics from one extra pass (timed calls skip them, as generation does); "
        f"train: micro-batch {args.train_batch} x {args.seq_len} ({accumulation}), {train_precision}, l1 {args.l1}, AdamW (lr {args.lr}), "
        f"grad clip 1{', gradient checkpointing' if args.grad_ckpt else ''}; "
        f"{'decoder layers torch.compiled (every variant); ' if args.compile else ''}"
        f"{GRAPHS_NOTE if args.cuda_graphs else ''}"
        f"times: median of {args.reps} "
        f"after {args.warmup} warm-up; energy over >= {args.energy_seconds} s windows; breakdown: "
        f"{'device time only (compiled layers)' if args.compile else f'median of {BREAKDOWN_REPS} passes'}. "
        "`auto` layers decide from the dense pass's L0.",
    ]


GRAPH_WARMUP_STEPS = 2  # calls before torch.compile's CUDA graphs replay: one eager, one recording
GRAPHS_NOTE = "compiled parts replayed as CUDA graphs, peak memory = peak reserve (graph pools included); "


# -------------------------------------------------------------------------------------------------- main
def add_model_source(parser: argparse.ArgumentParser) -> None:
    """--checkpoint or --size (with --vocab-size): the model `load_model` builds."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a model directory in HF layout (a run's final/)")
    source.add_argument("--size", choices=SIZES, help="a random-init model of configs/model/<size>.yaml")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the size's vocabulary")


def check_model_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before any model is loaded: a --checkpoint that is not a model directory, or one given with
    --density-l0 (which only random-init models take)."""
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        parser.error(
            f"--checkpoint {args.checkpoint}: not a model directory (no config.json); pass a run's final/ or "
            "checkpoints/step_N/model directory"
        )
    if args.density_l0 is not None and args.checkpoint:
        parser.error("--density-l0 makes random-init models sparse; a checkpoint has its own sparsity (drop it)")


def check_cuda_graphs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of --cuda-graphs: it replays the compiled layers (not with --grad-ckpt, as trainer.cuda_graphs)
    on a CUDA GPU, and the untimed steps must cover what precedes the replays: each compiled part runs eagerly on its
    first call and is recorded on its second (the second micro-batch; with one micro-batch a step, the second step),
    which a timed step would measure."""
    if not args.cuda_graphs:
        return
    if not args.compile:
        parser.error("--cuda-graphs replays the compiled layers: add --compile")
    if getattr(args, "grad_ckpt", False):
        parser.error("--cuda-graphs is not supported with --grad-ckpt (as trainer.cuda_graphs)")
    if args.warmup < GRAPH_WARMUP_STEPS:
        parser.error(
            f"--cuda-graphs needs --warmup {GRAPH_WARMUP_STEPS} or more: the first step runs the compiled layers "
            "eagerly and the second call records their graphs, which a timed step would measure"
        )
    if torch.device(args.device).type != "cuda":
        parser.error(f"--cuda-graphs needs a CUDA GPU (--device {args.device})")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward call")
    parser.add_argument("--train-batch", type=int, default=None, help="training micro-batch (default --batch)")
    parser.add_argument(
        "--max-train-batch",
        type=int,
        default=0,
        help="also find the largest training micro-batch that fits, growing by half up to this",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="training micro-batches per optimizer step (train.py's global_batch / micro_batch); tokens/ms counts "
        "all of them",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--density-l0",
        type=float,
        default=None,
        help="random-init models only: target mean non-zeros per token in every FFN layer",
    )
    parser.add_argument("--tokens", default=None, help="token-file prefix (scripts/tokenize_corpus.py) for inputs")
    parser.add_argument("--modes", default="forward,train")
    parser.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help="comma-separated FFN variants to run, in this order; `auto` decides from the L0 that `torch` measured",
    )
    parser.add_argument("--markdown", default=None, help="append the report to this file (e.g. BENCHMARKS.md)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--energy-seconds", type=float, default=2.0)
    parser.add_argument("--l1", type=float, default=2e-5, help="L1 coefficient in the training loss")
    parser.add_argument(
        "--lr",
        type=float,
        default=0.0,
        help="AdamW lr of the timed steps: AdamW does the same work at any lr; 0 keeps the weights (so L0) fixed",
    )
    parser.add_argument(
        "--train-kernels",
        action="store_true",
        help="the `auto` variant may train on the sparse kernels where their cost model predicts a win (train.py's "
        "train_kernels=true); without it `auto` trains on the dense path",
    )
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in train mode")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every decoder layer (model.compile_layers, as trainer.compile=true) for every variant; "
        "the per-section breakdown is skipped (its module hooks would split the compiled graphs)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile: replay each compiled layer part as a CUDA graph (torch.compile mode reduce-overhead)",
    )
    parser.add_argument(
        "--profile-dir", default=None, help="also profile one call per variant: Chrome trace + top-ops table here"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.train_batch = args.train_batch or args.batch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        parser.error(f"--modes {','.join(args.modes)}: choose from {','.join(MODES)}")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in KERNELS]
    if unknown or not args.kernels:
        parser.error(f"--kernels {','.join(args.kernels)}: choose from {','.join(KERNELS)}")
    if "auto" in args.kernels and "torch" not in args.kernels[: args.kernels.index("auto")]:
        parser.error("--kernels: `auto` decides from the L0 measured by `torch`: list torch before auto")
    for name in ("batch", "train_batch", "accumulate", "seq_len", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    check_model_source(parser, args)
    check_cuda_graphs(parser, args)
    if args.max_train_batch and args.max_train_batch <= args.train_batch:
        parser.error(f"--max-train-batch must be 0 (off) or above --train-batch ({args.train_batch})")
    if args.energy_seconds < 1.0:
        parser.error("--energy-seconds must be >= 1 (the NVML counter updates every 20-100 ms)")
    return args


def run_variants(
    mode: str,
    kernels: Sequence[str],
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    bench: Callable[[str, list[LayerStats] | None], VariantResult],
) -> list[VariantResult]:
    """bench(kernel, observed) for each of `kernels` that can run here; the others are listed as skipped.

    `observed` is the per-layer L0 of the first variant that recorded it (the `torch` pass), which the
    `auto` variant decides from.
    """
    rows: list[VariantResult] = []
    observed = None
    for kernel in kernels:
        reason = kernel_unavailable_reason(kernel, model, ids.device)
        row = (
            VariantResult(mode, kernel, ids.shape[0], ids.numel(), skipped=reason)
            if reason
            else bench(kernel, observed)
        )
        rows.append(row)
        observed = observed or (row.layers or None)
        print("\n".join(summary_table([row])[2:]), flush=True)
    return rows


def run(args: argparse.Namespace) -> tuple[list[VariantResult], str]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 leftovers stay fp32, as in the dense reference
    model = load_model(args, device)
    if args.seq_len > model.config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's context "
            f"({model.config.max_position_embeddings}); pass --seq-len <= that."
        )
    vocab = model.config.vocab_size
    ids = make_inputs(args, max(args.batch, args.train_batch, args.max_train_batch), vocab).to(device)
    shifts = None
    if args.density_l0 is not None:
        shifts = make_sparse(model, args.density_l0, ids[: max(1, CALIBRATION_TOKENS // args.seq_len)])
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        compile_layers(model, cuda_graphs=args.cuda_graphs)
    # Training variants start from these weights; kept on the host so they cost no GPU memory.
    master = (
        {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if "train" in args.modes else {}
    )
    meter = EnergyMeter(device)
    energy_note = "NVML" if meter.available else f"not measured ({meter.unavailable_reason})"
    header = report_header(args, model, device, energy_note, shifts)
    print("\n".join(header), flush=True)

    results: list[VariantResult] = []
    if "forward" in args.modes:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model.to(dtype).eval()
        fwd_ids = ids[: args.batch]
        gate_ms = gate_gemm_ms(model, fwd_ids.numel(), dtype, args)
        results += run_variants(
            "forward",
            args.kernels,
            model,
            fwd_ids,
            lambda kernel, seen: bench_forward(model, fwd_ids, kernel, seen, meter, gate_ms, args),
        )
    if "train" in args.modes:
        model.to(torch.float32)
        train_ids = ids[: args.train_batch]
        gate_ms = gate_gemm_ms(
            model, train_ids.numel(), torch.bfloat16 if device.type == "cuda" else torch.float32, args
        )
        rows = run_variants(
            "train",
            args.kernels,
            model,
            train_ids,
            lambda kernel, seen: bench_train(model, master, train_ids, kernel, seen, meter, gate_ms, args),
        )
        results += rows
        if args.max_train_batch:
            ran = [r for r in rows if not r.skipped]
            observed = next((r.layers for r in rows if r.layers), None)
            results += largest_batches(model, master, ids, ran, observed, meter, args)
    meter.close()
    return results, render_report(results, header)


def main(argv: Sequence[str] | None = None) -> list[VariantResult]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results, report = run(args)
    print("\n" + report, flush=True)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n\n" + report)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return results


if __name__ == "__main__":
    main()
