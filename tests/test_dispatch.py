"""The per-layer `auto` choice: cheapest available backend that accepts the inputs, with hysteresis."""

import functools
import math
import time
from types import SimpleNamespace

import pytest
import torch

from sparse_llm.ffn import dispatch, registry
from sparse_llm.ffn.backend import HEAVY_TOKEN_NNZ, FFNBackend, Tail
from sparse_llm.ffn.dispatch import LayerDispatcher, density_of
from sparse_llm.ffn.mlp import SparseMLP, cuda_graphed
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.ffn.twell.backend import TwellFFN


class FakeSparse(FFNBackend):
    """Costs `ms` and accepts only bf16 inputs, like the TwELL kernels."""

    name = "fake"

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def unavailable_reason(self, device):
        return None

    def accepts(self, x_MK, w_gate_NK, training):
        return x_MK.dtype == w_gate_NK.dtype == torch.bfloat16

    def forward(self, x_MK, w_gate_NK, w_up_NK, w_down_KN, *, training):
        return TorchFFN().forward(x_MK, w_gate_NK, w_up_NK, w_down_KN, training=training)

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        return self.ms


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    backend = FakeSparse(ms=0.0)
    registry.register_backend(backend)
    return backend


def test_auto_waits_for_a_measurement(fake):
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert LayerDispatcher("auto").choose(x, w, False).name == "torch"


def test_auto_takes_the_cheaper_backend_that_accepts_the_inputs(fake):
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(3.0, 9.0)
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert dispatcher.choose(x, w, False).name == "fake"
    assert dispatcher.choose(x.float(), w, False).name == "torch"  # fp32 tokens: not accepted
    assert dispatcher.choose(x, w.float(), False).name == "torch"  # fp32 weights: not accepted


def test_auto_trains_on_a_sparse_backend_where_it_is_cheaper(fake):
    """Training takes the cheaper sparse backend as inference does: no opt-in."""
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    dispatcher = LayerDispatcher("auto")
    assert dispatcher.choose(x, w, True).name == "torch"  # no observation yet
    dispatcher.observe(3.0, 9.0)
    assert dispatcher.choose(x, w, True).name == "fake"
    fake.ms = math.inf
    dispatcher.observe(3.0, 9.0)
    assert dispatcher.choose(x, w, True).name == "torch"


@pytest.mark.parametrize("compiled", [False, True])
def test_training_layers_stay_dense_while_dense_and_switch_once_sparse(monkeypatch, compiled):
    """The TwELL training price against the dense one at the 2B FFN shape (K 2048, N 5632), as a run's observations
    fall from an early model's hundreds of non-zeros per token to the paper's tens: micro-batches of 4 x 2048 tokens
    stay dense until the layer is sparse, then switch, and go back if it densifies; 2048 tokens a micro-batch stay
    dense at any sparsity (the host's time to issue the sparse op is the larger)."""
    monkeypatch.setattr(TwellFFN, "unavailable_reason", lambda self, device: None)
    dispatcher = LayerDispatcher("auto")
    with torch.device("meta"):
        x_big, x_small = (torch.empty(m, 2048, dtype=torch.bfloat16) for m in (8192, 2048))
        w = torch.empty(5632, 2048, dtype=torch.bfloat16)
    chosen = []
    for l0_mean, l0_max in ((700.0, 2000.0), (300.0, 1200.0), (100.0, 400.0), (40.0, 120.0), (25.0, 60.0)):
        dispatcher.observe(l0_mean, l0_max)
        small = dispatcher.choose(x_small, w, True, compiled=compiled).name
        chosen.append((small, dispatcher.choose(x_big, w, True, compiled=compiled).name))
    assert chosen == [("torch", "torch")] * 3 + [("torch", "twell")] * 2
    dispatcher.observe(300.0, 1200.0)
    assert dispatcher.choose(x_big, w, True, compiled=compiled).name == "torch"


def test_switching_to_sparse_needs_a_margin(fake):
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(3.0, 9.0)
    x, w = torch.zeros(4096, 2048, dtype=torch.bfloat16), torch.zeros(5632, 2048, dtype=torch.bfloat16)
    fake.ms = 0.97 * TorchFFN().estimated_ms(4096, 2048, 5632, 3.0, 9.0, False)
    assert dispatcher.choose(x, w, False).name == "torch"  # only 3% cheaper: stay dense
    fake.ms = 0.5 * fake.ms
    dispatcher.observe(3.0, 9.0)  # prices change with an observation: the layer chose from the last one's until now
    assert dispatcher.choose(x, w, False).name == "fake"


def test_leaving_a_sparse_path_needs_the_same_margin(fake):
    dispatcher = LayerDispatcher("auto")
    x, w = torch.zeros(4096, 2048, dtype=torch.bfloat16), torch.zeros(5632, 2048, dtype=torch.bfloat16)
    dense_ms = TorchFFN().estimated_ms(4096, 2048, 5632, 3.0, 9.0, False)
    dispatcher.observe(3.0, 9.0)
    fake.ms = 0.5 * dense_ms
    assert dispatcher.choose(x, w, False).name == "fake"
    for ratio, path in ((1.03, "fake"), (1.2, "torch"), (1.03, "torch")):  # 3% dearer: stay; 20%: leave; then stay
        fake.ms = ratio * dense_ms
        dispatcher.observe(3.0, 9.0)
        assert dispatcher.choose(x, w, False).name == path, ratio


def test_compiled_layers_price_the_dense_path_without_its_eager_statistics(fake):
    """Training: a sparse path that beats the eager dense block (ReLU, product and statistics as separate passes)
    may lose to the compiled one, which fuses them; `auto` weighs it against the dense path the layer runs."""
    m, k, n = 16384, 2048, 5632
    eager, compiled = (TorchFFN().estimated_ms(m, k, n, 56.0, 95.0, True, compiled=c) for c in (False, True))
    assert compiled == pytest.approx(9 * 2 * m * k * n / 600e12 * 1e3) and eager > compiled + 0.5
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(56.0, 95.0)
    fake.ms = 0.9 * eager  # faster than the eager dense block, slower than the compiled one
    with torch.device("meta"):
        x, w = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
    assert dispatcher.choose(x, w, True).name == "fake"
    dispatcher.current = "torch"
    assert dispatcher.choose(x, w, True, compiled=True).name == "torch"


def test_density_of_reads_mean_max_and_heavy_share():
    l0_M = torch.tensor([0, HEAVY_TOKEN_NNZ, HEAVY_TOKEN_NNZ + 1, 300], dtype=torch.int32)
    total = 2 * HEAVY_TOKEN_NNZ + 301
    assert density_of(l0_M) == (total / 4, 300.0, Tail(0.5, (HEAVY_TOKEN_NNZ + 301) / total))


def test_sparse_mlp_hands_its_recent_density_to_the_backend(monkeypatch):
    """The layer's last observed (mean, max) non-zeros per token and share of heavy tokens reach the backend (the twell
    kernels pick their walk, column parts and dense rows by them); before any observation the backend gets None."""
    seen = []
    forward = TorchFFN.forward

    def recording(self, *args, **kwargs):
        seen.append((kwargs["l0"], kwargs["tail"]))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TorchFFN, "forward", recording)
    mlp = SparseMLP(64, 256, kernel="torch")
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        mlp(x)
        observed = (mlp.dispatcher.l0_mean, mlp.dispatcher.l0_max), mlp.dispatcher.tail
        mlp(x)
    assert seen[0] == (None, None) and observed[0][0] is not None and seen[1] == observed
    assert observed[0][1] >= observed[0][0] and 0.0 <= observed[1].tokens <= 1.0


@pytest.fixture
def timed(monkeypatch):
    """Trials on the CPU: `can_time` says yes, and `best_times_ms` and `loop_times_ms` run each call once, return
    `timed.ms` and note which of them ran."""
    record = SimpleNamespace(ms={}, trials=0, how=None)

    def times_ms(how, calls, *counts):
        record.trials += 1
        record.how = how
        for call in calls.values():
            call()
        return {key: record.ms[key] for key in calls}

    monkeypatch.setattr(dispatch, "can_time", lambda x: True)
    monkeypatch.setattr(dispatch, "best_times_ms", functools.partial(times_ms, "events"))
    monkeypatch.setattr(dispatch, "loop_times_ms", functools.partial(times_ms, "loops"))
    return record


def close_prices(fake, ratio: float) -> tuple[LayerDispatcher, torch.Tensor, torch.Tensor]:
    """A dispatcher at 3 non-zeros per token whose fake sparse price is `ratio` times the dense one."""
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(3.0, 9.0)
    x, w = torch.zeros(4096, 2048, dtype=torch.bfloat16), torch.zeros(5632, 2048, dtype=torch.bfloat16)
    fake.ms = ratio * TorchFFN().estimated_ms(4096, 2048, 5632, 3.0, 9.0, False)
    return dispatcher, x, w


def test_close_prices_are_settled_by_a_trial_once_per_token_count_and_density(fake, timed):
    ran = []
    dispatcher, x, w = close_prices(fake, 1.2)  # priced dense...
    timed.ms = {"torch": 1.0, "fake": 0.8}  # ...measured sparse
    assert dispatcher.choose(x, w, False, trial=lambda backend: ran.append(backend.name)).name == "fake"
    assert timed.trials == 1 and sorted(ran) == ["fake", "torch"] and timed.how == "events"
    assert dispatcher.choose(x, w, False, trial=ran.append).name == "fake" and timed.trials == 1  # remembered
    dispatcher.observe(3.05, 9.0)  # the same density bucket
    assert dispatcher.choose(x, w, False, trial=ran.append).name == "fake" and timed.trials == 1
    timed.ms = {"torch": 1.0, "fake": 0.98}  # within the trial's margin: dense
    dispatcher.observe(6.0, 18.0)
    assert dispatcher.choose(x, w, False, trial=ran.append).name == "torch" and timed.trials == 2
    assert dispatcher.choose(x[:3900], w, False, trial=ran.append).name == "torch" and timed.trials == 2  # ~ M
    fake.ms = 1.2 * TorchFFN().estimated_ms(2048, 2048, 5632, 6.0, 18.0, False)
    assert dispatcher.choose(x[:2048], w, False, trial=ran.append).name == "torch" and timed.trials == 3  # new M


def test_prices_far_apart_training_and_untimeable_calls_take_the_price(fake, timed, monkeypatch):
    timed.ms = {"torch": 0.5, "fake": 1.0}  # a trial would say dense
    dispatcher, x, w = close_prices(fake, 0.5)  # far enough apart: the price stands
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake"
    dispatcher, x, w = close_prices(fake, 0.8)
    assert dispatcher.choose(x, w, False).name == "fake"  # no trial offered
    training = LayerDispatcher("auto")
    training.observe(3.0, 9.0)
    assert training.choose(x, w, True, trial=lambda b: None).name == "fake"
    monkeypatch.setattr(dispatch, "can_time", lambda x: False)  # e.g. a CUDA graph being captured
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake"
    assert timed.trials == 0


def test_host_bound_calls_are_settled_by_a_trial_except_in_cuda_graphs(fake, timed):
    """A call of a few tokens costs the host more than either path's device time. Issued from Python it is timed
    even where its prices lie far apart; in a CUDA graph the price stands. The two choices are remembered apart."""
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(3.0, 9.0)
    x, w = torch.zeros(4, 2048, dtype=torch.bfloat16), torch.zeros(5632, 2048, dtype=torch.bfloat16)
    dense_ms = TorchFFN().estimated_ms(4, 2048, 5632, 3.0, 9.0, False)
    assert dense_ms < dispatch.HOST_BOUND_MS
    fake.ms = 0.4 * dense_ms  # far outside the trial band: the price alone takes the sparse path
    timed.ms = {"torch": 0.07, "fake": 0.08}  # issued from Python, the dense path's host work is the smaller
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch" and timed.trials == 1
    assert timed.how == "loops"  # timed by the host's clock
    assert dispatcher.choose(x, w, False, trial=lambda b: None, graphed=True).name == "fake" and timed.trials == 1
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch" and timed.trials == 1  # remembered
    timed.ms = {"torch": 0.07, "fake": 0.05}
    dispatcher.observe(6.0, 18.0)  # a new density bucket: a new trial, which the sparse path wins
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake" and timed.trials == 2


def test_a_choice_is_kept_for_calls_of_its_kind_until_the_next_observation(fake, timed, monkeypatch):
    """A decoding loop's calls repeat one kind: the prices, `accepts` and the trial lookup run once for it. Another
    token count, dtype or flag is another kind; an observation or forgotten trials start afresh; a trial that was due
    but could not run leaves its kind unsettled, so the trial runs once it can."""
    priced = []
    monkeypatch.setattr(fake, "estimated_ms", lambda *args, **kw: priced.append(args[0]) or fake.ms)
    dispatcher, x, w = close_prices(fake, 1.2)
    timed.ms = {"torch": 1.0, "fake": 0.8}
    monkeypatch.setattr(dispatch, "can_time", lambda x: False)  # a capture, say
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch" and len(priced) == 1
    monkeypatch.setattr(dispatch, "can_time", lambda x: True)
    for _ in range(3):
        assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake"
    # priced again once the trial could run, and once more from the new current path (the hysteresis reads it)
    assert len(priced) == 3 and timed.trials == 1
    assert dispatcher.choose(x.float(), w, False, trial=lambda b: None).name == "torch"  # fp32: not accepted
    # half the tokens: another kind, priced, and the dense price is halved while the fake one is not
    assert dispatcher.choose(x[:2048], w, False, trial=lambda b: None).name == "torch" and len(priced) == 4
    dispatcher.forget_trials()
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake" and timed.trials == 2
    assert len(priced) == 5
    fake.ms = 2.0 * TorchFFN().estimated_ms(4096, 2048, 5632, 3.0, 9.0, False)
    dispatcher.observe(3.0, 9.0)
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch" and len(priced) == 6


def test_cuda_graphed_layers_choose_for_graphs(monkeypatch):
    """Within `cuda_graphed(model)` a layer asks its dispatcher for a choice in a CUDA graph; before and after, not."""
    seen = []
    choose = LayerDispatcher.choose

    def recording(self, *args, **kwargs):
        seen.append(kwargs["graphed"])
        return choose(self, *args, **kwargs)

    monkeypatch.setattr(LayerDispatcher, "choose", recording)
    model = torch.nn.Sequential(SparseMLP(64, 256, kernel="auto"))
    x = torch.randn(3, 64)
    with torch.no_grad():
        model(x)
        with cuda_graphed(model):
            model(x)
        model(x)
    assert seen == [False, True, False]


def test_a_layers_trial_runs_its_own_call_on_each_backend(fake, timed, monkeypatch):
    """SparseMLP offers the dispatcher its inference calls (the same inputs, residual and hints, no statistics), and
    none of its training calls."""
    seen = []
    forward = TorchFFN.forward

    def recording(self, x_MK, *weights, **kwargs):
        residual = kwargs["residual_MK"]
        seen.append(
            (
                self.name,
                x_MK.shape,
                kwargs["statistics"],
                residual is not None,
                None if residual is None else residual.data_ptr(),
                kwargs["residual_writable"],
            )
        )
        return forward(TorchFFN(), x_MK, *weights, **kwargs)

    monkeypatch.setattr(TorchFFN, "forward", recording)
    monkeypatch.setattr(FakeSparse, "forward", recording)
    timed.ms = {"torch": 1.0, "fake": 0.5}
    mlp = SparseMLP(64, 256, kernel="auto").bfloat16()
    mlp.dispatcher.observe(3.0, 9.0)
    fake.ms = 1.1 * TorchFFN().estimated_ms(6, 64, 256, 3.0, 9.0, False)
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.no_grad():
        mlp(x, residual=torch.zeros_like(x))
    assert timed.trials == 1 and mlp.dispatcher.current == "fake"
    assert sorted(entry[:4] for entry in seen[:2]) == [("fake", (6, 64), False, True), ("torch", (6, 64), False, True)]
    assert seen[2][0] == "fake" and len(seen) == 3

    # A residual the layer gives up: the dense path adds into it, so the trial's calls get a copy to add into.
    timed.ms = {"torch": 0.5, "fake": 1.0}
    residual = torch.randn_like(x)
    with torch.no_grad():
        want = residual + mlp(x)
        seen.clear()
        mlp.dispatcher.forget_trials()
        y = mlp(x, residual=residual, residual_writable=True)
    assert mlp.dispatcher.current == "torch" and [name for name, *_ in seen[:2]] == ["torch", "fake"]
    assert all(ptr != residual.data_ptr() and writable for _, _, _, _, ptr, writable in seen[:2])
    assert seen[2][4:] == (residual.data_ptr(), True) and y.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(y, want, rtol=1e-2, atol=1e-2)  # bf16: one rounding of residual + product, not two

    mlp.dispatcher.forget_trials()
    trials = timed.trials
    mlp(x.requires_grad_())  # training: priced, no trial
    assert timed.trials == trials


def test_priced_auto_runs_no_trials_and_bad_choices_are_named(fake, timed, monkeypatch):
    """SPARSE_LLM_AUTO=priced: the prices decide (bit-reproducible); anything but measured/priced is an error."""
    timed.ms = {"torch": 1.0, "fake": 0.5}
    monkeypatch.setenv(dispatch.AUTO_CHOICE_ENV, "priced")
    dispatcher, x, w = close_prices(fake, 1.2)
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch" and timed.trials == 0
    monkeypatch.setenv(dispatch.AUTO_CHOICE_ENV, "measured")
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "torch"  # the choice holds until forgotten
    dispatcher.forget_trials()
    assert dispatcher.choose(x, w, False, trial=lambda b: None).name == "fake" and timed.trials == 1
    monkeypatch.setenv(dispatch.AUTO_CHOICE_ENV, "fast")
    with pytest.raises(ValueError, match="SPARSE_LLM_AUTO='fast' is not valid; use one of"):
        close_prices(fake, 1.2)[0].choose(x, w, False, trial=lambda b: None)


def test_loop_times_ms_times_runs_of_calls_by_the_host_clock(monkeypatch):
    """Each call runs per_run times a round, after one untimed round, and gets its best time per call, on a clock that
    moves only inside the calls: 3, 2 then 2.5 ms a call for the slow one (its first, untimed run 9 ms), none for the
    fast one."""
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", waits.append)
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    slow_ms = iter([9.0] * 4 + [3.0] * 4 + [2.0] * 4 + [2.5] * 4)
    counts = {"slow": 0, "fast": 0}

    def slow():
        counts["slow"] += 1
        clock[0] += next(slow_ms) / 1e3

    def fast():
        counts["fast"] += 1

    ms = dispatch.loop_times_ms({"slow": slow, "fast": fast}, rounds=3, per_run=4, device=torch.device("cuda", 1))
    assert counts == {"slow": 16, "fast": 16}
    assert ms == {"slow": pytest.approx(2.0), "fast": 0.0}
    assert len(waits) == 16 and set(waits) == {torch.device("cuda", 1)}  # before and after each run, on that device
