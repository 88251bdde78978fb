"""`SparseMLP`: a drop-in `LlamaMLP` (ReLU gate) that runs through a chosen backend and exposes its sparsity.

Same parameter names and shapes as `transformers`' `LlamaMLP` (gate_proj, up_proj, down_proj, no bias), so
state dicts stay plain HF Llama checkpoints. The forward computes y = (relu(x Wg^T) * (x Wu^T)) Wd^T through
the backend that the layer's `LayerDispatcher` picks, and keeps the backend's `FFNResult` of the latest
call in `last_result` (the L1 sum with its graph, per-token L0, fired neurons). The trainer reads it right
after the model's forward; reading it there, not in the loss of a later call, keeps gradient-checkpointing
recomputation (which re-runs this forward during backward) from double counting.

Training calls always carry those statistics. Inference calls (no grad) carry them only inside
`recording_statistics(model)`, or where the layer refreshes its backend decision: on the dense path they
cost four extra passes over the [M, N] activation, about 10% of a 1B model's forward, which generation
and lm-eval scoring do not need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from sparse_llm.ffn.backend import FFNBackend, FFNResult
from sparse_llm.ffn.dispatch import LayerDispatcher, density_of

# Outside the trainer, a layer refreshes its backend decision from its own statistics on its first call
# and then every this many calls (each refresh costs one host sync).
SELF_OBSERVE_EVERY = 64


class SparseMLP(nn.Module):
    """Gated ReLU feedforward block with L1/L0 bookkeeping and a per-layer backend switch.

    Args:
        hidden_size: K, model width.
        intermediate_size: N, FFN width.
        kernel: "auto" | "torch" | "twell" (see `sparse_llm.ffn.dispatch`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, kernel: str = "auto") -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.dispatcher = LayerDispatcher(kernel)
        self.self_observe = True  # the trainer turns this off and feeds rank-reduced statistics instead
        self.record_statistics = False  # inference calls keep L1/L0/fired in last_result (recording_statistics)
        self.in_cuda_graph = False  # calls run in (or warm up for) a CUDA graph: no host time per call (cuda_graphed)
        self.compile_backend: str | None = None  # torch.compile backend of the torch path's block (compile_layers)
        self.last_result: FFNResult | None = None
        self._calls = 0

    # torch.compile (e.g. `compile_layers`) runs this eagerly between the compiled parts of a layer: the backend
    # choice and the statistics kept in `last_result` are host-side state, and the kernels are CuPy launches.
    @torch.compiler.disable
    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_writable: bool = False,
        next_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x: [..., K] -> [..., K]; plus `residual` (x's shape) when given: a decoder layer's residual add done here
        (`model.FusedDecoderLayer`), which the sparse inference kernels fold into their output. With
        `residual_writable` the caller gives up `residual`: the result may be written into its memory (the dense
        path's down GEMM then adds into it, `torch_backend.add_linear_`).

        With `next_norm` = (weight [K], eps), the next layer's input RMSNorm (F.rms_norm's arithmetic), the call
        returns (output, normed): normed is that norm of the output where the backend wrote it as it stored the
        output (the sparse inference kernels' one-warp walk), else None, and the caller applies the norm."""
        x_MK = x.reshape(-1, self.hidden_size)
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual has shape {list(residual.shape)}; it must match x's {list(x.shape)}")
        training = torch.is_grad_enabled()
        compiled = self.compile_backend is not None
        observing = self.self_observe and self._calls % SELF_OBSERVE_EVERY == 0
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        call = dict(
            training=training,
            compile_backend=self.compile_backend,
            residual_MK=None if residual is None else residual.reshape(x_MK.shape),
            residual_writable=residual_writable and residual is not None and not training,  # autograd may need it
            l0=self.dispatcher.l0,
            tail=self.dispatcher.tail,
            output_norm=next_norm,
        )
        scratch: list[torch.Tensor] = []

        def trial(backend: FFNBackend) -> object:
            """This call's block on `backend`, for the dispatcher to time as the call will run. A writable residual
            is one the dense path adds into: the trial's calls add into a copy of it, made on the first (untimed)."""
            if not call["residual_writable"]:
                return backend.forward(x_MK, *weights, statistics=False, **call)
            if not scratch:
                scratch.append(call["residual_MK"].clone())
            return backend.forward(x_MK, *weights, statistics=False, **{**call, "residual_MK": scratch[0]})

        backend = self.dispatcher.choose(
            x_MK,
            weights[0],
            training=training,
            compiled=compiled,
            trial=None if training else trial,
            graphed=self.in_cuda_graph,
        )
        result = backend.forward(x_MK, *weights, statistics=self.record_statistics or observing, **call)
        # Written past nn.Module.__setattr__, which first looks for a parameter, buffer or submodule of the name
        # (~1.3 us
        # a write on a CPU, more on a GPU machine's host): an eager decoding step pays this per layer and token.
        object.__setattr__(self, "last_result", result)
        if observing and result.l0_M.numel():
            self.dispatcher.observe(*density_of(result.l0_M))
        object.__setattr__(self, "_calls", self._calls + 1)
        normed_MK, result.normed_MK = result.normed_MK, None  # the next layer's input: last_result must not keep it
        if next_norm is None:
            return result.y_MK.reshape(x.shape)
        return result.y_MK.reshape(x.shape), None if normed_MK is None else normed_MK.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, ffn={self.intermediate_size}, kernel={self.dispatcher.kernel}"


@contextlib.contextmanager
def _every_layer(model: nn.Module, attribute: str, value: bool) -> Iterator[None]:
    """Within the block every SparseMLP of `model` has `attribute` set to `value`; restored after."""
    mlps = [m for m in model.modules() if isinstance(m, SparseMLP)]
    before = [getattr(m, attribute) for m in mlps]
    for m in mlps:
        setattr(m, attribute, value)
    try:
        yield
    finally:
        for m, kept in zip(mlps, before, strict=True):
            setattr(m, attribute, kept)


def recording_statistics(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block, inference calls of every SparseMLP in `model` keep L1/L0/fired in `last_result`."""
    return _every_layer(model, "record_statistics", True)


def backends_held(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block no SparseMLP of `model` observes its own statistics, so each keeps the backend it has
    chosen and reads nothing back to the host (what a CUDA graph capture needs)."""
    return _every_layer(model, "self_observe", False)


def cuda_graphed(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Within the block every SparseMLP of `model` chooses its backend for calls replayed in a CUDA graph: by the
    device time of each path, with no trial of host-bound calls (`dispatch.HOST_BOUND_MS`). For a capture and the
    eager run before it, so that both choose alike."""
    return _every_layer(model, "in_cuda_graph", True)
