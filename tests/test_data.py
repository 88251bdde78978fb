"""CPU tests of the data pipeline: tokenizer, packing, splits, loaders, resume, sharding, files, errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import background
from huggingface_hub import constants

import sparse_llm.data.pipeline as data_module
from sparse_llm.data.loader import TrainLoader, val_batches
from sparse_llm.data.pipeline import (
    DataConfig,
    TokenArray,
    build_token_data,
    held_out_documents,
    read_token_file,
    write_token_file,
)
from sparse_llm.data.tokenizer import load_tokenizer

SEQ = 64


@pytest.fixture
def offline(monkeypatch) -> list[tuple]:
    """HF_HUB_OFFLINE set, and every connection the code then attempts: refused, and listed (none is expected)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    attempts = []

    def connect(sock, address):
        attempts.append(address)
        raise ConnectionRefusedError(f"the test is offline: {address}")

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.fixture(scope="module")
def embedded():
    return build_token_data(DataConfig(), SEQ)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def _docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """Split a packed token stream at eos (each document ends with one)."""
    out, current = [], []
    for t in tokens.tolist():
        if t == eos:
            out.append(current)
            current = []
        else:
            current.append(t)
    assert current == [], "the stream must end with eos"
    return out


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


NUMBERED = [f"Document number {i}. " + "word " * (i % 7 + 3) for i in range(60)]


# ---------------------------------------------------------------------------------------------- tokenizer
def test_embedded_tokenizer_round_trips_and_has_special_tokens(tokenizer):
    assert len(tokenizer) == 8192
    assert tokenizer.convert_ids_to_tokens([tokenizer.eos_token_id, tokenizer.pad_token_id]) == [
        "<|endoftext|>",
        "<pad>",
    ]
    assert tokenizer.bos_token_id == tokenizer.eos_token_id
    text = "def f(x):\n    return x ** 2  # naïve café, 日本語 🙂\n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    english = "The function returns a new list containing the items of the iterable."
    assert len(tokenizer(english, add_special_tokens=False)["input_ids"]) < len(english) / 3  # merges, not bytes


def test_unknown_tokenizer_fails_fast_offline(offline):
    with pytest.raises(ValueError, match="not in the Hugging Face cache.*tokenizer=embedded"):
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert offline == []  # fails without trying the network (no retries, no timeouts to wait out)


# --------------------------------------------------------------------------------------- embedded corpus
def test_embedded_data_shapes_vocab_and_eos(embedded, tokenizer):
    assert embedded.vocab_size == 8192
    eos = tokenizer.eos_token_id
    for source in (embedded.train, embedded.val):
        assert source.tokens.dtype == np.uint16
        assert int(source.tokens.max()) < embedded.vocab_size
        assert int((source.tokens == eos).sum()) == source.n_documents
        assert source.tokens[-1] == eos
    assert embedded.train.n_documents > 500 and embedded.val.n_documents > 10
    batch = TrainLoader(embedded.train, 3, SEQ, seed=0).next_batch()
    assert batch.shape == (3, SEQ) and batch.dtype == torch.long


def test_validation_documents_are_held_out_and_decode_back(embedded, tokenizer):
    held_out = held_out_documents(DataConfig())
    val_docs = [tokenizer.decode(d) for d in _docs(np.asarray(embedded.val.tokens), tokenizer.eos_token_id)]
    assert val_docs == held_out
    train_docs = {tokenizer.decode(d) for d in _docs(np.asarray(embedded.train.tokens), tokenizer.eos_token_id)}
    assert not train_docs & set(held_out)
    assert len(train_docs) + len(held_out) == embedded.train.n_documents + embedded.val.n_documents


def test_val_batches_are_fixed_and_in_order(embedded):
    first = val_batches(embedded.val, 4, SEQ, max_batches=3)
    again = val_batches(embedded.val, 4, SEQ, max_batches=3)
    assert len(first) == 3 and all(b.shape == (4, SEQ) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    assert torch.equal(first[0][1], torch.from_numpy(embedded.val.tokens[SEQ : 2 * SEQ].astype(np.int64)))
    everything = val_batches(embedded.val, 4, SEQ, max_batches=10**6)
    assert sum(len(b) for b in everything) == len(embedded.val) // SEQ


# ------------------------------------------------------------------------------------------------ loader
def _take(loader: TrainLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_is_deterministic_given_seed(embedded):
    a = _take(TrainLoader(embedded.train, 2, SEQ, seed=5), 4)
    b = _take(TrainLoader(embedded.train, 2, SEQ, seed=5), 4)
    c = _take(TrainLoader(embedded.train, 2, SEQ, seed=6), 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=False))


def test_array_loader_resume_matches_uninterrupted_run_across_epochs():
    source = TokenArray(np.arange(1000, dtype=np.uint32), n_documents=1)
    seq, micro = 10, 4  # about 24 batches per epoch: 60 batches cross two epoch boundaries
    full = TrainLoader(source, micro, seq, seed=3)
    reference = _take(full, 60)
    for k in (0, 7, 24, 25, 41):
        first = TrainLoader(source, micro, seq, seed=3)
        _take(first, k)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = TrainLoader(source, micro, seq, seed=3)
        resumed.load_state_dict(state)
        assert all(torch.equal(x, y) for x, y in zip(_take(resumed, 60 - k), reference[k:], strict=False)), k
        assert resumed.tokens_seen == 60 * micro * seq
    assert full.state_dict()["position"]["epoch"] == 2


def test_array_epochs_reshuffle_and_cover_blocks_once():
    source = TokenArray(np.arange(1000, dtype=np.uint32), n_documents=1)
    loader = TrainLoader(source, 4, 10, seed=0)
    per_epoch = (1000 - 9) // 10 // 4  # a lower bound on full batches in one epoch
    starts = [int(s) for b in _take(loader, per_epoch) for s in b[:, 0]]
    assert len(set(starts)) == len(starts)  # no block twice within an epoch
    assert all(torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 9, dtype=torch.long)) for b in _take(loader, 5))


def test_two_ranks_read_disjoint_blocks():
    source = TokenArray(np.arange(2000, dtype=np.uint32), n_documents=1)
    ranks = [TrainLoader(source, 3, 10, seed=1, rank=r, world_size=2) for r in range(2)]
    starts = [{int(s) for b in _take(loader, 30) for s in b[:, 0]} for loader in ranks]
    assert len(starts[0]) == len(starts[1]) == 90
    assert not starts[0] & starts[1]


def test_loader_state_from_another_configuration_is_rejected(embedded):
    state = TrainLoader(embedded.train, 2, SEQ, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 vs 2"):
        TrainLoader(embedded.train, 2, SEQ, seed=2).load_state_dict(state)


# ------------------------------------------------------------------------------------------- local files
def test_local_txt_jsonl_parquet_give_the_same_tokens(tmp_path):
    texts = NUMBERED[:20]
    (tmp_path / "c.txt").write_text("\n\n".join(texts))  # one document per paragraph
    _write_jsonl(tmp_path / "c.jsonl", texts)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts, "id": list(range(20))}), tmp_path / "c.parquet")
    results = []
    for name in ("c.txt", "c.jsonl", "c.parquet"):
        cfg = DataConfig(name="local", paths=[str(tmp_path / name)], val_documents=3)
        data = build_token_data(cfg, 8)
        results.append((np.asarray(data.train.tokens), np.asarray(data.val.tokens)))
        held_out = held_out_documents(cfg)
        assert len(held_out) == 3 and set(held_out) <= set(texts)
        assert data.train.n_documents == 17
    for train, val in results[1:]:
        assert np.array_equal(train, results[0][0]) and np.array_equal(val, results[0][1])


def test_local_directory_and_glob_paths(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", NUMBERED[:10])
    _write_jsonl(tmp_path / "b.jsonl", NUMBERED[10:20])
    by_dir = build_token_data(DataConfig(name="local", paths=[str(tmp_path)], val_documents=2), 8)
    by_glob = build_token_data(DataConfig(name="local", paths=[str(tmp_path / "*.jsonl")], val_documents=2), 8)
    assert by_dir.train.n_documents == 18
    assert np.array_equal(by_dir.train.tokens, by_glob.train.tokens)


def test_cache_dir_writes_once_and_matches(tmp_path):
    cfg = DataConfig(
        name="local",
        paths=[str(_write_jsonl(tmp_path / "c.jsonl", NUMBERED))],
        val_documents=5,
        cache_dir=str(tmp_path / "cache"),
    )
    plain = build_token_data(DataConfig(**{**cfg.__dict__, "cache_dir": None}), 8)
    cached = build_token_data(cfg, 8)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1
    again = build_token_data(cfg, 8)
    assert isinstance(again.train.tokens, np.memmap)
    for data in (cached, again):
        assert np.array_equal(data.train.tokens, plain.train.tokens)
        assert np.array_equal(data.val.tokens, plain.val.tokens)


def test_cache_dir_complete_file_is_not_rewritten(tmp_path, monkeypatch):
    cfg = DataConfig(
        name="local",
        paths=[str(_write_jsonl(tmp_path / "c.jsonl", NUMBERED))],
        val_documents=5,
        cache_dir=str(tmp_path / "cache"),
    )
    build_token_data(cfg, 8)

    def fail(*args, **kwargs):
        raise AssertionError("a complete cache file was written again")

    monkeypatch.setattr(data_module, "write_token_file", fail)
    assert build_token_data(cfg, 8).train.n_documents == len(NUMBERED) - 5


def test_token_file_concurrent_writers_do_not_collide(tmp_path):
    """Ranks filling one cache at once (threads here) each rename a complete file: none fails, no temp is left."""
    writers = 3
    all_started = threading.Barrier(writers)
    docs = [np.arange(i, i + 5) for i in range(0, 40, 5)]

    def chunks():
        for i, doc in enumerate(docs):
            if i == 1:
                all_started.wait(timeout=30)  # every writer has its temporary file open and part-written
            yield doc

    errors: list[BaseException] = []

    def write() -> None:
        try:
            data_module._write_token_file(tmp_path / "c", chunks(), iter([np.arange(3)]), "embedded", 8192, {})
        except BaseException as exc:  # collected: an exception in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    meta, train, val = read_token_file(tmp_path / "c")
    assert np.array_equal(np.asarray(train.tokens), np.concatenate(docs))
    assert np.array_equal(np.asarray(val.tokens), np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.json"]


# -------------------------------------------------------------------------------------------- token files
def test_token_file_round_trip(tmp_path, embedded):
    meta = write_token_file(DataConfig(), tmp_path / "emb")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 8192 and meta["tokenizer"] == "embedded"
    assert meta["n_tokens"] == len(embedded.train) + len(embedded.val) == (tmp_path / "emb.bin").stat().st_size // 2
    assert meta["val_start"] == len(embedded.train)
    cfg = DataConfig(name="tokens", tokenizer="from_file", paths=[str(tmp_path / "emb.bin")])
    data = build_token_data(cfg, SEQ)
    assert np.array_equal(data.train.tokens, embedded.train.tokens)
    assert np.array_equal(data.val.tokens, embedded.val.tokens)
    assert data.vocab_size == 8192 and data.train.n_documents == embedded.train.n_documents
    assert held_out_documents(cfg) == held_out_documents(DataConfig())
    a = _take(TrainLoader(data.train, 2, SEQ, seed=0), 3)
    b = _take(TrainLoader(embedded.train, 2, SEQ, seed=0), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))


def test_token_file_uses_uint32_for_large_vocabularies(tmp_path, monkeypatch):
    import sparse_llm.data.pipeline as data_module

    class BigVocab:  # the embedded tokenizer, pretending to have 70 000 entries
        def __init__(self):
            self.inner = load_tokenizer("embedded")
            self.eos_token_id = self.inner.eos_token_id

        def __len__(self):
            return 70_000

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    monkeypatch.setattr(data_module, "load_tokenizer", lambda name: BigVocab())
    meta = write_token_file(DataConfig(max_documents=30, val_documents=3), tmp_path / "big")
    _, train, val = read_token_file(tmp_path / "big")
    assert meta["dtype"] == "uint32" and train.tokens.dtype == np.uint32
    assert (tmp_path / "big.bin").stat().st_size == 4 * meta["n_tokens"]


def test_token_file_tokenizer_mismatch_is_an_error(tmp_path):
    write_token_file(DataConfig(max_documents=30, val_documents=3), tmp_path / "emb")
    cfg = DataConfig(name="tokens", tokenizer="HuggingFaceTB/SmolLM2-360M", paths=[str(tmp_path / "emb")])
    with pytest.raises(ValueError, match="data.tokenizer=embedded or data.tokenizer=from_file"):
        build_token_data(cfg, 8)


ROOT = Path(__file__).resolve().parent.parent
# Taken when the tests are collected: the run below may start while a test has variables of its own set.
FRESH_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@background.offer("fresh_interpreter_run")
def _embedded_and_token_paths_in_a_fresh_interpreter() -> subprocess.CompletedProcess:
    # A fresh interpreter imports torch and transformers for ~10 s: it runs while other tests do (helpers/background.py)
    with tempfile.TemporaryDirectory() as folder:
        tokens = str(Path(folder) / "t")
        code = (
            "import sys\n"
            "from sparse_llm.data.pipeline import DataConfig, build_token_data, write_token_file\n"
            "build_token_data(DataConfig(), 64)\n"
            f"write_token_file(DataConfig(max_documents=40), {tokens!r})\n"
            f"build_token_data(DataConfig(name='tokens', tokenizer='from_file', paths=[{tokens!r}]), 64)\n"
            "assert 'datasets' not in sys.modules, 'datasets was imported'\n"
        )
        return subprocess.run(
            background.low_priority([sys.executable, "-c", code]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=FRESH_ENV,
        )


@pytest.fixture
def fresh_interpreter_run() -> subprocess.CompletedProcess:
    return background.result("fresh_interpreter_run")


@pytest.mark.slow  # a fresh interpreter: torch and transformers imports take seconds
def test_embedded_and_token_paths_do_not_import_datasets(fresh_interpreter_run):
    assert fresh_interpreter_run.returncode == 0, fresh_interpreter_run.stderr[-2000:]


# -------------------------------------------------------------------------------------------- streaming
@pytest.fixture()
def stream_cfg(tmp_path) -> DataConfig:
    path = _write_jsonl(tmp_path / "s.jsonl", NUMBERED)
    return DataConfig(name="local", paths=[str(path)], streaming=True, val_documents=4, shuffle_buffer=16)


def test_stream_holds_out_its_first_documents(stream_cfg, tokenizer):
    assert held_out_documents(stream_cfg) == NUMBERED[:4]
    data = build_token_data(stream_cfg, 16)
    assert [tokenizer.decode(d) for d in _docs(np.asarray(data.val.tokens), tokenizer.eos_token_id)] == NUMBERED[:4]
    loader = TrainLoader(data.train, 2, 16, seed=0)
    seen = tokenizer.decode(torch.cat(_take(loader, 30)).flatten().tolist())
    assert "Document number 4." in seen and "Document number 3." not in seen


def test_stream_packs_documents_with_eos_and_resumes_exactly(stream_cfg, tokenizer):
    data = build_token_data(stream_cfg, 16)
    reference = _take(TrainLoader(data.train, 2, 16, seed=9), 80)  # several epochs of the 56 documents
    stream = torch.cat(reference).flatten()
    assert int((stream == tokenizer.eos_token_id).sum()) >= 56
    for k in (1, 13, 40):
        first = TrainLoader(data.train, 2, 16, seed=9)
        _take(first, k)
        resumed = TrainLoader(data.train, 2, 16, seed=9)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert all(torch.equal(x, y) for x, y in zip(_take(resumed, 80 - k), reference[k:], strict=False)), k


def test_stream_ranks_read_disjoint_documents(stream_cfg, tokenizer):
    data = build_token_data(stream_cfg, 16)
    eos = tokenizer.eos_token_id
    numbers = []
    for rank in range(2):
        loader = TrainLoader(data.train, 1, 16, seed=0, rank=rank, world_size=2)
        text = tokenizer.decode([t for t in torch.cat(_take(loader, 12)).flatten().tolist() if t != eos])
        numbers.append({int(w.rstrip(".")) for w in text.split("number ")[1:-1] for w in [w.split()[0]]})
    assert numbers[0] and numbers[1] and not numbers[0] & numbers[1]


def test_stream_to_token_file_keeps_every_document(stream_cfg, tmp_path, tokenizer):
    meta = write_token_file(stream_cfg, tmp_path / "s")
    assert (meta["n_train_documents"], meta["n_val_documents"]) == (56, 4)
    _, train, _ = read_token_file(tmp_path / "s.json")
    texts = sorted(tokenizer.decode(d) for d in _docs(np.asarray(train.tokens), tokenizer.eos_token_id))
    assert texts == sorted(NUMBERED[4:])


# ------------------------------------------------------------------------------------------------ errors
def test_unknown_data_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="embedded, local, fineweb_edu, tokens"):
        build_token_data(DataConfig(name="wikitext"), SEQ)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        build_token_data(DataConfig(name="local", paths=[str(tmp_path / "nope.jsonl")]), SEQ)
    with pytest.raises(FileNotFoundError, match="tokenize_corpus"):
        build_token_data(DataConfig(name="tokens", tokenizer="from_file", paths=[str(tmp_path / "t.bin")]), SEQ)
    with pytest.raises(ValueError, match="data.paths is empty"):
        build_token_data(DataConfig(name="local"), SEQ)


def test_empty_corpus_is_an_error(tmp_path):
    _write_jsonl(tmp_path / "e.jsonl", ["", "   "])
    with pytest.raises(ValueError, match="no non-empty documents"):
        build_token_data(DataConfig(name="local", paths=[str(tmp_path / "e.jsonl")]), SEQ)


def test_wrong_text_field_is_named(tmp_path):
    _write_jsonl(tmp_path / "c.jsonl", NUMBERED[:5])
    with pytest.raises(ValueError, match="text_field='body'"):
        build_token_data(DataConfig(name="local", paths=[str(tmp_path / "c.jsonl")], text_field="body"), SEQ)


def test_seq_len_larger_than_the_corpus_is_an_error(tmp_path):
    _write_jsonl(tmp_path / "c.jsonl", NUMBERED[:10])
    cfg = DataConfig(name="local", paths=[str(tmp_path / "c.jsonl")], val_documents=2)
    with pytest.raises(ValueError, match="fewer than seq_len=4096"):
        build_token_data(cfg, 4096)
    data = build_token_data(cfg, 16)
    with pytest.raises(ValueError, match="fewer than one sequence of seq_len=4096"):
        TrainLoader(data.train, 1, 4096, seed=0)


def test_a_corpus_smaller_than_one_step_is_repeated_with_a_warning(caplog):
    source = TokenArray(np.arange(16 * 5, dtype=np.uint16), 1)  # 4-5 blocks of 16, a step wants 12
    with caplog.at_level("WARNING"):
        loader = TrainLoader(source, micro_batch=12, seq_len=16, seed=0)
    assert "fewer than one optimizer step" in caplog.text
    starts = loader.next_batch()[:, 0].tolist()
    assert len(starts) == 12 and len(set(starts)) <= 5
    assert max(starts.count(s) for s in set(starts)) <= 3  # each block read once per pass


def test_fineweb_fails_fast_when_offline(offline):
    with pytest.raises(ConnectionError, match="data=local.*data=tokens"):
        build_token_data(DataConfig(name="fineweb_edu", tokenizer="HuggingFaceTB/SmolLM2-360M"), SEQ)
    assert offline == []  # fails without trying the network (no retries, no timeouts to wait out)


def test_step_data_does_not_depend_on_the_rank_split():
    """One rank with 2 micro-batches per step and 2 ranks with 1 each read the same sequences per step,
    across epoch boundaries too."""
    source = TokenArray(np.arange(64 * 53, dtype=np.uint16), 1)  # 52-53 blocks of 64: not a multiple of a step
    single = TrainLoader(source, micro_batch=4, seq_len=64, seed=3, step_sequences=8)
    ranks = [
        TrainLoader(source, micro_batch=4, seq_len=64, seed=3, rank=r, world_size=2, step_sequences=8) for r in range(2)
    ]
    for _ in range(20):  # ~3 epochs of 6 steps
        one = torch.cat([single.next_batch(), single.next_batch()])
        two = torch.cat([loader.next_batch() for loader in ranks])
        assert sorted(one[:, 0].tolist()) == sorted(two[:, 0].tolist())
