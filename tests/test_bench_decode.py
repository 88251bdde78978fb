"""scripts/bench_decode.py on the CPU: every case runs and the report names what it measured."""

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the script imports this checkout's package


def test_smoke_run_reports_each_batch_and_kernel(tmp_path, entry_points):
    records = tmp_path / "records"
    command = [
        "scripts/bench_decode.py",
        "--size",
        "tiny",
        "--batches",
        "1,3",
        "--prompt-len",
        "8",
        "--steps",
        "2",
        "--reps",
        "2",
        "--density-l0",
        "8",
        "--device",
        "cpu",
        "--record-dir",
        str(records),
    ]
    run = entry_points.run(command, SCRIPT_ENV, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (record_file,) = records.glob("bench_decode-*.json")
    record = json.loads(record_file.read_text())
    assert record["settings"]["batches"] == [1, 3] and len(record["prompt_l0"]) == 4
    rows = record["results"]
    assert [(r["batch"], r["kernel"]) for r in rows] == [(b, k) for b in (1, 3) for k in ("stock", "torch", "auto")]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in rows)  # no CUDA graphs on a CPU
    assert all(r["eager_vs_torch"] > 0 for r in rows)
    assert all(r["eager_vs_torch"] == 1.0 for r in rows if r["kernel"] == "torch")
    # the stock run, taken in turn with the others, leaves no stock modules behind: the FFN kernels ran on our modules
    layers = {sum(r["paths"].values()) for r in rows if r["kernel"] != "stock"}
    assert len(layers) == 1 and layers.pop() > 0
    assert all(r["vs_torch"] == 1.0 for r in rows if r["kernel"] == "torch")
    text = run.stdout
    assert "### Decoding steps, tiny" in text and "Prompt L0 per layer" in text and "the kernels in turn" in text
    assert "| 3 | stock |" in text and "LlamaMLP |" in text and "| eager vs torch |" in text


def test_bad_kernel_is_named(tmp_path, entry_points):
    run = entry_points.run(["scripts/bench_decode.py", "--size", "tiny", "--kernels", "twel"], SCRIPT_ENV, tmp_path)
    assert run.returncode == 2 and "unknown ['twel']" in run.stderr
