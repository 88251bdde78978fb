"""CPU tests of sparse_llm.ffn.step_scope and of the training op's use of it (the torch reference path; the kernels'
side
is tests/gpu/test_step_scope_gpu.py): weight casts reused over one optimizer step, weight gradients added into held
`.grad` tensors, and the cases where either must not happen."""

from __future__ import annotations

import gc
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers.entry_points import FORKED_RANK

from sparse_llm.ffn import step_scope
from sparse_llm.ffn.step_scope import held_grads, optimizer_step, reused_cast
from sparse_llm.ffn.twell import graphs as train_graphs
from sparse_llm.ffn.twell import train_op
from sparse_llm.ffn.twell.train_launch import STATE_NAMES
from sparse_llm.ffn.twell.train_op import twell_train_ffn

M, K, N, WIDTH = 24, 16, 64, 20
ROOT = Path(__file__).resolve().parents[1]


def master_weights(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).requires_grad_() for s in ((N, K), (N, K), (K, N))]


def tokens(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `micro`'s bf16 tokens [M, K] and output gradient, as autocast hands the op its input."""
    gen = torch.Generator().manual_seed(100 + micro)
    return torch.randn(M, K, generator=gen).bfloat16(), torch.randn(M, K, generator=gen).bfloat16()


def accumulate(weights: list[torch.Tensor], micro_batches: int, **scope) -> list[torch.Tensor]:
    """The weights' .grad after `micro_batches` forwards and backwards of the op, inside optimizer_step(**scope) when
    given."""
    context = optimizer_step(**scope) if scope else torch.autograd.set_grad_enabled(True)
    with context:
        for micro in range(micro_batches):
            x, dy = tokens(micro)
            result = twell_train_ffn(x, *weights, width=WIDTH)
            ((result.y_MK.float() * dy.float()).sum() + 0.01 * result.l1_sum).backward()
    return [w.grad for w in weights]


@pytest.fixture
def into_calls(monkeypatch) -> list[bool]:
    """For each backward of the op: whether it was handed gradients to add into."""
    calls = []
    reference = train_op._reference_backward

    def spy(*args, grads_into=None):
        calls.append(grads_into is not None)
        return reference(*args, grads_into=grads_into)

    monkeypatch.setattr(train_op, "_reference_backward", spy)
    return calls


def test_gradients_added_in_place_equal_autograds_sum(into_calls):
    """The first micro-batch finds no .grad and hands its gradients to autograd; the next two add into that .grad
    in place. The sums equal those of autograd's own accumulation, outside the scope."""
    plain = accumulate(master_weights(), 3)
    assert into_calls == [False, False, False]
    into_calls.clear()
    weights = master_weights()
    fused = accumulate(weights, 3, add_into_grads=True)
    assert into_calls == [False, True, True]
    for got, want in zip(fused, plain, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_held_gradients_are_added_into_from_the_first_micro_batch(into_calls):
    weights = master_weights()
    held = [torch.zeros_like(w) for w in weights]
    for w, g in zip(weights, held, strict=True):
        w.grad = g
    fused = accumulate(weights, 2, add_into_grads=True)
    assert into_calls == [True, True]
    assert all(got is g for got, g in zip(fused, held, strict=True))  # the same tensors, added into
    for got, want in zip(fused, accumulate(master_weights(), 2), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def held_in_a_backward(weights: tuple[torch.Tensor, ...], create_graph: bool = False) -> tuple | None:
    """held_grads(weights) as the op's backward calls it: from the backward of a function of the weights."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ws):
            return sum(w.sum() for w in ws)

        @staticmethod
        def backward(ctx, _):
            seen.append(held_grads(weights))
            return tuple(torch.zeros_like(w) for w in weights)

    Probe.apply(*weights).backward(create_graph=create_graph)
    return seen[0]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")  # the transposed case
def test_gradients_that_cannot_take_the_sums_go_to_autograd():
    """All or none of the three, and only plain float32 gradients with no hooks, outside a differentiable backward."""

    def weights_with(change) -> tuple[torch.Tensor, ...]:
        weights = master_weights()
        for w in weights:
            w.grad = torch.zeros_like(w)
        change(weights)
        return tuple(weights)

    assert held_in_a_backward(weights_with(lambda ws: None)) is not None
    refused = {
        "a grad missing": lambda ws: setattr(ws[2], "grad", None),
        "a tensor hook": lambda ws: ws[0].register_hook(lambda g: g),
        "a post-accumulate hook": lambda ws: ws[1].register_post_accumulate_grad_hook(lambda p: None),
        "a transposed grad": lambda ws: setattr(ws[0], "grad", torch.zeros(K, N).t()),
    }
    for what, change in refused.items():
        assert held_in_a_backward(weights_with(change)) is None, what
    bf16 = [w.detach().bfloat16().requires_grad_() for w in master_weights()]
    for w in bf16:
        w.grad = torch.zeros_like(w)
    assert held_in_a_backward(tuple(bf16)) is None
    # a backward with create_graph runs in grad mode: its gradients must be differentiable
    assert held_in_a_backward(weights_with(lambda ws: None), create_graph=True) is None


def test_autograd_grad_and_backward_of_other_inputs_never_add_in_place():
    """torch.autograd.grad, and .backward(inputs=...) without the weights, leave .grad alone: inside the scope too,
    autograd gets the gradients as ever."""
    weights = master_weights()
    for w in weights:
        w.grad = torch.zeros_like(w)
    x, dy = tokens(0)
    with optimizer_step(add_into_grads=True):
        result = twell_train_ffn(x, *weights, width=WIDTH)
        loss = (result.y_MK.float() * dy.float()).sum()
        grads = torch.autograd.grad(loss, weights)
    want = torch.autograd.grad((twell_train_ffn(x, *weights, width=WIDTH).y_MK.float() * dy.float()).sum(), weights)
    for got, w, expected in zip(grads, weights, want, strict=True):
        torch.testing.assert_close(got, expected)
        assert not w.grad.any()
    x = x.requires_grad_()
    with optimizer_step(add_into_grads=True):
        (twell_train_ffn(x, *weights, width=WIDTH).y_MK.float() * dy.float()).sum().backward(inputs=[x])
    assert x.grad is not None and not any(w.grad.any() for w in weights)


def test_casts_are_made_once_a_step_and_again_after_an_in_place_write():
    weights = master_weights()
    x, _ = tokens(0)

    def cast() -> torch.Tensor:
        return twell_train_ffn(x, *weights, width=WIDTH)  # FFNResult has no state: read it from the op's context

    with optimizer_step():
        first = cast().y_MK.grad_fn.saved_tensors[STATE_NAMES.index("w_compute_RK") + 4]
        second = cast().y_MK.grad_fn.saved_tensors[STATE_NAMES.index("w_compute_RK") + 4]
        assert second is first
        with torch.no_grad():
            weights[0].add_(1.0)
        third = cast().y_MK.grad_fn.saved_tensors[STATE_NAMES.index("w_compute_RK") + 4]
        assert third is not first
        torch.testing.assert_close(third[:N], weights[0].detach().bfloat16())
    outside = cast().y_MK.grad_fn.saved_tensors[STATE_NAMES.index("w_compute_RK") + 4]
    assert outside is not third and torch.equal(outside, third)


def test_reused_cast_is_keyed_on_the_weights_and_dropped_with_the_step():
    a, b = torch.ones(4), torch.zeros(4)
    made = []

    def make(t):
        made.append(t)
        return t.bfloat16()

    with optimizer_step():
        reused_cast((a,), torch.bfloat16, lambda: make(a))
        reused_cast((a,), torch.bfloat16, lambda: make(a))
        reused_cast((b,), torch.bfloat16, lambda: make(b))
        reused_cast((a,), torch.float16, lambda: make(a))
    reused_cast((a,), torch.bfloat16, lambda: make(a))
    with optimizer_step(reuse_casts=False):
        reused_cast((a,), torch.bfloat16, lambda: make(a))
    assert [t is a for t in made] == [True, False, True, True, True]


def test_one_step_at_a_time():
    with optimizer_step():
        with pytest.raises(RuntimeError, match="once per optimizer step"):
            with optimizer_step():
                pass
    assert not step_scope.adding_into_grads()
    with optimizer_step(add_into_grads=True):
        assert step_scope.adding_into_grads()


def test_graph_forwards_leave_cpu_calls_to_the_reference():
    """CUDA graphs are for CUDA tensors: on the CPU the op inside optimizer_step(graph_forwards=True) is the reference,
    call after call (a graph would show as a repeated first call's outputs)."""
    weights = master_weights()
    assert not step_scope.graphing_forwards()
    for micro in range(3):
        x, _ = tokens(micro)
        expected = twell_train_ffn(x, *weights, width=WIDTH).y_MK
        with optimizer_step(graph_forwards=True):
            assert step_scope.graphing_forwards()
            got = twell_train_ffn(x, *weights, width=WIDTH).y_MK
        assert torch.equal(got, expected)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_ddp_all_reduces_gradients_added_in_place(entry_points, both_cores):
    """Two CPU ranks (tests/helpers/ddp_step_scope_check.py): the op adds into .grad in the micro-batches after the
    first and hands autograd nothing for those weights; DDP's reducer, which runs once a weight's AccumulateGrad node
    has run (it still runs, with no gradient to add), all-reduces the sums, equal to one process's over both ranks'
    batches. The ranks are forked from the entry-point server (tests/helpers/entry_points.py), without ~3 s of imports
    each."""
    torchrun = shutil.which("torchrun") or sys.executable
    command = [
        torchrun,
        "--nproc_per_node",
        "2",
        "--no-python",
        *FORKED_RANK,
        "tests/helpers/ddp_step_scope_check.py",
        "cpu",
    ]
    out = entry_points.launch(command)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert sorted(re.findall(r"rank (\d): added in place", out.stdout)) == ["0", "1"], out.stdout[-2000:]


def test_a_layers_forward_graph_is_kept_per_weight_until_released_or_the_weight_dies():
    """The registry of `train_graphs` (no capture on the CPU): one GraphedForward per layer's gate weight, the same one
    every call; `release_graphs` drops them all, and a weight's entry goes with the weight."""
    w_gate = torch.zeros(N, K)
    graphed = train_graphs.graphed_forward(w_gate)
    assert train_graphs.graphed_forward(w_gate) is graphed
    assert train_graphs.graphed_forward(torch.zeros(N, K)) is not graphed
    train_graphs.release_graphs()
    assert train_graphs.graphed_forward(w_gate) is not graphed
    key = id(w_gate)
    del w_gate
    gc.collect()
    assert key not in train_graphs._graphed


def test_a_replay_token_fails_only_once_its_graph_replayed_again():
    """The backward's check of a graphed forward (`train_graphs.ReplayToken`), on stand-ins for the graphs: a later
    replay of the same graph has rewritten the saved outputs; a graph dropped for a new shape never will."""
    graphed = train_graphs.GraphedForward()
    graphed.graph, graphed.replays = object(), 3
    token = train_graphs.ReplayToken(graphed, graphed.graph, 3)
    token.check()
    graphed.replays = 4
    with pytest.raises(RuntimeError, match="replayed again before this forward's backward"):
        token.check()
    graphed.graph = object()  # the layer captured anew (its old graph and buffers are the token's alone)
    token.check()
