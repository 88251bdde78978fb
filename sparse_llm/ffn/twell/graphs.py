"""The training op's forward replayed as one CUDA graph per layer, in the training steps of a GPU.

The sparse FFN op runs eagerly (with `trainer.cuda_graphs=true`, between the compiled layers' graphs). Issuing it (a
GEMM, a handful of CuPy launches, a dozen allocations and their Python) takes the host longer than the device needs for
the layer's forward, so the device would idle in every forward of a step the host sets the pace of
(docs/performance.md, "Limits that hold today"). The forward reads nothing back to the host, so it can be captured:
`GraphedForward` runs a layer's first call eagerly (which also compiles the kernels and sets their shared-memory
limits), captures its kernels at the second call, and from then on replays them: one copy of x into the graph's input
and one graph launch. The trainer turns this on wherever a GPU trains without gradient checkpointing or FSDP
(`training.trainer.graphs_sparse_forwards`). The heavy-token count's device-to-host copy
stays outside the graph, into a fresh pinned tensor per call, so that a count read late (the backward, the sparsity
statistics) reads its own call's count.

The cost is the contract of a graphed step, as for torch.compile's graphs: a replay returns the graph's own output
buffers, which the layer's next replay rewrites. A training step runs each micro-batch's backward before the next
micro-batch's forward, so nothing is rewritten before it is read; a backward whose forward has been replayed over
raises (`ReplayToken.check`) rather than computing gradients from another micro-batch's activations.

Memory: each layer keeps its graph's outputs (y, the saved sparse state, the statistics: ~45 MB per layer at 8192
tokens, K = 2048, N = 5632) in a pool of its own; the input copy and the [M, N] gate GEMM output are one pair of
buffers shared by every layer of that shape, since replays run one after another on one stream.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from sparse_llm.cuda import runtime
from sparse_llm.ffn.twell.train_launch import COUNTS_OUTPUT, compute_weights_shape, forward_kernels, new_counts_host

Tensor = torch.Tensor


@dataclass(frozen=True)
class ReplayToken:
    """Which replay of which of a layer's graphs produced a forward's outputs; `check` in its backward."""

    graphed: GraphedForward
    graph: torch.cuda.CUDAGraph
    replay: int

    def check(self) -> None:
        """Raise if that graph has been replayed since, i.e. the saved outputs now hold a later call's. A graph the
        layer has dropped since (a new shape) never rewrites them again."""
        if self.graphed.graph is self.graph and self.graphed.replays != self.replay:
            raise RuntimeError(
                "The sparse training op's forward was replayed again before this forward's backward ran, so the "
                "activations saved for it were overwritten. Graphed forwards (step_scope.optimizer_step("
                "graph_forwards=True), on in GPU training without gradient checkpointing) need each micro-batch's "
                "backward before the same layer's next forward: no second forward of a layer per backward."
            )


class GraphedForward:
    """One layer's training forward (`train_launch.forward_kernels`) as a CUDA graph, captured at its second call."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # what the graph was made for: shapes, dtype, width, dense rows, weight addresses
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Tensor, ...] = ()  # the graph's output buffers (forward_kernels' outputs, count on device)
        self.replays = 0
        self.eager_calls = 0
        self._compute_RK: Tensor | None = None

    def compute_buffer(self, w_gate_NK: Tensor, dtype: torch.dtype) -> Tensor:
        """Where the layer's `train_launch.compute_weights` are to be written: the graph reads them at a fixed
        address, so the casts of every step go into this one tensor."""

        shape = compute_weights_shape(w_gate_NK, dtype)
        kept = self._compute_RK
        if kept is None or kept.shape != shape or kept.dtype != dtype or kept.device != w_gate_NK.device:
            self._compute_RK = torch.empty(shape, dtype=dtype, device=w_gate_NK.device)
        return self._compute_RK

    def forward(
        self, x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, width: int, w_compute_RK: Tensor, dense_rows: int = 0
    ) -> tuple[tuple[Tensor, ...], ReplayToken | None]:
        """forward_kernels' outputs (the count as a pinned CPU int32 [1], as `_cuda_forward` returns it) and the token
        of the replay that made them (None: an eager call's, whose outputs are its own). A new dense_rows is captured
        anew, as a new shape is: it changes with the layer's observed tail, once per statistics window at most."""

        key = (
            x_MK.shape,
            x_MK.dtype,
            x_MK.device,
            width,
            dense_rows,
            w_gate_NK.data_ptr(),
            w_up_NK.data_ptr(),
            w_compute_RK.data_ptr(),
            w_compute_RK.shape,
        )
        if key != self.key:  # a new shape or new weight storage: run eagerly once, capture at the next call
            self.key, self.graph, self.outputs, self.eager_calls = key, None, (), 0
        if self.graph is None and self.eager_calls == 0:
            self.eager_calls += 1
            outputs = forward_kernels(
                x_MK, w_gate_NK, w_up_NK, width, w_compute_RK, counts_host=new_counts_host(), dense_rows=dense_rows
            )
            return outputs, None
        x_in_MK, gate_MN = _shared_buffers(x_MK.device, *x_MK.shape, w_gate_NK.shape[0])
        x_in_MK.copy_(x_MK)
        if self.graph is None:
            self._capture(x_in_MK, gate_MN, w_gate_NK, w_up_NK, width, w_compute_RK, dense_rows)
        self.graph.replay()
        self.replays += 1
        counts_host = new_counts_host()
        counts_host.copy_(self.outputs[COUNTS_OUTPUT], non_blocking=True)
        # Fresh tensor objects over the same buffers: autograd records each call's history on its outputs.
        outputs = tuple(counts_host if i == COUNTS_OUTPUT else t.detach() for i, t in enumerate(self.outputs))
        return outputs, ReplayToken(self, self.graph, self.replays)

    def _capture(
        self,
        x_in_MK: Tensor,
        gate_MN: Tensor,
        w_gate_NK: Tensor,
        w_up_NK: Tensor,
        width: int,
        w_compute_RK: Tensor,
        dense_rows: int,
    ) -> None:

        make_room_for_capture(x_in_MK.device)
        main = torch.cuda.current_stream()
        side = _capture_stream(x_in_MK.device.index)
        side.wait_stream(main)  # x's copy and the weights' casts come first
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a data loader's, a logger's) may use CUDA while this one captures
        with torch.cuda.stream(side), own_cublas_workspace():
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = forward_kernels(
                    x_in_MK, w_gate_NK, w_up_NK, width, w_compute_RK, gate_MN=gate_MN, dense_rows=dense_rows
                )
            finally:
                graph.capture_end()
        main.wait_stream(side)
        self.graph, self.outputs = graph, outputs


# Free device memory below which a capture first returns torch's cached blocks to the device. A layer's capture takes
# ~45 MB at 8192 tokens (module docstring), so this is room for ~40 of them; the check costs a cudaMemGetInfo.
CAPTURE_HEADROOM_BYTES = 2 << 30


def make_room_for_capture(device: torch.device) -> None:
    """Give the cached blocks back to the device if little of it is free, so that the next capture has room.

    A graph's pool grows by cudaMalloc alone, and while a capture is underway torch's allocator may not free its cache
    to make room (that would synchronize the capturing stream). After steps of differently sized kernel buffers the
    cache held 18-28 GiB of an 80 GB H100 unused, and a layer captured anew at a backend switch or a new dense-row
    count ran out of memory (2B model, 4 x 2048 tokens per micro-batch, near step 90). Emptying the cache here
    synchronizes once, at a capture: a few per statistics window, not per step (torch.cuda.graph, which
    torch.compile's graphs enter, empties it at every capture)."""
    device_free, total = torch.cuda.mem_get_info(device)
    # a process capped by torch.cuda.set_per_process_memory_fraction has less than the device has free
    process_free = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    if min(device_free, process_free) < CAPTURE_HEADROOM_BYTES:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def own_cublas_workspace() -> Iterator[None]:
    """Within the block, a captured GEMM's cuBLAS workspace is the graph's own.

    cuBLAS keeps one workspace per stream, made at its first GEMM there. A GEMM captured into a graph keeps using
    that address on every replay, but the workspace is not the graph's to keep: torch.compile's CUDA graphs free every
    stream's workspace whenever they record (torch._inductor.cudagraph_trees.clear_cublass_cache), and a workspace
    made during another layer's capture is that layer's pool, released when its graph is dropped. Replays then write
    into memory the allocator has handed out again: in a 2B training step, a crash ("unspecified launch failure")
    at the first replays after a validation pass, once the dense-row GEMMs (which take a workspace) were captured.
    Dropping the workspaces before the capture makes its GEMMs allocate one in this graph's private pool, which
    nothing else allocates from; dropping them after keeps any later GEMM on the stream off it."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


@functools.lru_cache(maxsize=8)
def _shared_buffers(device: torch.device, m: int, k: int, n: int) -> tuple[Tensor, Tensor]:
    """(x_in_MK, gate_MN): bf16 [M, K] and [M, N] read and written by every layer's graph of that shape in turn."""
    with runtime.on_device(device):
        return (
            torch.empty(m, k, dtype=torch.bfloat16, device=device),
            torch.empty(m, n, dtype=torch.bfloat16, device=device),
        )


_graphed: dict[int, GraphedForward] = {}  # id(w_gate_NK) -> its layer's graph


def graphed_forward(w_gate_NK: Tensor) -> GraphedForward:
    """The GraphedForward of the layer whose gate weight is w_gate_NK (a parameter: the same tensor every call),
    dropped with the weight."""
    key = id(w_gate_NK)
    graphed = _graphed.get(key)
    if graphed is None:
        graphed = _graphed[key] = GraphedForward()
        weakref.finalize(w_gate_NK, _graphed.pop, key, None)
    return graphed


def release_graphs() -> None:
    """Drop every layer's graph with its output and cast buffers, and the shared input and gate buffers: their memory
    goes back to torch's cache (a benchmark measuring another path next, a process done with its model). A layer's next
    graphed call runs eagerly and captures anew."""
    _graphed.clear()
    _shared_buffers.cache_clear()
