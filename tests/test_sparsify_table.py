"""scripts/sparsify_table.py: the sparsify experiment's three runs as one table and one record."""

import json
from pathlib import Path

import pytest
from helpers.script_modules import load_script

from sparse_llm.bench.records import read_records

sparsify_table = load_script("sparsify_table")


def write_metrics(run_dir: Path, lines: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def scored(run: str, ce: float, l0_max: list[int], never: list[float]) -> dict:
    layers = [{"l0_max": top, "never_fired": share} for top, share in zip(l0_max, never, strict=True)]
    return {
        "checkpoint": f"outputs/{run}/final",
        "perplexity": {"ce": ce},
        "sparsity": {"sparsity_mean": 0.98765, "l0_mean": 24.26, "layers": layers},
        "mean_acc": 0.6833,
    }


def test_rows_and_record_come_from_the_runs(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    write_metrics(outputs / "x_dense", [{"step": 10, "val/ce": 3.5}, {"step": 20, "val/ce": 3.25}])
    write_metrics(
        outputs / "x_sparsified",
        [{"step": 0, "val/ce": 3.51034, "val/ce_dense_source": 3.32541}, {"step": 30, "val/ce": 2.9, "dead/mean": 0.0}],
    )
    write_metrics(outputs / "x_scratch", [{"step": 50, "val/ce": 2.66, "dead/mean": 0.19}, {"step": 50, "loss": 1.0}])
    results = {
        "settings": {"device_name": "NVIDIA H100 80GB HBM3"},
        "software": {"torch": "2.11.0+cu130"},
        "models": [scored("x_sparsified", 2.95, [10, 30], [0.0, 0.0]), scored("x_scratch", 2.76, [5, 7], [0.1, 0.3])],
    }
    (outputs / "x_eval").mkdir()
    (outputs / "x_eval" / "results.json").write_text(json.dumps(results))
    records = tmp_path / "records"
    argv = ["--prefix", "x", "--n", "20", "--m", "30", "--l1", "1e-3", "--model", "91m", "--data", "data=embedded"]
    assert sparsify_table.main([*argv, "--outputs", str(outputs), "--record-dir", str(records)]) == 0
    (record,) = read_records(records).values()
    dense, sparsified, scratch = record["results"]
    assert (dense["steps"], sparsified["steps"], scratch["steps"]) == ("20", "20 + 30", "50")
    assert dense["val CE (train.py)"] == 3.25 and dense["held-out CE (eval.py)"] is None
    assert sparsified["held-out CE (eval.py)"] == 2.95 and sparsified["L0 max"] == 30
    assert sparsified["step 0 val CE: dense source / after ReLU swap"] == "3.3254 / 3.5103"
    assert scratch["dead (last window)"] == 0.19 and scratch["never fired"] == 0.2
    assert record["hardware"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert record["settings"] == {"model": "91m", "data": "data=embedded", "n": 20, "m": 30, "l1": 1e-3}


def test_missing_evaluation_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--n", "1", "--m", "1", "--l1", "1e-3", "--model", "91m", "--data", "data=embedded"]
    with pytest.raises(SystemExit) as exit_info:
        sparsify_table.main([*argv, "--outputs", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "run scripts/sparsify_experiment.sh to the end first" in capsys.readouterr().err
