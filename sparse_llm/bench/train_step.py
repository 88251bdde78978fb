"""The training step the benchmarks time: one optimizer step as train.py runs it on a GPU, split in phases."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import LlamaForCausalLM

from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.model.llama import sparse_mlps
from sparse_llm.training.config import TrainConfig
from sparse_llm.training.sparsity import l1_term
from sparse_llm.training.trainer import (
    HostCopy,
    defer_clipping,
    graphs_sparse_forwards,
    hold_gradients_for_graphs,
    make_optimizer,
    skip_update_if_non_finite,
)


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
        cfg = TrainConfig()
        # the training op's forward as a CUDA graph per layer (`twell.graphs`); by default where the trainer does
        default = graphs_sparse_forwards(cfg.trainer, ids.device)
        self.graph_forwards = default if graph_forwards is None else graph_forwards
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
