"""The training loop: accelerate (single device, DDP or FSDP), AdamW + cosine schedule, L1-sparse FFNs.

One optimizer step = `accumulation` micro-batches on each of `world` ranks; together they hold
`trainer.global_batch` sequences whatever the world size, so a run gives the same updates on 1 or N
devices. Loss per micro-batch = CE + l1(step) * L1 term (sparse_llm/training/sparsity.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
    broadcast_object_list,
    gather_object,
    set_seed,
)
from omegaconf import OmegaConf
from transformers.utils import logging as hf_logging

from sparse_llm.checks.errors import UserInputError
from sparse_llm.data.loader import TrainLoader, val_batches
from sparse_llm.data.pipeline import build_token_data
from sparse_llm.ffn import kernel_set
from sparse_llm.ffn.kernel_choice import validate_kernel
from sparse_llm.ffn.registry import get_backend
from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.model.llama import (
    build_model,
    compile_layers,
    count_parameters,
    kernel_width_note,
    prepare_model,
    sparse_mlps,
    swap_to_relu,
)
from sparse_llm.telemetry.energy import EnergyMeter
from sparse_llm.telemetry.metrics import Telemetry
from sparse_llm.telemetry.plots import NothingToPlot, plot_run
from sparse_llm.training import checkpoint as ckpt
from sparse_llm.training.config import TrainConfig, TrainerConfig, check_ranges
from sparse_llm.training.init import check_tokenizer, checked_model_config, choose_tokenizer, open_init, stock_model
from sparse_llm.training.manifest import write_manifest
from sparse_llm.training.preemption import StopSignals, TrainingStopped
from sparse_llm.training.sparsity import L1_WARMUP_SHAPES, NoSparsity, SparsityTracker, l1_coefficient, l1_term

log = logging.getLogger(__name__)
# accelerate narrates every checkpoint file at INFO, and transformers draws a progress bar per saved shard;
# our own progress bar and log lines say what matters.
logging.getLogger("accelerate").setLevel(logging.WARNING)
hf_logging.disable_progress_bar()

# Dense bf16 tensor-core peaks (FLOP/s) for MFU, matched in order against the device name; unknown devices
# and non-bf16 runs report no MFU.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class BatchPlan:
    seq_len: int
    micro_batch: int
    accumulation: int
    world: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.accumulation * self.world


def plan_batches(cfg: TrainConfig, world: int) -> BatchPlan:
    """Accumulation steps that give `trainer.global_batch` sequences per optimizer step on `world` ranks."""
    t = cfg.trainer
    seq_len = t.seq_len or cfg.model.max_position_embeddings
    if seq_len > cfg.model.max_position_embeddings:
        raise ValueError(
            f"trainer.seq_len={seq_len} exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}."
        )
    if t.global_batch_tokens and t.global_batch_tokens % seq_len:
        raise ValueError(
            f"trainer.global_batch_tokens={t.global_batch_tokens} is not a multiple of the sequence length "
            f"{seq_len}; use a multiple, or trainer.global_batch (in sequences)."
        )
    global_batch = t.global_batch_tokens // seq_len if t.global_batch_tokens else t.global_batch
    per_step = t.micro_batch * world
    if global_batch <= 0 or global_batch % per_step:
        raise ValueError(
            f"The global batch of {global_batch} sequences is not a multiple of micro_batch ({t.micro_batch}) x "
            f"world size ({world}) = {per_step}. Change trainer.global_batch or trainer.micro_batch, or launch "
            "on a number of processes that divides it."
        )
    return BatchPlan(seq_len, t.micro_batch, global_batch // per_step, world)


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    use_cpu = cfg.trainer.cpu or not torch.cuda.is_available()
    precision = cfg.trainer.mixed_precision
    if precision == "auto":
        precision = "no" if use_cpu else "bf16"
    if precision not in ("no", "bf16"):
        # fp16 would need loss scaling, whose deliberately skipped overflow steps this loop would take for a
        # diverged run (NonFiniteLossError).
        raise ValueError(f"trainer.mixed_precision={precision!r}; use auto, bf16 or no (fp16 is not supported).")
    # cpu=True is needed on CUDA-less machines, or a multi-process launch degrades to independent runs.
    return Accelerator(cpu=use_cpu, mixed_precision=precision)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms).

    The fused AdamW on CUDA and CPU: one kernel per parameter group where the default multi-tensor one runs a
    dozen passes over the optimizer state (72 of 391 ms in a 2B training step), and it can skip a non-finite
    update without the host looking (`skip_update_if_non_finite`).
    """
    t = cfg.trainer
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type in ("cuda", "cpu") or None  # None: torch's default (foreach) elsewhere
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


def defer_clipping(
    optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor], max_norm: float
) -> torch.Tensor | None:
    """Clip the gradients' global norm to max_norm inside the optimizer's next step, where it can; returns the
    norm before clipping, or None where the optimizer cannot (then clip first: clip_grad_norm_).

    A fused AdamW divides every gradient by its `grad_scale` tensor inside its one kernel (the hook GradScaler
    unscales through); the inverse clip factor there saves clip_grad_norm_'s separate read-modify-write pass over
    all gradients (6 of the 34 ms of optimizer work in a 2B model's step on an H100). Clear it after the step:
    `optimizer.grad_scale = None`.
    """
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if not fused or getattr(optimizer, "grad_scale", None) is not None:
        return None
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    # clip_grad_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); the step divides by its inverse.
    optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)
    return norm


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value` as a plain tensor: FSDP2 gives the gradient norm as a DTensor, which torch will not combine with the
    plain tensors of the step's readout. On every rank (the conversion may reduce across them)."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if full_tensor is not None else value


def skip_update_if_non_finite(optimizer: torch.optim.Optimizer, values: torch.Tensor) -> bool:
    """Have the optimizer's next step leave the weights and its own state untouched when any of `values` (the
    step's loss terms and gradient norm, on the device) is not finite; returns False where the optimizer cannot
    (then check on the host before stepping).

    A fused AdamW skips its whole update, on the device, where its `found_inf` tensor is non-zero (the hook
    GradScaler skips overflowed steps through), so the host need not wait for the backward before issuing the
    update. Clear it after the step: `optimizer.found_inf = None`.
    """
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    if not fused or getattr(optimizer, "found_inf", None) is not None:
        return False
    optimizer.found_inf = (~values.isfinite().all()).float()
    return True


class HostCopy:
    """A device tensor's values on their way to host memory, copied behind the work issued so far: `tolist()`
    waits for that work and the copy, not for anything issued after them."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values_host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        self.values_host.copy_(values, non_blocking=True)
        self.landed = None
        if values.is_cuda:
            self.landed = torch.cuda.Event()
            self.landed.record()

    def tolist(self) -> list[Any]:
        if self.landed is not None:
            self.landed.synchronize()
        return self.values_host.tolist()


@dataclass
class StepReadout:
    """One optimizer step's metrics: what the host knew when it issued the step, and the device's values on
    their way (`values`: mean CE and L1 term over ranks, the ranks' stop votes, the gradient norm)."""

    step: int
    values: HostCopy
    l1_coeff: float
    lr: float
    reinit_neurons: int = 0

    def read(self) -> tuple[dict[str, Any], bool]:
        """The step's metrics and whether any rank voted to stop; NonFiniteLossError if its loss or gradient norm
        is not finite (its update was skipped: `skip_update_if_non_finite`, or the host's check before it)."""
        ce, l1, votes, norm = self.values.tolist()
        loss = ce + self.l1_coeff * l1
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise NonFiniteLossError(
                f"Step {self.step}: loss {loss} (CE {ce}, L1 term {l1}), gradient norm {norm}. Its update was not "
                "applied and the last good checkpoint is kept; resume from it with a lower trainer.lr or l1, or a "
                "longer trainer.warmup_steps."
            )
        metrics = {
            "loss": loss,
            "ce": ce,
            "l1_term": l1,
            "l1_coeff": self.l1_coeff,
            "grad_norm": norm,
            "lr": self.lr,
            "reinit_neurons": self.reinit_neurons,
        }
        return metrics, votes > 0


class FrozenHeap:
    """Context for a training loop: `freeze()`, called after each step, leaves every object alive after the first
    step out of the later passes of Python's cyclic garbage collector (gc.freeze); leaving the context gives them
    back to it.

    By then the model, its compiled code and the libraries' caches are hundreds of thousands of objects that live as
    long as the run, and every full collection walked them all again: 0.3 s of host time in a compiled 2B model,
    every ten steps or so, which the device waits through wherever the host sets a step's pace. Objects freed by
    their reference counts are freed as before; only reference cycles among the frozen objects wait for the end.
    """

    def __init__(self) -> None:
        self.frozen = False
        self.caller_froze = False  # objects the caller froze itself: theirs to give back, so this does nothing

    def __enter__(self) -> FrozenHeap:
        self.caller_froze = gc.get_freeze_count() > 0
        return self

    def freeze(self) -> None:
        if not self.frozen and not self.caller_froze:
            gc.collect()  # what is garbage already is not kept
            gc.freeze()
            self.frozen = True

    def __exit__(self, *exc: object) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


def check_compile_setup(backend: str, fsdp: bool) -> None:
    """Raise ValueError on a trainer.compile setting that cannot run: an unknown backend, or FSDP (its sharded
    parameters under per-layer compiled graphs are not supported here)."""
    if backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(
            f"trainer.compile_backend={backend!r} is not a torch.compile backend; use one of "
            f"{torch.compiler.list_backends()} (or aot_eager to debug)."
        )
    if fsdp:
        raise ValueError(
            "trainer.compile=true is not supported under FSDP; use the DDP config or trainer.compile=false."
        )


def check_fsdp_wrap(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> None:
    """Raise ValueError where FSDP's transformer-based wrap (settings `plugin`) names a layer class that `model`
    lacks, before accelerate fails on it without naming the class to use."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # only FSDP runs need torch.distributed

    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy is not transformer_auto_wrap_policy:
        return
    names = plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or []
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        layer = type(model.model.layers[0]).__name__
        raise ValueError(
            f"The FSDP config wraps {', '.join(missing)}, which this model does not have: its decoder layers are "
            f"{layer} (sparse_llm's fused LlamaDecoderLayer). Set fsdp_transformer_layer_cls_to_wrap: {layer} in "
            "the accelerate config, as configs/accelerate/fsdp.yaml does."
        )


def check_cuda_graphs_setup(t: TrainerConfig, device: torch.device) -> None:
    """Raise ValueError where trainer.cuda_graphs=true (settings `t`) cannot run: without compiled layers, with a
    backend other than inductor, with gradient checkpointing (not tried together: its recomputed forwards would
    replay a layer's graph in the middle of the backward), or without a CUDA GPU."""
    if not t.compile:
        raise ValueError("trainer.cuda_graphs=true replays the compiled layers: set trainer.compile=true too.")
    if t.compile_backend != "inductor":
        raise ValueError(
            f"trainer.cuda_graphs=true needs trainer.compile_backend=inductor (not {t.compile_backend!r})."
        )
    if t.gradient_checkpointing:
        raise ValueError(
            "trainer.cuda_graphs=true is not supported with trainer.gradient_checkpointing=true; turn one of them off."
        )
    if device.type != "cuda":
        raise ValueError(
            f"trainer.cuda_graphs=true needs a CUDA GPU; this run is on {device.type}. Leave it off "
            "for runs without a GPU."
        )


def graphs_by_default(t: TrainerConfig, device: torch.device, sparse: bool) -> bool:
    """trainer.cuda_graphs as an unset (null) value takes it: on where trainer.compile is on and graphs can run
    (`check_cuda_graphs_setup`'s conditions), for a model whose FFN layers may train on the sparse kernels (`sparse`):
    replayed graphs keep its step at the GPU's pace (docs/performance.md). A dense model keeps the memory the graphs'
    pools would take."""
    valid = t.compile_backend == "inductor" and not t.gradient_checkpointing and device.type == "cuda"
    return t.compile and valid and sparse


def graphs_sparse_forwards(t: TrainerConfig, device: torch.device, fsdp: bool = False) -> bool:
    """Whether the sparse training op's forward replays one CUDA graph per layer (`step_scope.optimizer_step(
    graph_forwards=True)`): on a GPU, with or without trainer.cuda_graphs, wherever each micro-batch's backward runs
    before its layers' next forward. Not with gradient checkpointing (its recompute is a second forward) nor FSDP
    (it gathers the weights anew for every forward). A replay issues the op's ~25 launches in one, which the host
    would otherwise pay for every layer and micro-batch (docs/performance.md, "2B training step")."""
    return device.type == "cuda" and not t.gradient_checkpointing and not fsdp


def hold_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """Give every trainable parameter a zeroed gradient that stays allocated: `zero_grad(set_to_none=False)` then
    zeroes it in place, and each backward adds into it.

    For CUDA graphs with several micro-batches a step. A parameter without a gradient takes its first backward's
    gradient tensor itself, and for a compiled layer that tensor is an output buffer of the layer's backward graph,
    which the next replay of that graph overwrites. Held gradients are only ever added into, so the graphs can be
    replayed for every micro-batch: each layer's graphs are recorded once, not once per micro-batch of a step (a 2B
    model with 8 micro-batches a step took 73 s to record them so, on an H200; held, its first step, compiling
    included, took 64 s and the next 1.3 s).
    """
    for p in parameters:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def hold_gradients_for_graphs(parameters: Iterable[torch.Tensor], cuda_graphs: bool, micro_batches: int) -> bool:
    """`hold_gradients` where CUDA graphs replay several micro-batches a step; returns whether it did, in which case
    clear the gradients with `zero_grad(set_to_none=False)`. One micro-batch a step needs no holding: its gradients
    are read by the update before the next replay."""
    held = cuda_graphs and micro_batches > 1
    if held:
        hold_gradients(parameters)
    return held


def sparse_training_hint(kernel: str, t: TrainerConfig, device: torch.device, fsdp: bool = False) -> str | None:
    """A start-up hint where the sparse kernels may train on a GPU without the settings that keep the host off the
    step's critical path, else None (also under FSDP, which refuses trainer.compile). The training op is issued layer
    by layer from Python, and a step of several micro-batches gives the host no slack to catch up: the 2B step with 8
    micro-batches ran 1.14x the dense step without CUDA graphs and 1.36x with them on an H200 (docs/performance.md)."""
    if kernel == "torch" or device.type != "cuda" or fsdp or (t.compile and t.cuda_graphs):
        return None
    missing = "trainer.cuda_graphs=true" if t.compile else "trainer.compile=true (which brings trainer.cuda_graphs)"
    return (
        f"the sparse training kernels are issued from the host layer by layer; {missing} replays each layer's "
        "compiled parts and the sparse op's forward as CUDA graphs, which kept a 2B step of 8 micro-batches at the "
        "GPU's pace (1.36x the dense step, against 1.14x without graphs)"
    )


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier at `step`: linear warm-up, then cosine decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU from its name, or None when unknown."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def model_flops_per_token(model_cfg: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters + attention scores (PaLM appendix)."""
    embed = model_cfg.vocab_size * model_cfg.hidden_size
    return 6 * (n_params - embed) + 12 * model_cfg.num_hidden_layers * model_cfg.hidden_size * seq_len


class MeasureWindow:
    """Wall time and GPU energy of the training work between two logging points.

    Validation and checkpoint writes happen inside a window but are not training: `pause()`/`resume()`
    around them take their time and energy out, so tokens/s and mJ/token describe training alone.
    """

    def __init__(self, energy: EnergyMeter, device: torch.device) -> None:
        self.energy, self.device = energy, device
        self.restart()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def restart(self) -> None:
        self._sync()
        self.energy.lap()
        self.start, self.paused_s, self.joules, self.steps = time.perf_counter(), 0.0, 0.0, 0
        self._pause_start: float | None = None

    def pause(self) -> None:
        self._sync()
        lap = self.energy.lap()
        self.joules = None if lap is None or self.joules is None else self.joules + lap
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        self._sync()
        self.energy.lap()  # the paused work's energy is dropped
        self.paused_s += time.perf_counter() - self._pause_start
        self._pause_start = None

    def close(self) -> tuple[float, float | None]:
        """(seconds of training, joules or None) since the last restart."""
        self._sync()
        lap = self.energy.lap()
        joules = None if lap is None or self.joules is None else self.joules + lap
        return time.perf_counter() - self.start - self.paused_s, joules


class Trainer:
    """Owns the run's objects; `run()` trains to `trainer.max_steps` and returns the final model dir."""

    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        validate_kernel(cfg.kernel)
        check_ranges(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        self.acc = make_accelerator(cfg)
        self._check_setup()
        # A pretrained checkpoint sets the model's shape (which the batch plan reads) and the data's tokenizer.
        self.init = open_init(cfg.init) if cfg.init else None
        if self.init is not None:
            cfg.model = checked_model_config(cfg.model, self.init, cfg.init)
            choose_tokenizer(cfg.data, self.init)
        # Verifying the checkpoint to resume from (up to tens of seconds of hashing) overlaps building the rest.
        self._resume_check = ckpt.ResumeCheck(cfg.checkpoint.resume, run_dir, self.acc.is_main_process)
        self.plan = plan_batches(cfg, self.acc.num_processes)
        set_seed(cfg.seed)
        t = cfg.trainer
        # Data before the model: a data problem should not wait for a billion-parameter init.
        self.data = build_token_data(cfg.data, self.plan.seq_len)
        if self.init is not None:
            check_tokenizer(self.data.tokenizer, cfg.data, self.init)
        self.loader = TrainLoader(
            self.data.train,
            self.plan.micro_batch,
            self.plan.seq_len,
            cfg.seed,
            rank=self.acc.process_index,
            world_size=self.acc.num_processes,
            step_sequences=self.plan.tokens_per_step // self.plan.seq_len,
        )
        self.val = val_batches(self.data.val, self.plan.micro_batch, self.plan.seq_len, t.val_batches)
        model, self.start_metrics = self._build_model()
        # A model without SparseMLPs (a dense SiLU or GELU baseline) trains on the cross-entropy alone.
        self.l1 = cfg.l1 if sparse_mlps(model) else 0.0
        if self.l1 != cfg.l1:
            log.warning(
                "hidden_act=%s: a dense model, trained without the L1 term (l1=%g is not applied).",
                model.config.hidden_act,
                cfg.l1,
            )
        if model.config.vocab_size > self.data.vocab_size:
            log.warning(
                "model.vocab_size=%d exceeds the tokenizer's %d entries: the extra embedding rows are never "
                "used. The paper's sizes expect the SmolLM2 tokenizer (data=fineweb_edu or data=tokens).",
                model.config.vocab_size,
                self.data.vocab_size,
            )
        if self.acc.distributed_type == DistributedType.FSDP:
            check_fsdp_wrap(self.acc.state.fsdp_plugin, model)
        for mlp in sparse_mlps(model):
            mlp.self_observe = False  # fed with rank-reduced statistics by the tracker instead
        if t.gradient_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if t.cuda_graphs is None:
            t.cuda_graphs = graphs_by_default(t, self.acc.device, cfg.kernel != "torch" and bool(sparse_mlps(model)))
            if t.cuda_graphs and self.acc.is_main_process:
                log.info(
                    "trainer.cuda_graphs: on with trainer.compile, for the layers that train on the sparse kernels "
                    "(their memory pools take up to ~6 GiB at the 2B shape; trainer.cuda_graphs=false turns them off)"
                )
        if t.compile:
            compile_layers(model, t.compile_backend, t.cuda_graphs)
            log.info(
                "trainer.compile: the first step compiles the decoder layers (%s; about a minute on a GPU host, "
                "once per micro-batch shape)%s",
                t.compile_backend,
                "; their second run (the second micro-batch, or the second step) records them as CUDA graphs"
                if t.cuda_graphs
                else "",
            )
        fsdp = self.acc.distributed_type == DistributedType.FSDP
        hint = sparse_training_hint(cfg.kernel, t, self.acc.device, fsdp)
        if hint and self.acc.is_main_process:
            log.info("Hint: %s.", hint)
        with self.acc.local_main_process_first():  # one process per machine compiles, the others load the cache
            kernel_set.warm(model, self.acc.device, training=True)
        self.n_params = count_parameters(model)
        self.hf_config = model.config
        optimizer = make_optimizer(model, cfg, self.acc.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.min_lr_ratio)
        )
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        # With CUDA graphs every micro-batch replays the layers' graphs (`_micro_step`)
        self.grads_held = hold_gradients_for_graphs(self.model.parameters(), t.cuda_graphs, self.plan.accumulation)
        self.acc.register_for_checkpointing(self.scheduler)
        mlps = sparse_mlps(self.model)
        self.tracker = SparsityTracker(mlps, cfg.sparsity, self._reduce) if mlps else NoSparsity()
        self.energy = EnergyMeter(self.acc.device)
        self.step = 0
        self._unread: StepReadout | None = None  # the step issued last, when its metrics are still to be read

    def _check_setup(self) -> None:
        """Fail at start, not hours in, on settings that cannot work together."""
        cfg = self.cfg
        if cfg.kernel != "auto":
            reason = get_backend(cfg.kernel).unavailable_reason(self.acc.device)
            if reason is not None:
                raise ValueError(
                    f"kernel={cfg.kernel} cannot run on {self.acc.device}: {reason.rstrip('.')}. "
                    "Use kernel=auto or kernel=torch."
                )
        if cfg.sparsify.relu and not cfg.init:
            raise ValueError(
                "sparsify.relu=true sparsifies a pretrained model: give it with init=<checkpoint>. A model "
                "trained from scratch is ReLU already (model.hidden_act=relu)."
            )
        if cfg.sparsity.l1_warmup_shape not in L1_WARMUP_SHAPES:
            raise ValueError(
                f"sparsity.l1_warmup_shape={cfg.sparsity.l1_warmup_shape!r}; use one of {', '.join(L1_WARMUP_SHAPES)}."
            )
        t = cfg.trainer
        if t.compile:
            check_compile_setup(t.compile_backend, self.acc.distributed_type == DistributedType.FSDP)
        if t.cuda_graphs:
            check_cuda_graphs_setup(t, self.acc.device)
        if cfg.trainer.max_steps < 0:
            raise ValueError(
                f"trainer.max_steps={cfg.trainer.max_steps}: give a step count >= 1 (or 0, which writes "
                "the initialised model to final/ without training)."
            )
        if 0 < cfg.trainer.max_steps <= cfg.trainer.warmup_steps:
            log.warning(
                "trainer.warmup_steps=%d >= trainer.max_steps=%d: the learning rate never reaches its peak.",
                cfg.trainer.warmup_steps,
                cfg.trainer.max_steps,
            )
        fresh = cfg.checkpoint.resume in ("", "none", "None")
        leftovers = [
            p.name
            for p in (self.run_dir / "checkpoints", self.run_dir / "final", self.run_dir / "metrics.jsonl")
            if p.exists()
        ]
        if fresh and leftovers:
            raise FileExistsError(
                f"{self.run_dir} already holds a run ({', '.join(leftovers)}). Continue it with "
                "checkpoint.resume=auto, or start a new one with another run_name."
            )
        if cfg.checkpoint.resume == "auto" and "final" in leftovers and not ckpt.list_checkpoints(self.run_dir):
            raise FileExistsError(
                f"{self.run_dir} holds a finished run (final/) but no step checkpoint to continue from: "
                "checkpoint.resume=auto would train from scratch and overwrite its final model. Start a new run with "
                "another run_name (checkpoint.every=N keeps step checkpoints that a run can continue from)."
            )

    def _build_model(self) -> tuple[torch.nn.Module, dict[str, float]]:
        """The model to train, and the metrics to log at step 0 besides the validation CE: a fresh model
        from cfg.model, or init's checkpoint (its weights unless the run resumes), its gate turned ReLU where
        sparsify.relu asks, after the dense model's validation CE was measured."""
        cfg = self.cfg
        if self.init is None:
            return build_model(cfg.model, self.data.vocab_size, cfg.kernel), {}
        resuming = ckpt.resolve_resume(cfg.checkpoint.resume, self.run_dir) is not None
        model = stock_model(self.init, weights=not resuming)
        if not resuming:
            log.info("init: starting from the weights of %s", self.init.path)
        metrics = {}
        if cfg.sparsify.relu and model.config.hidden_act == "relu":
            log.info("sparsify.relu: %s has a ReLU gate already; nothing to swap.", self.init.path)
        elif cfg.sparsify.relu:
            if not resuming and cfg.trainer.val_every:
                metrics["val/ce_dense_source"] = self._val_ce(model.to(self.acc.device))
            log.info(
                "sparsify.relu: the FFN gate's %s becomes a ReLU; the L1 term sparsifies it from here.",
                model.config.hidden_act,
            )
            swap_to_relu(model)
            cfg.model.hidden_act = "relu"
        note = kernel_width_note(model.config, cfg.kernel)
        if note and self.acc.is_main_process:
            log.warning("init: %s.", note)
        return prepare_model(model, cfg.kernel), metrics

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self.acc.reduce(tensor, reduction=op) if self.acc.num_processes > 1 else tensor

    # ----------------------------------------------------------------------------------------- state
    def _trainer_state(self) -> dict[str, Any]:
        loaders = gather_object([self.loader.state_dict()])
        return {
            "step": self.step,
            "loaders": loaders,
            "world_size": self.acc.num_processes,
            "tokens_seen": self.step * self.plan.tokens_per_step,
        }

    def _resume(self) -> None:
        outcome = [self._resume_check.outcome()]
        if self.acc.num_processes > 1:
            broadcast_object_list(outcome)  # the main process verified: every rank takes its choice, or its error
        path, error = outcome[0]
        if error is not None:
            raise error
        if path is None:
            return
        state, rank_state = ckpt.load_checkpoint(self.acc, path)
        if state["world_size"] != self.acc.num_processes:
            raise UserInputError(
                path,
                f"was written by {state['world_size']} processes, this launch has {self.acc.num_processes}",
                "Resume with the same number of processes.",
            )
        self.loader.load_state_dict(state["loaders"][self.acc.process_index])
        if rank_state is not None:
            self.tracker.load_state_dict(rank_state["sparsity"])
        self.step = state["step"]
        log.info("Resumed from %s at step %d", path, self.step)
        if self.step >= self.cfg.trainer.max_steps:
            log.warning(
                "The checkpoint is at step %d, trainer.max_steps=%d: nothing left to train, writing final/ "
                "from it. Raise trainer.max_steps to train on.",
                self.step,
                self.cfg.trainer.max_steps,
            )

    def _save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.acc,
            self.model,
            self.data.tokenizer,
            self.run_dir,
            self.step,
            self._trainer_state(),
            {"sparsity": self.tracker.state_dict()},
            self.cfg.checkpoint.keep_last,
        )
        if self.acc.is_main_process:
            log.info("Checkpoint: %s", path)
        return path

    # ------------------------------------------------------------------------------------------ loop
    def _micro_step(self, batch: torch.Tensor, coeff: float, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
        no_sync = contextlib.nullcontext() if sync else self.acc.no_sync(self.model)
        if self.cfg.trainer.cuda_graphs:
            # The last micro-batch's backward has run: its graphs' outputs may be overwritten from here on (the
            # weight gradients are held tensors that the graphs' outputs were added into: `hold_gradients`).
            torch.compiler.cudagraph_mark_step_begin()
        with no_sync, self.acc.autocast():
            out = self.model(input_ids=batch, labels=batch, use_cache=False)
            results = self.tracker.collect()
            l1 = l1_term(results, self.tracker.l1_weights_L) if results else out.loss.new_zeros(())
            loss = out.loss + coeff * l1
            self.acc.backward(loss / self.plan.accumulation)
        self.tracker.accumulate(results)
        return out.loss.detach(), l1.detach()

    def _step_scope(self) -> contextlib.AbstractContextManager[None]:
        """`step_scope.optimizer_step` for this run's micro-batches, on one process and under DDP. Not under FSDP: it
        gathers the weights anew for every forward and reduces gradients from hooks of its own. On a GPU the sparse
        op's forwards are graphs (`graphs_sparse_forwards`)."""
        fsdp = self.acc.distributed_type == DistributedType.FSDP
        graph_forwards = graphs_sparse_forwards(self.cfg.trainer, self.acc.device, fsdp)
        return optimizer_step(reuse_casts=not fsdp, add_into_grads=not fsdp, graph_forwards=graph_forwards)

    def _optimizer_step(self, stop: StopSignals) -> StepReadout:
        """Issue one update; its metrics and the ranks' stop votes come back through the returned readout.

        With a fused optimizer nothing here waits for the device: a non-finite step's update is skipped on the
        device, and the host goes on to the next step while the device runs this one (`_read_steps`).
        """
        sparsity = self.cfg.sparsity
        coeff = l1_coefficient(self.l1, self.step, sparsity.l1_warmup_steps, sparsity.l1_warmup_shape)
        ce_sum = torch.zeros((), device=self.acc.device)
        l1_sum = torch.zeros((), device=self.acc.device)
        with self._step_scope():
            for micro in range(self.plan.accumulation):
                batch = self.loader.next_batch().to(self.acc.device, non_blocking=True)
                ce, l1 = self._micro_step(batch, coeff, sync=micro == self.plan.accumulation - 1)
                ce_sum += ce
                l1_sum += l1
        optimizer = self.optimizer.optimizer  # the torch optimizer inside accelerate's wrapper
        grad_norm = None
        max_norm = self.cfg.trainer.grad_clip or math.inf  # an infinite bound measures the norm and scales by 1
        if self.acc.distributed_type != DistributedType.FSDP:  # FSDP's norm is over shards: accelerate computes it
            grad_norm = defer_clipping(optimizer, self.model.parameters(), max_norm)
        if grad_norm is None:
            grad_norm = plain_tensor(self.acc.clip_grad_norm_(self.model.parameters(), max_norm))
        # One all-reduce and one host transfer per step (not per layer), which also carry the ranks' stop votes.
        world = self.acc.num_processes
        stop_vote = torch.tensor(float(stop.requested is not None), device=self.acc.device)
        summed = self._reduce(
            torch.stack([ce_sum / self.plan.accumulation, l1_sum / self.plan.accumulation, stop_vote]), "sum"
        )
        values = torch.cat(
            [
                summed[:2] / world,
                summed[2:],
                torch.as_tensor(grad_norm, device=summed.device, dtype=summed.dtype).reshape(1),
            ]
        )
        readout = StepReadout(self.step + 1, HostCopy(values), coeff, self.scheduler.get_last_lr()[0])
        if not skip_update_if_non_finite(optimizer, values):
            readout.read()  # stops here, before a non-finite update reaches the weights
        self.optimizer.step()
        optimizer.grad_scale = None  # the deferred clip and the skip applied to this step only
        optimizer.found_inf = None
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.grads_held)
        readout.reinit_neurons = self.tracker.end_optimizer_step(self.step, self.cfg.seed)
        return readout

    def _read_steps(self, issued: StepReadout, now: bool) -> tuple[dict[str, Any] | None, bool]:
        """Read the step issued before `issued`, and `issued` itself when `now` (else keep it for the next call).

        Returns the metrics of the latest step read (None if none was), and whether any rank voted to stop in the
        steps read. Read one step late, a step's values have landed or are about to while the device already
        runs the next one: the host stays a step ahead instead of draining the device at every step. Steps that
        are logged, validated, saved or last are read at once. Every rank reads the same steps, so all see
        the same votes and stop at the same step.
        """
        earlier, self._unread = self._unread, None if now else issued
        metrics, stop = None, False
        for readout in (earlier, issued if now else None):
            if readout is not None:
                metrics, voted = readout.read()
                stop = stop or voted
        return metrics, stop

    @torch.no_grad()
    def _val_ce(self, model: torch.nn.Module) -> float:
        """`model`'s mean CE over the validation batches (and ranks); leaves it in eval mode."""
        model.eval()
        total = torch.zeros((), device=self.acc.device)
        for batch in self.val:
            with self.acc.autocast():
                batch = batch.to(self.acc.device)
                total += model(input_ids=batch, labels=batch, use_cache=False).loss
        return float(self._reduce(total / max(len(self.val), 1), "mean"))

    def validate(self) -> dict[str, float]:
        ce = self._val_ce(self.model)
        self.model.train()
        return {"val/ce": ce, "val/ppl": math.exp(min(ce, 50.0))}

    def _window_metrics(self, window: MeasureWindow) -> dict[str, Any]:
        seconds, joules = window.close()
        tokens = window.steps * self.plan.tokens_per_step
        metrics: dict[str, Any] = {
            "tokens_per_s": tokens / seconds,
            "step_time_s": seconds / window.steps,
            "tokens_seen": self.step * self.plan.tokens_per_step,
        }
        if joules is not None:
            joules = float(self._reduce(torch.tensor(joules, device=self.acc.device), "sum"))
            metrics.update(energy_j=joules, mj_per_token=1e3 * joules / tokens, power_w=joules / seconds)
        if self.acc.device.type == "cuda":
            peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=self.acc.device)
            metrics["peak_mem_gb"] = float(self._reduce(peak, "max"))
            flops_peak = peak_flops(torch.cuda.get_device_name())
            if flops_peak and self.acc.mixed_precision == "bf16":
                flops = model_flops_per_token(self.hf_config, self.n_params, self.plan.seq_len)
                metrics["mfu"] = flops * metrics["tokens_per_s"] / (flops_peak * self.acc.num_processes)
        metrics.update(self.tracker.read_window())
        metrics.update(self.tracker.backends())
        return metrics

    def _is_due(self, every: int) -> bool:
        return bool(every) and (self.step % every == 0 or self.step == self.cfg.trainer.max_steps)

    def run(self) -> Path:
        self._resume()
        t = self.cfg.trainer
        telemetry = Telemetry(
            self.cfg.logging,
            self.run_dir,
            OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True),
            self.acc.is_main_process,
            t.max_steps,
            start_step=self.step,
        )
        if self.acc.is_main_process:
            log.info(
                "Model: %s, %.1fM parameters; %d tokens/step (%d ranks x %d micro-batches x %d x %d)",
                self.cfg.model.name,
                self.n_params / 1e6,
                self.plan.tokens_per_step,
                self.plan.world,
                self.plan.accumulation,
                self.plan.micro_batch,
                self.plan.seq_len,
            )
        if self.init is not None and self.step == 0 and t.val_every:
            # Where the run starts from, on the batches every later validation uses.
            telemetry.log(0, {**self.start_metrics, **self.validate()})
        self.model.train()
        window = MeasureWindow(self.energy, self.acc.device)
        try:
            with StopSignals() as stop, FrozenHeap() as heap:
                while self.step < t.max_steps:
                    try:
                        saved, stop_agreed = self._train_step(window, telemetry, stop)
                    except torch.OutOfMemoryError as err:
                        raise self._out_of_memory() from err
                    heap.freeze()
                    if stop_agreed and self.step < t.max_steps:
                        checkpoint = saved or self._save()
                        raise TrainingStopped(stop.requested, self.step, str(checkpoint))
        finally:
            telemetry.close()
        return self._finish()

    def _out_of_memory(self) -> UserInputError:
        """What to change when a step does not fit the accelerator: the micro-batch, or recomputed activations."""
        device = self.acc.device
        where = str(device)
        if device.type == "cuda":
            where = f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB GPU"
        fix = "Lower trainer.micro_batch (trainer.global_batch stays: more micro-batches per step)"
        if not self.cfg.trainer.gradient_checkpointing:
            fix += " or set trainer.gradient_checkpointing=true"
        return UserInputError(
            "trainer.micro_batch",
            f"step {self.step + 1} ran out of memory on the {where} with {self.plan.micro_batch} sequences of "
            f"{self.plan.seq_len} tokens per micro-batch",
            f"{fix}; checkpoints saved so far continue with checkpoint.resume=auto",
        )

    def _train_step(self, window: MeasureWindow, telemetry: Telemetry, stop: StopSignals) -> tuple[Path | None, bool]:
        """One optimizer step with its logging, validation and checkpoint.

        Returns the checkpoint's path if one was due, and whether the ranks agreed to stop (see _optimizer_step).
        """
        t = self.cfg.trainer
        issued = self._optimizer_step(stop)
        self.step += 1
        switched = self.tracker.switches()
        if switched and self.acc.is_main_process:
            log.info("step %d: FFN layers changed backend: %s", self.step, "; ".join(switched))
        window.steps += 1
        logging_now = telemetry.should_log(self.step)
        val_now = self._is_due(t.val_every)
        save_now = bool(self.cfg.checkpoint.every) and self.step % self.cfg.checkpoint.every == 0
        last = self.step == t.max_steps
        metrics, stop_agreed = self._read_steps(issued, now=logging_now or val_now or save_now or last)
        telemetry.advance(self.step, metrics and {"loss": f"{metrics['loss']:.3f}"})
        if logging_now:
            metrics.update(self._window_metrics(window))
        elif val_now or save_now:
            window.pause()
        if val_now:
            val = self.validate()
            metrics.update(val)
            if not logging_now:
                telemetry.log(self.step, val)
        if logging_now:
            telemetry.log(self.step, metrics)
        saved = self._save() if save_now else None
        if logging_now:
            window.restart()
        elif val_now or save_now:
            window.resume()
        return saved, stop_agreed

    def _finish(self) -> Path:
        """Write `final/` atomically (eval.py picks the newest `final/`, never a half-written one)."""
        final = self.run_dir / "final"
        partial = final.with_name("final.partial")
        with ckpt.written_or_removed(partial, final, self.run_dir, self.cfg.checkpoint.keep_last):
            ckpt.export_model(self.acc, self.model, self.data.tokenizer, partial)
            if self.acc.is_main_process:
                summary = {"step": self.step, "tokens_seen": self.step * self.plan.tokens_per_step, "l1": self.l1}
                (partial / "training_summary.json").write_text(json.dumps(summary, indent=1))
                write_manifest(partial)
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
        if self.acc.is_main_process:
            self._plot()
        self.acc.wait_for_everyone()
        return final

    def _plot(self) -> None:
        try:
            log.info("Training curves: %s", plot_run(self.run_dir))
        except ImportError as err:  # matplotlib is an optional extra
            log.warning("No training plot: %s", err)
        except NothingToPlot as err:  # no step was logged, e.g. trainer.max_steps=0 exports the initial model
            log.info("No training plot: %s", err)


def train(cfg: TrainConfig, run_dir: Path) -> Path:
    trainer = Trainer(cfg, run_dir)
    final = trainer.run()
    trainer.acc.end_training()  # leaves the process group (NCCL warns at exit where a run does not)
    return final
