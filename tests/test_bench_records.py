"""Benchmark records (sparse_llm/bench/records.py) and docs/benchmarks.md generated from them
(sparse_llm/bench/report.py, scripts/bench_report.py)."""

import json
import runpy
import subprocess
from pathlib import Path

import pytest

from sparse_llm.bench import records
from sparse_llm.bench.records import SCHEMA, make_record, read_records, record_file_name, write_record
from sparse_llm.bench.report import BANNER, render_benchmarks

ROOT = Path(__file__).resolve().parents[1]
bench_report = runpy.run_path(str(ROOT / "scripts" / "bench_report.py"))


def _fake(bench: str, time: str, gpu: str | None, settings: dict, results: list[dict], **extra) -> dict:
    hardware = {
        "summary": gpu or "CPU",
        "gpu": gpu,
        "sm_count": 132 if gpu else None,
        "driver": None,
        "cuda": "13.0",
        "torch": "2.11.0",
        "cupy": None,
        "cpu": "Test CPU",
    }
    return {
        "schema": SCHEMA,
        "bench": bench,
        "time": time,
        "hardware": hardware,
        "commit": "0123456789abcdef",
        "command": f"python scripts/{bench}.py --x",
        "settings": settings,
        "results": results,
        **extra,
    }


def test_a_record_goes_through_the_writer_the_reader_and_the_generator(tmp_path):
    rows = [
        {"kernel": "torch", "ms": 2.5, "ratio": float("nan"), "layers": [{"l0": 3.0}]},
        {"kernel": "twell", "ms": 1.25, "ratio": 2.0, "layers": [{"l0": 3.0}]},
    ]
    record = make_record("bench_mlp", {"m": 16, "nnz": "28,56"}, rows, "cpu", ["--m", "16", "--note", "a b"])
    assert record["schema"] == SCHEMA and record["hardware"]["gpu"] is None and record["hardware"]["torch"]
    assert record["command"] == "python scripts/bench_mlp.py --m 16 --note 'a b'"
    assert record["results"][0]["ratio"] is None  # NaN is not JSON: null
    path = write_record(tmp_path / "records", record)
    assert path.name == record_file_name(record) and path.name.startswith("bench_mlp-")
    assert path.name.endswith(".json") and len(path.stem.split("-")) == 3
    read = read_records(tmp_path / "records")
    assert read == {path.name: record}
    text = render_benchmarks(read)
    assert "- Command: `python scripts/bench_mlp.py --m 16 --note 'a b'`" in text
    assert "| kernel | ms | ratio |" in text and "| twell | 1.25 | 2 |" in text and "| torch | 2.5 | - |" in text
    assert "In the record, per row: layers." in text and f"(records/{path.name})" in text


def test_a_record_of_another_schema_is_named(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"schema": 0}))
    with pytest.raises(ValueError, match="old.json: schema 0"):
        read_records(tmp_path)


def test_the_generator_keeps_the_newest_record_per_bench_hardware_and_settings():
    records = {
        "bench_mlp-1.json": _fake("bench_mlp", "2026-01-01T00:00:00Z", "NVIDIA H100", {"m": 16}, [{"ms": 9.0}]),
        "bench_mlp-2.json": _fake(
            "bench_mlp", "2026-01-02T00:00:00Z", "NVIDIA H100", {"m": 16}, [{"ms": 1.5}], source='notes.md, "a section"'
        ),
        "bench_decode-1.json": _fake(
            "bench_decode",
            "2026-01-01T00:00:00Z",
            None,
            {"batches": [1, 4], "size": None},
            [{"batch": 1, "path": "a|b", "ok": True}],
        ),
    }
    expected = "\n".join(
        [
            BANNER,
            "",
            *render_benchmarks({}).split("\n")[2:-1],
            "",
            "## Decoding steps: the whole model feeding one token per row (`scripts/bench_decode.py`)",
            "",
            "### CPU: Test CPU, 2026-01-01 00:00:00 UTC",
            "",
            "- Hardware: no GPU, CUDA 13.0, torch 2.11.0, CPU Test CPU",
            "- Settings: batches 1,4",
            "- Command: `python scripts/bench_decode.py --x`",
            "- Commit: 0123456789ab; record: [bench_decode-1.json](records/bench_decode-1.json)",
            "",
            "| batch | path | ok |",
            "|---|---|---|",
            "| 1 | a\\|b | yes |",
            "",
            "## One gated MLP block, inference: dense torch vs the twell backend (`scripts/bench_mlp.py`)",
            "",
            "### NVIDIA H100, 2026-01-02 00:00:00 UTC",
            "",
            "- Hardware: NVIDIA H100, SMs 132, CUDA 13.0, torch 2.11.0, CPU Test CPU",
            "- Settings: m 16",
            "- Command: `python scripts/bench_mlp.py --x`",
            "- Commit: 0123456789ab; record: [bench_mlp-2.json](records/bench_mlp-2.json)",
            '- Source: notes.md, "a section"',
            "",
            "| ms |",
            "|---|",
            "| 1.5 |",
            "",
        ]
    )
    assert render_benchmarks(records) == expected
    # The same records in another order give the same file.
    assert render_benchmarks(dict(reversed(list(records.items())))) == expected


def test_committed_benchmarks_page_is_what_the_committed_records_give():
    """docs/benchmarks.md cannot go stale: regenerate it (python scripts/bench_report.py) after adding a record."""
    records = read_records(ROOT / "docs" / "records")
    assert records, "docs/records/ holds the benchmark records"
    assert (ROOT / "docs" / "benchmarks.md").read_text() == render_benchmarks(records)


def test_bench_report_writes_the_page_and_checks_it(tmp_path, capsys):
    records, out = tmp_path / "records", tmp_path / "benchmarks.md"
    write_record(records, _fake("bench_mlp", "2026-01-01T00:00:00Z", "NVIDIA H100", {"m": 16}, [{"ms": 1.0}]))
    main = bench_report["main"]
    assert main(["--record-dir", str(records), "--out", str(out), "--check"]) == 1  # not written yet
    assert main(["--record-dir", str(records), "--out", str(out)]) == 0
    assert out.read_text().startswith(BANNER) and "| 1 |" in out.read_text()
    assert main(["--record-dir", str(records), "--out", str(out), "--check"]) == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["--record-dir", str(tmp_path / "missing"), "--out", str(out)])
    assert exit_info.value.code == 2 and "no such directory" in capsys.readouterr().err


def test_a_record_marks_a_commit_whose_files_were_changed(tmp_path):
    """The commit a record names is the code that ran only where no tracked file differs from it: "+dirty" otherwise
    (a copy of a working tree carries the .git of an older commit, for one)."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert records.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert records.git_commit(tmp_path) == f"{head}+dirty"
