"""CPU tests of scripts/compare_runs.py and its library (sparse_llm/bench/run_comparison.py): the training table and
the quality table read from eval.py results."""

import json
import runpy
from pathlib import Path

import pytest

from sparse_llm.bench import run_comparison as compare_runs

ROOT = Path(__file__).resolve().parents[1]


def _run(root: Path, name: str, losses: list[float], dead: float) -> Path:
    run = root / name
    run.mkdir()
    lines = [
        {
            "step": 10 * (i + 1),
            "loss": loss,
            "tokens_per_s": 1000.0 * (i + 1),
            "peak_mem_gb": 1.0,
            "mj_per_token": 2.0,
            "l0/mean": 5.0,
            "dead/mean": dead,
        }
        for i, loss in enumerate(losses)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def _model(run: Path, ce: float, l0: float, never: list[float], acc: float) -> dict:
    layers = [{"layer": i, "l0_mean": l0, "never_fired": frac} for i, frac in enumerate(never)]
    return {
        "checkpoint": str(run / "final"),
        "perplexity": {"ce": ce, "ppl": 2.718281828**ce},
        "sparsity": {"neurons": 100, "l0_mean": l0, "sparsity_mean": 1 - l0 / 100, "layers": layers},
        "tasks": {"piqa": {"acc": acc}},
    }


def test_training_and_quality_tables(tmp_path):
    dense = _run(tmp_path, "dense", [3.0, 2.0], dead=0.0)
    sparse = _run(tmp_path, "sparse", [3.1, 2.05], dead=0.25)
    results = tmp_path / "results.json"
    models = [_model(dense, 2.0, 40.0, [0.0, 0.0], 0.6), _model(sparse, 2.04, 1.0, [0.1, 0.3], 0.55)]
    results.write_text(json.dumps({"models": models}))

    training = compare_runs.table([dense, sparse]).splitlines()
    assert training[2].startswith("| dense | 20 | 2.0000 | - |")  # no gap against itself
    assert training[3].startswith("| sparse | 20 | 2.0500 | 0.1000 |")

    quality = compare_runs.quality_table([dense, sparse], results).splitlines()
    assert quality[0].endswith("| piqa acc |")
    assert quality[2] == "| dense | 2.0000 | +0.00% | 7.39 | 40.0 / 100 | 60.00% | 0.0% | 0.0% | 0.600 |"
    assert quality[3] == "| sparse | 2.0400 | +2.00% | 7.69 | 1.0 / 100 | 99.00% | 20.0% | 25.0% | 0.550 |"


def test_quality_table_without_tasks_has_no_empty_column(tmp_path):
    dense = _run(tmp_path, "dense", [2.0], dead=0.0)
    model = _model(dense, 2.0, 40.0, [0.0], 0.5)
    del model["tasks"]  # eval.py tasks=none
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"models": [model]}))
    header, rule, row = compare_runs.quality_table([dense], results).splitlines()
    assert header.endswith("| dead (last training window) |") and rule.count("|---") == 8
    assert row == "| dense | 2.0000 | +0.00% | 7.39 | 40.0 / 100 | 60.00% | 0.0% | 0.0% |"


def test_quality_table_names_a_run_that_was_not_evaluated(tmp_path):
    dense = _run(tmp_path, "dense", [2.0], dead=0.0)
    other = _run(tmp_path, "other", [2.0], dead=0.0)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"models": [_model(dense, 2.0, 40.0, [0.0], 0.5)]}))
    with pytest.raises(SystemExit, match="no result for .*other"):
        compare_runs.quality_table([dense, other], results)


def test_spread_table_groups_repeats_and_compares_means(tmp_path):
    runs = [
        _run(tmp_path, name, [3.0, final], dead=0.0)
        for name, final in [
            ("one_r1", 1.0),
            ("one_r2", 1.2),
            ("one_r3", 1.1),
            ("ddp_r1", 1.3),
            ("ddp_r2", 1.1),
            ("fsdp", 1.25),
        ]
    ]
    header, rule, one, ddp, fsdp = compare_runs.spread_table(runs).splitlines()
    assert one == "| one | 3 | 1.1000 | 0.1000 | 1.0000-1.2000 | - | - | 2,000 | 1.00x |"
    # gap 1.2 - 1.1; its standard error sqrt(0.1^2 / 3 + 0.1414^2 / 2)
    assert ddp == "| ddp | 2 | 1.2000 | 0.1414 | 1.1000-1.3000 | +0.1000 | 0.1155 | 2,000 | 1.00x |"
    assert fsdp == "| fsdp | 1 | 1.2500 | - | 1.2500-1.2500 | +0.1500 | - | 2,000 | 1.00x |"  # one run: no spread
    assert compare_runs.spread_table(runs[:1] + runs[3:4]) is None  # nothing repeated: no table


def test_command_line_prints_the_tables_and_writes_a_record(tmp_path, capsys):
    dense = _run(tmp_path, "dense", [3.0, 2.0], dead=0.0)
    sparse = _run(tmp_path, "sparse", [3.1, 2.05], dead=0.25)
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps({"models": [_model(dense, 2.0, 40.0, [0.0, 0.0], 0.6), _model(sparse, 2.04, 1.0, [0.1, 0.3], 0.55)]})
    )
    main = runpy.run_path(str(ROOT / "scripts" / "compare_runs.py"))["main"]
    main(
        [
            str(dense),
            str(sparse),
            "--eval",
            str(results),
            "--title",
            "dense vs sparse",
            "--record-dir",
            str(tmp_path / "records"),
        ]
    )
    assert "| sparse | 20 | 2.0500 | 0.1000 |" in capsys.readouterr().out
    (record_file,) = (tmp_path / "records").glob("compare_runs-*.json")
    record = json.loads(record_file.read_text())
    assert record["settings"]["title"] == "dense vs sparse"
    assert [row["run"] for row in record["results"]] == ["dense", "sparse"]
    assert record["results"][0]["max_gap"] is None  # NaN (no gap against itself) is null in JSON
    assert record["quality"][1]["ce_vs_first"] == pytest.approx(0.02) and record["quality"][1]["piqa_acc"] == 0.55


def test_command_line_names_a_run_directory_without_metrics_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    dense = _run(tmp_path, "dense", [3.0, 2.0], dead=0.0)
    main = runpy.run_path(str(ROOT / "scripts" / "compare_runs.py"))["main"]
    with pytest.raises(SystemExit) as exited:
        main([str(dense), str(tmp_path / "missing"), "--record-dir", str(tmp_path / "records")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("compare_runs.py: ") and "missing/metrics.jsonl does not exist" in err
    assert not (tmp_path / "records").exists()
