"""CPU tests of the model-level benchmark (scripts/bench_model.py), its library (sparse_llm/bench/model_setup.py,
measure.py, tables.py, train_step.py) and the measurement helpers (sparse_llm/bench/timing.py)."""

import json
import os
import runpy
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from sparse_llm.bench.measure import MeasureOptions, VariantResult, bench_train
from sparse_llm.bench.model_setup import make_sparse, set_kernel
from sparse_llm.bench.tables import device_table, forward_ceiling, render_report
from sparse_llm.bench.timing import (
    PeakMemory,
    SectionTimer,
    device_ms_by_family,
    energy_mj_per_call,
    kernel_family,
    l0_summary,
    relative_error,
    time_ms,
    wall_ms,
)
from sparse_llm.bench.train_step import TrainStep
from sparse_llm.ffn.mlp import recording_statistics
from sparse_llm.model.llama import ModelConfig, build_model, sparse_mlps
from sparse_llm.telemetry.energy import EnergyMeter

ROOT = Path(__file__).resolve().parents[1]
# The command-line half: main, parse_args, report_header.
bench_model = runpy.run_path(str(ROOT / "scripts" / "bench_model.py"))
# Scripts run in a subprocess import this checkout's package.
SCRIPT_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

TINY = "--size tiny --seq-len 16 --batch 2 --reps 1 --warmup 0 --device cpu".split()


@pytest.fixture(autouse=True)
def _records_in_tmp(tmp_path, monkeypatch):
    """Runs that are not given a --record-dir write their record under the test's own folder, not the checkout's
    docs/records/."""
    monkeypatch.chdir(tmp_path)


class Sleeper(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("drain", [True, False])
def test_time_ms_is_the_median_of_the_timed_calls(drain):
    # One slow warm-up call (not timed), then three timed calls: median 20 ms, mean 113 ms, max 300 ms.
    # sleep() never returns early, and a loaded machine would have to delay two calls by 80 ms to break this.
    delays = iter([0.3, 0.02, 0.3, 0.02])
    ms = time_ms(lambda: time.sleep(next(delays)), warmup=1, reps=3, device="cpu", drain=drain)
    assert 20.0 <= ms < 100.0


def test_wall_ms_is_the_mean_of_back_to_back_calls_after_one_warm_up():
    delays = iter([0.3, 0.01, 0.05])  # the slow first call is the untimed warm-up: mean of the rest 30 ms
    ms = wall_ms(lambda: time.sleep(next(delays)), reps=2, device="cpu")
    assert 30.0 <= ms < 150.0


def test_section_timer_sums_module_time_per_section_and_can_pause():
    fast, slow = Sleeper(0.005), Sleeper(0.05)
    timer = SectionTimer({"fast": [fast], "slow": [slow], "unused": []}, "cpu")
    with timer:
        fast(torch.zeros(1))
        fast(torch.zeros(1))
        slow(torch.zeros(1))
        timer.active = False
        slow(torch.zeros(1))  # not counted
        timer.active = True
        totals = timer.totals_ms()
    # Lower bounds are exact (sleep never returns early); upper bounds leave ~45 ms for a loaded machine:
    # slow counted twice (the paused call) would be >= 100 ms.
    assert 10.0 <= totals["fast"] < totals["slow"]
    assert 50.0 <= totals["slow"] < 95.0
    assert totals["unused"] == 0.0
    slow(torch.zeros(1))  # hooks are gone after the block
    assert timer.totals_ms()["slow"] == 0.0


def test_l0_summary_and_cpu_meters():
    mean, p99, top = l0_summary(torch.tensor([0] * 99 + [100], dtype=torch.int32))
    assert mean == pytest.approx(1.0) and top == 100.0 and 0.0 < p99 <= 100.0
    with pytest.raises(ValueError, match="empty"):
        l0_summary(torch.zeros(0))
    with PeakMemory("cpu") as peak:
        pass
    assert peak.gib is None
    start = time.perf_counter()
    assert energy_mj_per_call(EnergyMeter(torch.device("cpu")), lambda: time.sleep(1.0), seconds=5.0) is None
    assert time.perf_counter() - start < 1.0  # no meter: returns without one call (1 s) or the 5 s window


def test_make_sparse_gives_the_target_l0_in_every_layer():
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            hidden_size=64,
            intermediate_size=512,
            num_layers=3,
            num_heads=2,
            vocab_size=300,
            max_position_embeddings=64,
        ),
        kernel="torch",
    )
    ids = torch.randint(0, 300, (4, 64))
    with torch.no_grad(), recording_statistics(model):
        model.model(input_ids=ids)
    dense_l0 = [m.last_result.l0_M.float().mean().item() for m in sparse_mlps(model)]
    assert min(dense_l0) > 100  # random init: about half of the 512 gates are positive

    shifts = make_sparse(model, 12.0, ids)
    assert len(shifts) == 3 and min(shifts) > 0
    with torch.no_grad(), recording_statistics(model):
        out = model.model(input_ids=ids, output_hidden_states=True)
    for mlp in sparse_mlps(model):
        assert mlp.last_result.l0_M.float().mean().item() == pytest.approx(12.0, abs=0.5)
    # The shift feature is constant through the whole residual stream: no layer writes to it.
    for hidden in out.hidden_states[:-1]:  # the last entry is after the final norm
        assert torch.allclose(hidden[..., 0], torch.full_like(hidden[..., 0], model.config.initializer_range))
    with pytest.raises(ValueError, match="--density-l0"):
        make_sparse(model, 400.0, ids)


def test_cpu_smoke_run_prints_the_report_and_writes_a_record(tmp_path, capsys):
    records = tmp_path / "records"
    results = bench_model["main"](
        TINY
        + ["--density-l0", "24", "--max-train-batch", "4"]
        + ["--record-dir", str(records), "--profile-dir", str(tmp_path / "prof")]
    )
    by_key = {(r.mode, r.kernel): r for r in results}
    assert set(by_key) == {
        ("forward", "stock"),
        ("train", "stock"),
        ("train (largest fit)", "stock"),
        ("forward", "torch"),
        ("forward", "auto"),
        ("forward", "twell"),
        ("train", "torch"),
        ("train", "auto"),
        ("train", "twell"),
        ("train (largest fit)", "torch"),
        ("train (largest fit)", "auto"),
    }
    for mode in ("forward", "train"):  # said, not silently replaced by the torch path
        assert "CUDA" in by_key[mode, "twell"].skipped
    for key in [("forward", "torch"), ("forward", "auto"), ("train", "torch"), ("train", "auto")]:
        r = by_key[key]
        assert r.skipped is None and r.tokens == 32 and r.tokens_per_ms > 0 and r.mj_per_token is None
        assert [layer.path for layer in r.layers] == ["torch"] * 4  # no sparse kernel on a CPU
        assert set(r.breakdown_ms) >= {"attention", "ffn gate GEMM", "ffn rest", "other fwd", "total"}
    assert "backward" in by_key["train", "torch"].breakdown_ms
    for mode in ("forward", "train"):  # the plain dense baseline: transformers' MLP, no statistics
        stock = by_key[mode, "stock"]
        assert stock.skipped is None and stock.layers == [] and stock.tokens_per_ms > 0
        assert stock.path_summary() == "LlamaMLP (no statistics)"
    fwd = by_key["forward", "torch"].layers
    assert sum(layer.l0_mean for layer in fwd) / 4 == pytest.approx(24.0, abs=1.0)  # calibrated on these tokens
    assert all(layer.l0_max >= layer.l0_p99 >= 0 for layer in fwd)

    text = capsys.readouterr().out
    assert "## Model-level benchmark: random-init tiny" in text and "Hardware: CPU" in text
    assert "Settings: `python scripts/bench_model.py --size tiny" in text
    for row in ("| forward | torch | 2 |", "| train | auto | 2 |", "| forward | twell | 2 | skipped:"):
        assert row in text
    assert "| layer | forward L0 mean / p99 / max |" in text
    assert "Forward ceiling: with the FFN past its gate GEMM free, the `torch` forward" in text
    assert by_key["train (largest fit)", "auto"].batch == 4  # nothing runs out of memory on a CPU
    assert "| train (largest fit) | auto | 4 |" in text
    (record_file,) = records.glob("bench_model-*.json")
    record = json.loads(record_file.read_text())
    assert record["bench"] == "bench_model" and record["command"].startswith(
        "python scripts/bench_model.py --size tiny"
    )
    assert record["hardware"]["gpu"] is None and record["settings"]["density_l0"] == 24.0
    assert record["settings"]["model"]["layers"] == 4
    assert len(record["results"]) == 11
    rows = {(r["mode"], r["kernel"]): r for r in record["results"]}
    assert rows["forward", "torch"]["vs_torch"] == 1.0 and len(rows["forward", "torch"]["layers"]) == 4
    assert "CUDA" in rows["forward", "twell"]["skipped"] and rows["forward", "twell"]["ms"] is None
    assert "aten::mm" in (tmp_path / "prof" / "train_auto.txt").read_text()  # one profiled step per variant
    assert json.loads((tmp_path / "prof" / "forward_stock.json").read_text())["traceEvents"]


def test_kernels_option_runs_only_the_variants_named():
    results = bench_model["main"](TINY + ["--modes", "train", "--kernels", "torch,auto", "--energy-seconds", "1"])
    assert [(r.mode, r.kernel) for r in results] == [("train", "torch"), ("train", "auto")]
    assert all(r.skipped is None and r.device_ms == {} for r in results)  # no device times on a CPU


def test_forward_ceiling_is_the_dense_forward_without_its_sparse_part():
    dense = {"attention": 37.0, "ffn gate GEMM": 9.25, "ffn rest": 21.75, "other fwd": 12.0, "total": 80.0}
    line = forward_ceiling("torch", dense)
    assert "the `torch` forward would take 58.25 of 80.00 ms (1.373x)" in line and "attention 37.00 ms" in line


def test_kernel_families_name_what_the_device_ran():
    names = {
        "void train_fwd_gate<8>(__nv_bfloat16 const*)": "sparse FFN",
        "gate_up_down_light<8>": "sparse FFN",
        "void gate_up_entries<8>(__nv_bfloat16 const*)": "sparse FFN",
        "order_tokens": "sparse FFN",
        "entries_to_slots": "sparse FFN",
        "void ell_to_slots<true>(int const*)": "sparse FFN",
        "void entries_down<16>(unsigned int const*)": "sparse FFN",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "GEMM",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "void rope_rotate_half<__nv_bfloat16, float, 8>(": "attention",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, "
        "at::native::Copy<float, float> >(at::na": "graph input copies",
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<": "sort",
        "triton_per_fused__fused_rms_norm_backward_add_0": "fused by torch.compile",
        "Memset (Device)": "other",
    }
    assert {name: kernel_family(name) for name in names} == names
    assert device_ms_by_family(lambda: None, "cpu") == {}


def test_device_table_gives_the_idle_time_of_the_timed_step():
    row = VariantResult("train", "twell", 4, 8192, ms=230.0)
    row.device_ms = {"busy": 195.5, "GEMM": 55.0, "sparse FFN": 39.0, "other": 101.5}
    lines = device_table([row, VariantResult("train", "torch", 4, 8192, ms=250.0)])
    assert len(lines) == 3  # the row without device times is left out
    cells = [c.strip() for c in lines[2].strip().strip("|").split("|")]
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    got = dict(zip(header, cells, strict=True))
    assert got["device busy ms"] == "195.50" and got["device idle ms"] == "34.50"
    assert got["GEMM ms"] == "55.00" and got["attention ms"] == "0.00" and got["other ms"] == "101.50"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--modes", "forward,decode"], "--modes"),
        (["--density-l0", "10", "--checkpoint", "x"], "not allowed with"),
        (["--energy-seconds", "0.5"], "--energy-seconds"),
        (["--batch", "0"], "--batch"),
        (["--accumulate", "0"], "--accumulate must be >= 1"),
        (["--kernels", "torch,fast"], "--kernels torch,fast: choose from stock,torch,auto,twell"),
        (["--kernels", "auto,torch"], "list torch before auto"),
        (["--cuda-graphs"], "add --compile"),
        (["--cuda-graphs", "--compile", "--grad-ckpt"], "not supported with --grad-ckpt"),
        (["--cuda-graphs", "--compile", "--warmup", "1"], "--cuda-graphs needs --warmup 2 or more"),
        (["--cuda-graphs", "--compile", "--warmup", "2", "--device", "cpu"], "needs a CUDA GPU"),
    ],
)
def test_bad_arguments_are_named(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench_model["parse_args"](TINY + extra)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "extra"), [("bench_model", []), ("bench_decode", []), ("profile_train_step", ["--accumulate", "1"])]
)
def test_every_model_script_checks_its_model_source_before_loading(script, extra, entry_points, tmp_path):
    """bench_model, bench_decode and profile_train_step share the check: a --checkpoint without a model in it, or one
    given with --density-l0, is a usage error naming the fix."""
    run = [f"scripts/{script}.py", *extra, "--device", "cpu"]
    missing = entry_points.run([*run, "--checkpoint", str(tmp_path)], SCRIPT_ENV, tmp_path)
    assert missing.returncode == 2 and "not a model directory (no config.json); pass a run's final/" in missing.stderr
    (tmp_path / "config.json").write_text("{}")
    both = entry_points.run([*run, "--checkpoint", str(tmp_path), "--density-l0", "5"], SCRIPT_ENV, tmp_path)
    assert both.returncode == 2 and "a checkpoint has its own sparsity" in both.stderr


def test_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="--seq-len 4096"):
        bench_model["main"](["--size", "tiny", "--seq-len", "4096", "--device", "cpu"])


def test_out_of_memory_is_reported_per_micro_batch_and_the_run_goes_on(monkeypatch):
    real_call = TrainStep.__call__

    def call(step):
        if step.ids.shape[0] >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real_call(step)

    monkeypatch.setattr(TrainStep, "__call__", call)
    args = TINY + ["--modes", "train", "--train-batch", "4", "--max-train-batch", "8"]
    results = bench_model["main"](args)
    assert [(r.mode, r.kernel, r.skipped) for r in results[:3]] == [
        ("train", "stock", "out of memory at micro-batch 4"),
        ("train", "torch", "out of memory at micro-batch 4"),
        ("train", "auto", "out of memory at micro-batch 4"),
    ]
    assert results[3].kernel == "twell" and "CUDA" in results[3].skipped
    report = render_report(results, ["## header"])
    assert "| train | auto | 4 | skipped: out of memory at micro-batch 4 |" in report

    results = bench_model["main"](TINY + ["--modes", "train", "--max-train-batch", "8"])
    # from the measured batch 2: 3 fits, 5 does not, so 3 is each path's largest fit
    assert [(r.mode, r.batch) for r in results] == [("train", 2)] * 4 + [("train (largest fit)", 3)] * 3
    assert [r.kernel for r in results[4:]] == ["stock", "torch", "auto"]


def test_a_step_that_runs_out_of_memory_leaves_no_activations_behind(monkeypatch):
    """A step that fails midway (here in its backward) leaves each SparseMLP's last result, whose L1 sum holds the
    step's autograd graph and so its saved activations: the benchmark drops them before the next variant runs."""

    def backward(step, loss):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(TrainStep, "backward", backward)
    options = MeasureOptions.from_namespace(bench_model["parse_args"](TINY + ["--modes", "train"]))
    torch.manual_seed(0)
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vocab_size=50)
    model = build_model(config, kernel="torch")
    master = {name: t.detach().clone() for name, t in model.state_dict().items()}
    row = bench_train(model, master, torch.randint(0, 50, (2, 8)), "torch", None, None, None, options)
    assert row.skipped == "out of memory at micro-batch 2"
    assert [m.last_result for m in sparse_mlps(model)] == [None, None]


def test_accumulated_step_averages_its_micro_batches_under_one_update(monkeypatch):
    """--accumulate A: A forward + backward passes, each loss divided by A, then one optimizer step. On A copies of
    the same micro-batch the update sees the single micro-batch's gradient; the row counts A micro-batches' tokens."""
    torch.manual_seed(0)
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vocab_size=50)
    ids = torch.randint(0, 50, (2, 8))
    seen = []

    def update(step, loss):  # the gradient the optimizer would take, then cleared as after a step
        seen.append([p.grad.clone() for p in step.model.parameters()])
        step.model.zero_grad(set_to_none=True)

    monkeypatch.setattr(TrainStep, "update", update)
    model = build_model(config, kernel="torch")  # no update runs, so both steps start from the same weights
    for accumulate in (1, 3):
        step = TrainStep(model, ids, 2e-5, 0.0, accumulate=accumulate)
        forwards = []
        monkeypatch.setattr(step, "forward", lambda real=step.forward: forwards.append(1) or real())
        step()
        assert len(forwards) == accumulate
    for one, mean in zip(*seen, strict=True):
        torch.testing.assert_close(mean, one, rtol=1e-5, atol=1e-7)

    args = TINY + ["--modes", "train", "--kernels", "torch", "--accumulate", "3"]
    (row,) = bench_model["main"](args)
    assert row.skipped is None and row.tokens == 3 * 32 and row.breakdown_ms["backward"] > 0


def test_graphed_step_marks_a_graph_step_per_micro_batch_with_gradients_held(monkeypatch):
    """With --cuda-graphs and A micro-batches a step, every forward begins a new CUDA-graph step, so each micro-batch
    replays the same graphs. The gradients are held (allocated before the first backward, zeroed in place after each
    update), so no gradient is a graph's output buffer that the next replay would overwrite; and the accumulated
    gradient is still the mean over the micro-batches."""
    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    torch.manual_seed(0)
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vocab_size=50)
    model = build_model(config, kernel="torch")
    step = TrainStep(model, torch.randint(0, 50, (2, 8)), 2e-5, 0.0, cuda_graphs=True, accumulate=3)
    held = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in held)
    grads = []

    def update(loss, real=step.update):
        events.append("update")
        grads.append([p.grad.clone() for p in model.parameters()])
        real(loss)

    monkeypatch.setattr(step, "backward", lambda loss, real=step.backward: events.append("backward") or real(loss))
    monkeypatch.setattr(step, "update", update)
    step()
    step()
    assert events == (["mark", "backward"] * 3 + ["update"]) * 2
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), held, strict=True))
    plain = TrainStep(model, step.ids, 2e-5, 0.0, accumulate=1)
    model.zero_grad(set_to_none=True)
    plain.backward(plain.forward())  # lr 0: the weights have not moved, and three equal micro-batches average to one
    for accumulated, p in zip(grads[1], model.parameters(), strict=True):
        torch.testing.assert_close(accumulated, p.grad, rtol=1e-5, atol=1e-7)


def test_stock_mlps_share_the_weights_and_compute_the_same_function():
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vocab_size=50), kernel="torch"
    )
    ids = torch.randint(0, 50, (2, 8))
    originals = sparse_mlps(model)
    weights = [mlp.gate_proj.weight for mlp in originals]
    with torch.no_grad():
        sparse_out = model(input_ids=ids).logits
        set_kernel(model, "stock", None)
        assert sparse_mlps(model) == []
        stock_weights = [layer.mlp.gate_proj.weight for layer in model.model.layers]
        assert all(a is b for a, b in zip(stock_weights, weights, strict=True))  # the same tensors, no copies
        stock_out = model(input_ids=ids).logits
        set_kernel(model, "auto", None)
        assert sparse_mlps(model) == originals  # the same modules come back, no new weights
        assert [mlp.dispatcher.kernel for mlp in sparse_mlps(model)] == ["auto", "auto"]
        assert all(mlp.gate_proj.weight is w for mlp, w in zip(sparse_mlps(model), weights, strict=True))
    torch.testing.assert_close(stock_out, sparse_out)
    set_kernel(model, "stock", None)
    model.to(torch.float64)  # a dtype change while the stock MLPs are in place reaches the SparseMLPs too
    set_kernel(model, "torch", None)
    assert {mlp.down_proj.weight.dtype for mlp in sparse_mlps(model)} == {torch.float64}


def test_bench_mlp_hands_train_mode_to_the_training_benchmark(entry_points, tmp_path):
    """`bench_mlp.py --mode train` runs bench_train_mlp.py with the shape (on a CPU it stops at the GPU check);
    training options are refused in inference mode."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return entry_points.run(["scripts/bench_mlp.py", *args], SCRIPT_ENV, tmp_path)

    train = run("--mode", "train", "--m", "64", "--cases", "u28")
    if not torch.cuda.is_available():
        assert train.returncode != 0 and "bench_train_mlp.py needs a CUDA GPU" in train.stderr
    refused = run("--mode", "infer", "--cases", "u28")
    assert refused.returncode == 2 and "unrecognized arguments: --cases u28" in refused.stderr


def test_relative_error_is_over_all_elements_in_fp32():
    reference = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert relative_error(
        reference.bfloat16() + torch.tensor([[0.0, 0.5], [0.0, 0.0]]).bfloat16(), reference
    ) == pytest.approx(0.1)
    assert relative_error(torch.ones(2), torch.zeros(2)) == pytest.approx(2**0.5 / 1e-30, rel=1e-6)
