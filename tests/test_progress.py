"""sparse_llm/data/progress.py and scripts/tokenize_corpus.py: a progress line every few seconds while a corpus is
tokenized, and one line with exit code 2 for a bad key, value or path."""

import sys

import numpy as np
import pytest
from helpers.script_modules import load_script

from sparse_llm.data import pipeline
from sparse_llm.data.progress import ProgressLog

tokenize_corpus = load_script("tokenize_corpus")


def test_a_line_once_the_interval_has_passed_with_the_rate_so_far() -> None:
    times = iter([100.0, 104.0, 110.0, 115.0, 121.0])  # the start, then one reading per update
    lines: list[str] = []
    progress = ProgressLog("tokenizing", interval_s=10.0, clock=lambda: next(times), report=lines.append)
    for documents in (1, 2, 3, 4):
        progress.update(documents, 1000 * documents)
    assert lines == [
        "tokenizing: 2 documents, 2,000 tokens so far (200 tokens/s)",
        "tokenizing: 4 documents, 4,000 tokens so far (190 tokens/s)",
    ]


def test_the_token_file_writer_counts_every_document_of_both_splits(tmp_path) -> None:
    seen: list[tuple[int, int]] = []

    class Recording(ProgressLog):
        def update(self, documents: int, tokens: int) -> None:
            seen.append((documents, tokens))

    train, val = [np.arange(3), np.arange(5)], [np.arange(2)]
    pipeline._write_token_file(tmp_path / "t", iter(train), iter(val), "embedded", 8192, {}, Recording("x"))
    assert seen == [(1, 3), (2, 8), (3, 10)]


def test_tokenizing_reports_what_it_writes_where(tmp_path, monkeypatch) -> None:
    made: list[str] = []
    monkeypatch.setattr(pipeline, "ProgressLog", lambda what: made.append(what) or ProgressLog(what))
    pipeline.write_token_file(pipeline.DataConfig(max_documents=20, val_documents=2), tmp_path / "emb")
    assert made == [f"tokenizing data=embedded into {tmp_path / 'emb'}"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nme=local"], "unknown config key 'nme': DataConfig has no 'nme'. Did you mean 'name'?"),
        (["max_documents=abc"], "could not be converted to Integer"),
        (["name=local", "paths=[nowhere/*.jsonl]"], "matched no txt/json/jsonl/parquet files"),
    ],
)
def test_bad_overrides_end_in_one_message_and_code_2(tmp_path, monkeypatch, capsys, overrides, message) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["tokenize_corpus.py", "--out", str(tmp_path / "t"), *overrides])
    with pytest.raises(SystemExit) as exited:
        tokenize_corpus.main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenize_corpus.py: ") and message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written
