"""L1 and L0 values against hand-computed ones; dead-neuron detection and re-initialisation."""

from types import SimpleNamespace

import pytest
import torch

from sparse_llm.ffn.backend import Tail
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.training.sparsity import (
    LayerBalance,
    SparsityConfig,
    SparsityTracker,
    held_rows,
    l1_coefficient,
    l1_term,
)


def _mlp_with_known_activations() -> SparseMLP:
    """K=2, N=4 so that h is easy to write down for x = [[1, 0], [0, 1], [1, 1]]."""
    mlp = SparseMLP(2, 4, kernel="torch")
    with torch.no_grad():
        # gate pre-activations for x=e1: [1, -1, 2, 0]; x=e2: [-1, 3, 0, -2]
        mlp.gate_proj.weight.copy_(torch.tensor([[1.0, -1.0], [-1.0, 3.0], [2.0, 0.0], [0.0, -2.0]]))
        mlp.up_proj.weight.copy_(torch.tensor([[2.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [5.0, 5.0]]))
        mlp.down_proj.weight.copy_(torch.ones(2, 4))
    return mlp


def test_l1_and_l0_match_hand_computation():
    mlp = _mlp_with_known_activations()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    mlp(x)
    r = mlp.last_result
    # g = relu(x Wg^T): [[1,0,2,0], [0,3,0,0], [0,2,2,0]]; u = x Wu^T: [[2,1,-1,5], [1,-1,1,5], [3,0,0,10]]
    # h = g*u: [[2,0,-2,0], [0,-3,0,0], [0,0,0,0]]  (token 3: g fires on neurons 1,2 but u is 0 there)
    assert r.l0_M.tolist() == [2, 1, 0]
    assert r.fired_N.tolist() == [True, True, True, False]
    assert float(r.l1_sum.detach()) == pytest.approx(7.0)
    assert float(l1_term([r, r]).detach()) == pytest.approx(7.0 / 3)


def test_tracker_window_statistics_and_dead_neurons():
    mlp = _mlp_with_known_activations()
    tracker = SparsityTracker([mlp], SparsityConfig())
    mlp(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    tracker.accumulate(tracker.collect())
    tracker.end_optimizer_step(step=0, seed=0)
    stats = tracker.read_window()
    assert stats["l0/layer_00"] == pytest.approx(1.0)
    assert stats["l0_max/layer_00"] == 2
    assert stats["sparsity/mean"] == pytest.approx(0.75)
    assert stats["dead/layer_00"] == pytest.approx(0.25)  # neuron 3 never fired
    assert mlp.dispatcher.l0_mean == pytest.approx(1.0)
    assert stats["dense_rows/total"] == 0 and "dense_rows/layer_00" not in stats  # the torch path reroutes nothing
    # The window was consumed by the read.
    assert tracker.read_window() == {"dense_rows/total": 0, "dead/layer_00": 0.25, "dead/mean": 0.25}


def test_tracker_histogram_counts_every_token_including_empty_and_full_rows():
    mlp = _mlp_with_known_activations()
    tracker = SparsityTracker([mlp], SparsityConfig())
    mlp(torch.tensor([[1.0, 0.0]]))
    result = tracker.collect()[0]
    for l0 in ([0, 4, 4, 1], [2, 0]):  # 0 and N = 4 are the edge bins
        result.l0_M = torch.tensor(l0, dtype=torch.int32)
        tracker.accumulate([result])
    assert tracker.l0_hist_LB[0].tolist() == torch.bincount(torch.tensor([0, 4, 4, 1, 2, 0]), minlength=5).tolist()


def test_tracker_counts_rows_rerouted_to_a_dense_path_and_keeps_them_in_its_state():
    mlps = [_mlp_with_known_activations(), _mlp_with_known_activations()]
    tracker = SparsityTracker(mlps, SparsityConfig())
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # Two micro-batches; layer 1 had rows a sparse kernel could not take. The second count is still on its way
    # from the GPU when accumulated (a pinned tensor holding -1), as the training kernels leave it.
    pending = torch.tensor([-1], dtype=torch.int32)
    for rerouted in (2, pending):
        for mlp in mlps:
            mlp(x)
        results = tracker.collect()
        results[1].overflow_rows = rerouted
        tracker.accumulate(results)
    pending.fill_(3)  # the copy lands before the window is read
    restored = SparsityTracker(mlps, SparsityConfig())
    restored.load_state_dict(tracker.state_dict())
    for stats in (tracker.read_window(), restored.read_window()):
        assert stats["dense_rows/total"] == 5 and stats["dense_rows/layer_01"] == 5
        assert "dense_rows/layer_00" not in stats


def test_dead_window_spans_several_steps():
    mlp = _mlp_with_known_activations()
    tracker = SparsityTracker([mlp], SparsityConfig(dead_window_steps=2))
    mlp(torch.tensor([[1.0, 0.0]]))  # fires neurons 0 and 2
    tracker.accumulate(tracker.collect())
    assert tracker.end_optimizer_step(0, 0) == 0 and tracker.dead_LN is None
    mlp(torch.tensor([[0.0, 1.0]]))  # fires neuron 1
    tracker.accumulate(tracker.collect())
    tracker.end_optimizer_step(1, 0)
    assert tracker.dead_LN[0].tolist() == [False, False, False, True]


def test_reinit_touches_only_dead_gate_rows_by_eq6():
    mlp = _mlp_with_known_activations()
    before = mlp.gate_proj.weight.detach().clone()
    up_before = mlp.up_proj.weight.detach().clone()
    tracker = SparsityTracker([mlp], SparsityConfig(reinit_dead=True, reinit_mix=0.1, reinit_std=0.02))
    mlp(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    tracker.accumulate(tracker.collect())
    assert tracker.end_optimizer_step(step=5, seed=3) == 1
    after = mlp.gate_proj.weight.detach()
    torch.testing.assert_close(after[:3], before[:3], rtol=0, atol=0)
    noise = (after[3] - 0.9 * before[3]) / 0.1
    assert not torch.equal(after[3], before[3])
    assert noise.abs().max() < 0.02 * 6  # N(0, 0.02^2) draws
    torch.testing.assert_close(mlp.up_proj.weight, up_before)


def test_reinit_noise_is_identical_across_replicas():
    a, b = _mlp_with_known_activations(), _mlp_with_known_activations()
    for mlp in (a, b):
        tracker = SparsityTracker([mlp], SparsityConfig(reinit_dead=True))
        mlp(torch.tensor([[1.0, 0.0]]))
        tracker.accumulate(tracker.collect())
        tracker.end_optimizer_step(step=7, seed=11)
    torch.testing.assert_close(a.gate_proj.weight, b.gate_proj.weight, rtol=0, atol=0)


def test_l1_warmup_is_a_linear_ramp():
    assert l1_coefficient(1e-4, 0, 0) == 1e-4
    assert l1_coefficient(1e-4, 0, 10) == pytest.approx(1e-5)
    assert l1_coefficient(1e-4, 4, 10) == pytest.approx(5e-5)
    assert l1_coefficient(1e-4, 50, 10) == 1e-4


def test_l1_gradient_flows_to_all_three_weights():
    mlp = _mlp_with_known_activations()
    mlp(torch.tensor([[1.0, 0.5]]))
    mlp.last_result.l1_sum.backward()
    assert mlp.gate_proj.weight.grad.abs().sum() > 0
    assert mlp.up_proj.weight.grad.abs().sum() > 0


def test_reinit_noise_has_the_configured_scale():
    """Eq. 6 on a large block of dead rows: the added term is 0.1 * N(0, 0.02^2)."""
    mlp = SparseMLP(64, 4096, kernel="torch")
    with torch.no_grad():
        mlp.gate_proj.weight.zero_()  # every neuron is dead, and (1 - mix) * 0 leaves only the noise
    tracker = SparsityTracker([mlp], SparsityConfig(reinit_dead=True, reinit_mix=0.1, reinit_std=0.02))
    mlp(torch.randn(8, 64))
    tracker.accumulate(tracker.collect())
    assert tracker.end_optimizer_step(step=0, seed=0) == 4096
    noise = mlp.gate_proj.weight.detach() / 0.1
    assert float(noise.mean()) == pytest.approx(0.0, abs=2e-4)
    assert float(noise.std()) == pytest.approx(0.02, rel=0.02)


def test_tracker_state_round_trip():
    mlp = _mlp_with_known_activations()
    tracker = SparsityTracker([mlp], SparsityConfig(dead_window_steps=2))
    mlp(torch.tensor([[1.0, 0.0]]))
    tracker.accumulate(tracker.collect())
    tracker.end_optimizer_step(0, 0)
    mlp.dispatcher.observe(3.0, 7.0)
    other_mlp = _mlp_with_known_activations()
    other = SparsityTracker([other_mlp], SparsityConfig(dead_window_steps=2))
    other.load_state_dict(tracker.state_dict())
    assert torch.equal(other.fired_LN, tracker.fired_LN) and other.steps_in_window == 1
    assert torch.equal(other.l0_hist_LB, tracker.l0_hist_LB)
    assert (other_mlp.dispatcher.l0_mean, other_mlp.dispatcher.l0_max) == (3.0, 7.0)
    older = {**tracker.state_dict(), "observed": [(5.0, 9.0)]}  # checkpoints before the heavy share was kept
    other.load_state_dict(older)
    assert (other_mlp.dispatcher.l0_mean, other_mlp.dispatcher.tail) == (5.0, None)


def test_tracker_feeds_each_layer_its_share_of_heavy_tokens():
    """The window's histogram gives the dispatcher its heavy tokens' shares of tokens and non-zeros (the sparse
    inference kernels size and price their dense rows by them): here one token of two has 200, the other none."""
    mlp = SparseMLP(4, 512, kernel="torch")
    with torch.no_grad():
        mlp.gate_proj.weight.fill_(-1.0)
        mlp.gate_proj.weight[:200, 0] = 1.0
        mlp.up_proj.weight.fill_(1.0)
    tracker = SparsityTracker([mlp], SparsityConfig())
    mlp(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    tracker.accumulate(tracker.collect())
    tracker.read_window()
    assert (mlp.dispatcher.l0_mean, mlp.dispatcher.l0_max, mlp.dispatcher.tail) == (100.0, 200.0, Tail(0.5, 1.0))
    assert tracker.state_dict()["observed"] == [(100.0, 200.0, (0.5, 1.0))]
    other = SparseMLP(4, 512, kernel="torch")
    SparsityTracker([other], SparsityConfig()).load_state_dict(tracker.state_dict())
    assert other.dispatcher.tail == Tail(0.5, 1.0)


def test_held_rows_names_the_layouts_it_cannot_reinit(tmp_path):
    """A whole weight is held entire; a DTensor placed other than FSDP2's row shards is refused by name."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = torch.nn.Parameter(torch.randn(8, 4))
    held, first = held_rows(w)
    assert first == 0 and held.data_ptr() == w.data_ptr()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        rows = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        held, first = held_rows(rows)
        assert first == 0 and held.shape == (8, 4)
        replicated = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]))
        with pytest.raises(NotImplementedError, match="reinit_dead=false"):
            held_rows(replicated)
    finally:
        dist.destroy_process_group()


def _l0_results(*l0_per_layer: list[int]) -> list[SimpleNamespace]:
    """Stand-ins for one micro-batch's FFNResults: LayerBalance reads only their non-zeros per token."""
    return [SimpleNamespace(l0_M=torch.tensor(l0, dtype=torch.int32)) for l0 in l0_per_layer]


def test_layer_balance_weighs_denser_layers_more_and_keeps_the_geometric_mean():
    balance = LayerBalance(3, rate=0.5, bound=8.0, device=torch.device("cpu"), reduce=lambda t, op: t)
    balance.accumulate(_l0_results([8, 8], [2, 2], [4, 4]))
    balance.accumulate(_l0_results([8, 8], [2, 2], [4, 4]))  # two micro-batches of one step
    balance.end_optimizer_step()
    # log L0 sits log 2 above the layers' mean in layer 0 and log 2 below it in layer 1: +-0.5 log 2 at rate 0.5
    assert balance.weights_L.tolist() == pytest.approx([2**0.5, 2**-0.5, 1.0])
    assert balance.nonzeros_L.tolist() == [0.0, 0.0, 0.0]  # the next step starts afresh
    for _ in range(20):  # the same spread step after step: the weights stop at the bound
        balance.accumulate(_l0_results([8, 8], [2, 2], [4, 4]))
        balance.end_optimizer_step()
    assert balance.weights_L.tolist() == pytest.approx([8.0, 1 / 8.0, 1.0])
    balance.accumulate(_l0_results([0, 0], [3, 3], [3, 3]))  # a layer with no non-zero at all: its weight falls
    balance.end_optimizer_step()
    assert balance.weights_L[0] < 8.0


def test_l1_term_weighs_each_layer_share():
    r = SimpleNamespace(l1_sum=torch.tensor(6.0), l0_M=torch.zeros(3))
    other = SimpleNamespace(l1_sum=torch.tensor(3.0), l0_M=torch.zeros(3))
    assert float(l1_term([r, other], torch.tensor([0.5, 2.0]))) == pytest.approx((0.5 * 2.0 + 2.0 * 1.0) / 2)


def test_layer_balance_through_the_tracker_logs_and_resumes():
    mlps = [_mlp_with_known_activations(), _mlp_with_known_activations()]
    with torch.no_grad():
        mlps[1].gate_proj.weight.neg_()  # more non-zeros in layer 1 (4 against 3)
    cfg = SparsityConfig(layer_balance=0.1)
    tracker = SparsityTracker(mlps, cfg)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    for mlp in mlps:
        mlp(x)
    tracker.accumulate(tracker.collect())
    tracker.end_optimizer_step(step=0, seed=0)
    stats = tracker.read_window()
    assert stats["l0/layer_01"] > stats["l0/layer_00"]
    assert stats["l1_weight/layer_01"] > 1.0 > stats["l1_weight/layer_00"]
    restored = SparsityTracker(mlps, cfg)
    restored.load_state_dict(tracker.state_dict())
    assert torch.equal(restored.l1_weights_L, tracker.l1_weights_L)
    assert SparsityTracker(mlps, SparsityConfig()).l1_weights_L is None  # off by default: the plain mean


@pytest.mark.parametrize(
    ("key", "value", "names"),
    [
        ("layer_balance", -0.1, "sparsity.layer_balance=-0.1"),
        ("layer_balance_max", 0.5, "sparsity.layer_balance_max=0.5"),
    ],
)
def test_layer_balance_refuses_bad_settings_by_name(key, value, names):
    cfg = SparsityConfig(**{"layer_balance": 0.1, key: value})
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        SparsityTracker([_mlp_with_known_activations()], cfg)
