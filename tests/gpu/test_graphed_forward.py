"""The training op's forward replayed as a CUDA graph per layer (`twell.graphs`, `optimizer_step(graph_forwards=True)`):
every call's outputs, heavy-token count and gradients equal the eager op's on the same inputs, while the layer's
graph is
captured once and replayed; a backward whose forward was replayed over raises."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.ffn.step_scope import optimizer_step
from sparse_llm.ffn.twell import graphs as train_graphs
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn

K, N = 512, 1536
WIDTH = 32  # narrow ELL rows: a heavy tail puts tokens on the heavy route in every call


def master_weights(bf16: bool) -> list[torch.Tensor]:
    """Leaf weights as a layer holds them: fp32 masters (autocast casts them inside the op) or bf16."""
    _, wg, wu, wd = synthetic_block(64, K, N, 30, sigma=0.7, seed=0)
    return [w.to(torch.bfloat16 if bf16 else torch.float32).clone().requires_grad_() for w in (wg, wu, wd)]


def batches(ms: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, dy) per call, each drawn afresh: heavy-tailed tokens, so the heavy-token count differs call to call."""
    out = []
    for i, m in enumerate(ms):
        x = synthetic_block(m, K, N, 30, sigma=0.7, seed=10 + i)[0]
        dy = torch.randn(m, K, device="cuda", generator=torch.Generator("cuda").manual_seed(i)).bfloat16()
        out.append((x, dy))
    return out


def run(
    weights: list[torch.Tensor], calls: list[tuple[torch.Tensor, torch.Tensor]], graphs: bool, dense_rows: int = 0
) -> list[tuple]:
    """Per call: y, l1_sum, l0, fired, heavy count, and the gradients (dx and the weights', each call's own)."""
    results = []
    for x, dy in calls:
        x = x.clone().requires_grad_()
        with optimizer_step(reuse_casts=True, graph_forwards=graphs), torch.autocast("cuda", dtype=torch.bfloat16):
            r = twell_train_ffn(x, *weights, width=WIDTH, dense_rows=dense_rows)
            grads = torch.autograd.grad((r.y_MK.float() * dy.float()).sum() + 0.3 * r.l1_sum, (x, *weights))
        results.append((r.y_MK.clone(), r.l1_sum.clone(), r.l0_M.clone(), r.fired_N.clone(), r.dense_rows(), grads))
    return results


@pytest.mark.parametrize("dense_rows", [0, 1024], ids=["heavy-split", "heavy-dense-rows"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-masters", "bf16-weights"])
def test_graphed_forwards_equal_eager_calls_call_by_call(bf16, dense_rows):
    """With dense_rows = 1024 every heavy token takes the dense GEMMs inside the graph. (With fewer rows than heavy
    tokens, which ones take them follows the list's atomic order, so bits may differ from call to call.)"""
    weights = master_weights(bf16)
    # Two of one size (eager, then captured and replayed), a third replay, then a new size (eager again, captured)
    calls = batches([1024, 1024, 1024, 768, 768, 768])
    eager = run(weights, calls, graphs=False, dense_rows=dense_rows)
    graphed = run(weights, calls, graphs=True, dense_rows=dense_rows)
    assert train_graphs.graphed_forward(weights[0]).replays == 4  # two of each size: captured once per size
    counts = [e[4] for e in eager]
    assert min(counts) > 0 and len(set(counts)) > 1, f"heavy-token counts {counts}: the inputs test too little"
    for call, (e, g) in enumerate(zip(eager, graphed, strict=True)):
        for name, a, b in zip(("y", "l1_sum", "l0", "fired"), e[:4], g[:4], strict=True):
            assert torch.equal(a, b), f"call {call}: {name} differs from the eager op's"
        assert e[4] == g[4], f"call {call}: heavy-token count {g[4]}, eager {e[4]}"
        for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), e[5], g[5], strict=True):
            # the weight-gradient kernel sums long columns with fp32 atomics: last bits vary run to run
            error = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
            assert error < 1e-2, f"call {call}: {name} off by {error:.2e} of its max"


def test_backward_after_its_forward_was_replayed_over_raises():
    weights = master_weights(bf16=False)
    ((x, dy),) = batches([512])
    x = x.requires_grad_()
    with optimizer_step(graph_forwards=True), torch.autocast("cuda", dtype=torch.bfloat16):
        twell_train_ffn(x, *weights, width=WIDTH)  # eager: the first call of this shape
        first = twell_train_ffn(x, *weights, width=WIDTH)  # captured and replayed
        twell_train_ffn(x, *weights, width=WIDTH)  # replayed over the first one's outputs
        with pytest.raises(RuntimeError, match="replayed again before this forward's backward"):
            (first.y_MK.float() * dy.float()).sum().backward()


def test_captured_gemms_keep_their_workspace_when_cublas_drops_its_workspaces():
    """The graph's dense-row GEMMs write partial sums into a cuBLAS workspace on every replay. torch.compile's graphs
    drop every stream's workspace whenever they record; had the layer's graph been captured with a workspace made
    before it (here by a GEMM on the capture stream), that memory would be handed out again while replays still write
    into it. Sentinel tensors allocated over it after the drop must come through a replay untouched."""
    k, n, m, rows = 2048, 5632, 2048, 256  # 256 rows: the down GEMM is 2 x 16 tiles, split over K on an H100/H200
    x, wg, wu, wd = synthetic_block(m, k, n, 21, sigma=1.0, seed=3)
    side = train_graphs._capture_stream(x.device.index)
    with torch.cuda.stream(side):
        torch.mm(x[:rows], wg.t())  # the capture stream's workspace, made outside any graph

    def call() -> tuple[torch.Tensor, int]:
        with optimizer_step(graph_forwards=True):
            result = twell_train_ffn(x, wg, wu, wd, dense_rows=rows)
        return result.y_MK.clone(), result.dense_rows()

    eager_y, heavy = call()
    assert 0 < heavy <= rows, f"{heavy} heavy tokens: every one must take a dense row for y to be bitwise repeatable"
    call()  # captured, then replayed
    torch._C._cuda_clearCublasWorkspaces()  # as torch.compile's graphs do when they record
    with torch.cuda.stream(side):
        sentinels = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # 4 MiB each
    replayed_y, _ = call()
    torch.cuda.synchronize()
    overwritten = [i for i, s in enumerate(sentinels) if not bool((s == 7.0).all())]
    assert not overwritten, f"a replay wrote into sentinel tensors {overwritten}: its GEMMs used freed memory"
    assert torch.equal(replayed_y, eager_y)


def test_a_capture_gets_room_from_a_cache_holding_the_memory_left():
    """A graph's pool grows by cudaMalloc only, and the allocator cannot free its cache while a capture is underway:
    with the process's memory held by cached blocks (here one freed 1 GiB tensor, under a per-process cap that leaves
    8 MiB beyond it), the capture must first give the cache back or run out of memory."""
    k, n, m = 2048, 5632, 2048
    x, wg, wu, wd = synthetic_block(m, k, n, 21, sigma=1.0, seed=4)

    def call() -> torch.Tensor:
        with optimizer_step(graph_forwards=True):
            return twell_train_ffn(x, wg, wu, wd).y_MK.clone()

    eager_y = call()  # the first call of this shape runs eagerly; the next is captured
    total = torch.cuda.mem_get_info()[1]
    filler_bytes = 1 << 30
    cap = torch.cuda.memory_reserved() + filler_bytes + (8 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        filler = torch.empty(filler_bytes, dtype=torch.uint8, device="cuda")
        del filler  # cached: reserved, not allocated
        assert torch.cuda.memory_reserved() + (32 << 20) > cap, "the cache does not hold the process's memory"
        captured_y = call()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert train_graphs.graphed_forward(wg).replays == 1
    assert torch.equal(captured_y, eager_y)
