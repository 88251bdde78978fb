"""What holds for the micro-batches of one optimizer step, for the sparse training op to rely on.

Between two updates the weights do not change, and the gradients of a step's micro-batches are summed into the
parameters' `.grad`. Inside `optimizer_step(...)` the training op (`twell.train_op.twell_train_ffn`) uses both facts:

- reuse_casts: the bf16 copies it makes of float32 master weights (and w_down's transpose) are made by the step's
  first micro-batch and reused by the others, instead of one cast of each weight per layer call.
- add_into_grads: its backward adds the weight gradients straight into a `.grad` that is already allocated (held
  over the step, or left by the step's first micro-batch) and hands autograd no gradient for those weights. Handing
  autograd a separate gradient costs three passes over it (write it, then read it and `.grad`, write `.grad`); adding
  in place costs two. Only where a backward accumulates into `.grad` (not `torch.autograd.grad`) and no tensor hook
  waits for the gradient (`held_grads`). DDP's reducer reads `.grad` after the weight's AccumulateGrad node has run,
  which it still does (with no gradient to add), so it all-reduces the sums (tests/helpers/ddp_step_scope_check.py); the
  trainer turns this on for one process and under DDP, not under FSDP, whose unsharded gradients are its own.
- graph_forwards: its forward replays one CUDA graph per layer (`twell.graphs`), whose outputs the layer's next forward
  rewrites. For steps where each micro-batch's backward runs before the next micro-batch's forward (no gradient
  checkpointing, whose recompute is a second forward), as the compiled layers' CUDA graphs also demand.

Outside the block neither happens. The block is entered once per optimizer step (train.py's trainer and
scripts/bench_model.py's TrainStep), so nothing cached outlives the step it was made in: weights written through
`.data` between steps (dead-neuron reinit) cannot leave a stale copy behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

Tensor = torch.Tensor


@dataclass
class _Scope:
    reuse_casts: bool
    add_into_grads: bool
    graph_forwards: bool
    # key -> (the weights' versions when made, the tensor made): see `reused_cast`
    casts: dict[tuple, tuple[tuple[int, ...], Tensor]] = field(default_factory=dict)


_current: _Scope | None = None


@contextlib.contextmanager
def optimizer_step(
    reuse_casts: bool = True, add_into_grads: bool = False, graph_forwards: bool = False
) -> Iterator[None]:
    """Within the block: one optimizer step's micro-batches (forward and backward), with the uses of that fact named
    in the module docstring switched on. Not reentrant: a step holds no other step."""
    global _current
    if _current is not None:
        raise RuntimeError("optimizer_step() is already active: enter it once per optimizer step")
    _current = _Scope(reuse_casts, add_into_grads, graph_forwards)
    try:
        yield
    finally:
        _current = None


def adding_into_grads() -> bool:
    """Whether calls made now may add their weight gradients into `.grad` (`held_grads` decides per call)."""
    return _current is not None and _current.add_into_grads


def graphing_forwards() -> bool:
    """Whether calls made now may replay their forward as a CUDA graph (`twell.graphs`)."""
    return _current is not None and _current.graph_forwards


def reused_cast(weights: tuple[Tensor, ...], dtype: torch.dtype, make: Callable[[], Tensor]) -> Tensor:
    """make() (a tensor computed from `weights` alone, e.g. their casts to `dtype`), made once per optimizer step.

    Outside `optimizer_step(reuse_casts=True)` it is made every call. Inside, the first call's tensor is kept for the
    step, keyed on the weights' identity and storage; it is made again if any weight's version has moved (an
    in-place write within the step).
    """
    if _current is None or not _current.reuse_casts:
        return make()
    key = (dtype, *((id(w), w.data_ptr()) for w in weights))
    versions = tuple(w._version for w in weights)
    kept = _current.casts.get(key)
    if kept is not None and kept[0] == versions:
        return kept[1]
    made = make()
    _current.casts[key] = (versions, made)
    return made


def held_grads(weights: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
    """The `.grad` of each weight, to add this backward's weight gradients into, or None: then the gradients go to
    autograd as usual. Call it from a backward. All or none: each weight must be a float32 leaf whose `.grad` is a
    plain, contiguous, 16-byte aligned float32 tensor of its shape, with no tensor hooks, that this backward
    accumulates into `.grad` (not `torch.autograd.grad`, nor `.backward(inputs=...)` without it), outside a
    differentiable backward (create_graph)."""
    if torch.is_grad_enabled() or not all(_accumulated_here(w) for w in weights):
        return None
    grads = []
    for w in weights:
        g = w.grad
        plain = (
            w.is_leaf
            and w.requires_grad
            and w.dtype == torch.float32
            and not w._backward_hooks
            and not w._post_accumulate_grad_hooks
            and g is not None
            and g.layout == torch.strided
            and g.dtype == torch.float32
            and g.shape == w.shape
            and g.device == w.device
            and g.is_contiguous()
            and g.data_ptr() % 16 == 0
        )
        if not plain:
            return None
        grads.append(g)
    return tuple(grads)


def _accumulated_here(w: Tensor) -> bool:
    """Whether the running backward accumulates into leaf w's `.grad` (runs its AccumulateGrad node)."""
    if not (w.is_leaf and w.requires_grad):
        return False
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(w).node)
    except RuntimeError:  # torch.autograd.grad, which never accumulates into .grad, refuses the question for leaves
        return False
