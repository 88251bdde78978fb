"""scripts/bench_train_grid.py: auto against dense training steps, one row per model, mode and micro-batch."""

import pytest
from helpers.script_modules import load_script

from sparse_llm.bench.measure import VariantResult
from sparse_llm.bench.model_setup import LayerStats
from sparse_llm.bench.records import read_records
from sparse_llm.ffn.backend import Tail

grid = load_script("bench_train_grid")


def step(kernel: str, ms: float, paths: list[str]) -> VariantResult:
    layers = [LayerStats(20.0 + i, 40.0, 60.0, path, 0, Tail(0.0, 0.0)) for i, path in enumerate(paths)]
    result = VariantResult("train", kernel, 4, 8192, ms=ms, ms_spread=(0.99 * ms, 1.01 * ms), layers=layers)
    result.peak_gib = 2.0 if kernel == "torch" else 1.5
    return result


def test_a_row_compares_the_medians_within_the_tolerance():
    dense = step("torch", 100.0, ["torch", "torch", "torch"])
    faster = grid.grid_row("2b", "eager", dense, step("auto", 80.0, ["torch", "twell-train", "twell-train"]), 0.02)
    assert faster["auto speedup"] == 1.25 and faster["sparse layers"] == "2/3" and faster["verdict"] == "ok"
    assert faster["L0 mean"] == 21.0 and faster["spread"] == "2.0% / 2.0%"
    assert (faster["peak GiB torch"], faster["peak GiB auto"]) == (2.0, 1.5)
    assert grid.grid_row("2b", "eager", dense, step("auto", 101.9, ["torch"] * 3), 0.02)["verdict"] == "ok"
    assert grid.grid_row("2b", "eager", dense, step("auto", 103.0, ["torch"] * 3), 0.02)["verdict"] == "slower"
    noisy = step("auto", 103.0, ["torch"] * 3)
    noisy.ms_spread = (90.0, 110.0)  # a 19% spread: a 3% gap could be noise
    assert grid.grid_row("2b", "eager", dense, noisy, 0.02)["verdict"] == "slower within spread"
    skipped = VariantResult("train", "auto", 4, 8192, skipped="out of memory at micro-batch 4")
    assert grid.grid_row("2b", "graphs", dense, skipped, 0.02)["skipped"] == "out of memory at micro-batch 4"


def test_a_cpu_grid_writes_one_record_that_grows_with_its_rows(tmp_path):
    argv = ["--sizes", "tiny", "--density-l0", "8", "--seq-len", "32", "--batches", "1", "2", "--modes", "eager"]
    rows = grid.main([*argv, "--reps", "1", "--warmup", "1", "--device", "cpu", "--record-dir", str(tmp_path)])
    assert [(row["model"], row["mode"], row["micro-batch"]) for row in rows] == [
        ("tiny, random at L0 8", "eager", b) for b in (1, 2)
    ]
    assert all(row["sparse layers"].startswith("0/") for row in rows)  # no sparse kernels on a CPU
    (record,) = read_records(tmp_path).values()
    assert record["bench"] == "bench_train_grid" and record["results"] == rows


def test_an_unsettled_row_is_timed_again_in_the_reverse_order_and_judged_on_both_runs(monkeypatch, tmp_path):
    # Each call of the benchmark gives its variant's next steps: dense and auto first look 10% apart, the second runs
    # (auto, then dense) show them equal, as a machine whose pace changed between the runs would.
    steps = {"torch": [[100.0, 100.0], [110.0, 110.0]], "auto": [[110.0, 110.0], [110.0, 110.0]]}
    calls = []

    def bench_train(model, master, ids, kernel, observed, meter, gate_ms, options):
        calls.append((kernel, observed is not None))
        result = VariantResult(
            "train", kernel, ids.shape[0], ids.numel(), layers=[LayerStats(9.0, 9, 9, "torch", 0, Tail(0.0, 0.0))]
        )
        grid.fill_timing(result, steps[kernel].pop(0), 1.0, None)
        return result

    monkeypatch.setattr(grid, "bench_train", bench_train)
    argv = [
        "--sizes",
        "tiny",
        "--density-l0",
        "8",
        "--seq-len",
        "32",
        "--batches",
        "1",
        "--modes",
        "eager",
        "--device",
        "cpu",
    ]
    (row,) = grid.main([*argv, "--record-dir", str(tmp_path)])
    assert calls == [("torch", False), ("auto", True), ("auto", True), ("torch", False)]
    assert row["order"] == "torch, auto, auto, torch" and row["verdict"] == "slower within spread"
    assert (row["torch ms"], row["auto ms"], row["spread"]) == (105.0, 110.0, "9.5% / 0.0%")


def test_a_settled_row_is_timed_once():
    dense, auto = step("torch", 100.0, ["torch"]), step("auto", 100.5, ["torch"])
    assert grid.grid_row("2b", "eager", dense, auto, 0.02)["order"] == "torch, auto"


def test_two_runs_pool_their_steps_and_a_skipped_run_skips_the_variant():
    first, again = step("auto", 100.0, ["torch"]), step("auto", 90.0, ["twell-train"])
    first.samples_ms, again.samples_ms = [100.0, 101.0, 99.0], [90.0, 91.0]
    both = grid.pooled(first, again)
    assert (both.ms, both.ms_spread, both.layers, both.peak_gib) == (99.0, (90.0, 101.0), again.layers, 1.5)
    skipped = VariantResult("train", "auto", 4, 8192, skipped="out of memory at micro-batch 4")
    assert grid.pooled(first, skipped) is skipped and grid.pooled(skipped, again) is skipped


def test_smaller_micro_batches_take_more_timed_steps_up_to_four_times():
    assert [grid.timed_steps(3, tokens) for tokens in (2048, 4096, 8192, 16384, 64)] == [12, 6, 3, 3, 12]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batches", "2"], "give --sizes"),
        (["--sizes", "tiny", "--modes", "graphs", "--device", "cpu"], "--modes graphs needs a CUDA GPU"),
        (["--sizes", "tiny", "--batches", "0"], "must be >= 1"),
        (["--checkpoint", "nowhere"], "not a model directory"),
    ],
)
def test_usage_errors_exit_2_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grid.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
