"""Training data: documents -> tokens (each document followed by eos) -> seq_len blocks -> batches.

Sources (``DataConfig.name``):
- ``embedded``: the English corpus shipped in ``sparse_llm/data/assets`` (no download, no ``datasets``).
- ``local``: txt / json / jsonl / parquet files read with ``datasets`` (txt: one document per paragraph by
  default). With ``streaming: true`` the files are read through the same streaming packer as fineweb_edu.
- ``fineweb_edu``: streamed from the Hugging Face hub with ``datasets`` (needs network).
- ``tokens``: a pre-tokenized ``<prefix>.bin`` + ``<prefix>.json`` pair written by ``scripts/tokenize_corpus.py``,
  read with ``np.memmap`` (no ``datasets``, the path for machines without it and for speed).

``datasets`` is imported lazily, only for ``local`` and ``fineweb_edu``.

Packing: the documents' tokens, each followed by eos, form one stream; blocks are consecutive windows of
``seq_len`` tokens of that stream, so a block can hold the end of one document and the start of the next
with eos between them. Labels are the inputs (the model shifts them).

Validation split: whole documents are held out. For ``embedded`` and ``local`` a seeded random subset
(``val_fraction`` or ``val_documents`` of them, chosen with ``split_seed``); for streamed data the first
``val_documents`` documents of the stream, which training then skips; for ``tokens`` the split stored in the
file. Training and validation never share a document.

Batching, sharding over ranks and resumable positions: sparse_llm/data/loader.py.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch

from sparse_llm.checks import files as file_checks
from sparse_llm.checks.errors import UserInputError
from sparse_llm.data.config import DataConfig
from sparse_llm.data.progress import ProgressLog
from sparse_llm.data.tokenizer import load_tokenizer

DATA_NAMES = ("embedded", "local", "fineweb_edu", "tokens")
EMBEDDED_CORPUS = Path(__file__).resolve().parent / "assets" / "embedded_corpus.txt.gz"
EMBEDDED_SEPARATOR = "\n\n<|endoftext|>\n\n"  # must match scripts/build_embedded_assets.py
TOKENIZER_FROM_FILE = "from_file"
LOCAL_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TOKEN_FILE_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")
TOKEN_META_KEYS = (
    "version",
    "dtype",
    "vocab_size",
    "tokenizer",
    "n_tokens",
    "n_train_documents",
    "n_val_documents",
    "val_start",
)
CORPUS_FIX = "Fix or replace the file, or leave it out of data.paths."
TOKEN_FILE_FIX = "Write the token file again with scripts/tokenize_corpus.py."
ENCODE_BATCH = 256  # documents per tokenizer call: large enough for the fast tokenizer's batching


# ----------------------------------------------------------------------------------------------------
# Token sources


@dataclass
class TokenArray:
    """Documents packed end to end, each followed by eos.

    Attributes:
        tokens: ``[n_tokens]`` unsigned integer ids (an in-memory array or an ``np.memmap``).
        n_documents: how many documents (and so eos tokens) it holds.
    """

    tokens: np.ndarray
    n_documents: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def blocks(self, starts: Iterable[int], seq_len: int) -> torch.Tensor:
        """Gather windows: returns ``[len(starts), seq_len]`` int64."""
        rows = [np.asarray(self.tokens[s : s + seq_len], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


DocumentOpener = Callable[[int, int, int, int, int], Iterator[str]]


@dataclass
class DocumentStream:
    """Training documents read one by one from a stream, tokenized as they arrive.

    Attributes:
        open: ``open(seed, epoch, rank, world_size, skip)`` -> iterator over this rank's documents of that
            epoch (shuffled by ``seed`` and ``epoch``), starting after its first ``skip`` documents.
            Equal arguments must give equal documents; this is what makes resuming exact.
        encode: texts -> one token array per text, eos appended.
    """

    open: DocumentOpener
    encode: Callable[[list[str]], list[np.ndarray]]


TokenSource = TokenArray | DocumentStream


@dataclass
class TokenData:
    """What ``build_token_data`` returns: the tokenizer and the two token sources."""

    tokenizer: Any
    vocab_size: int
    train: TokenSource
    val: TokenArray


# ----------------------------------------------------------------------------------------------------
# Documents and tokenization


def _read_embedded_documents() -> list[str]:
    with gzip.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as fh:
        return fh.read().split(EMBEDDED_SEPARATOR)


def _import_datasets(cfg: DataConfig) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"data={cfg.name} needs the `datasets` package (pip install 'sparse-llm[data]'). On a machine "
            "without it, tokenize on another machine with scripts/tokenize_corpus.py and use data=tokens."
        ) from None
    return datasets


def _local_files(cfg: DataConfig) -> tuple[str, list[str]]:
    """Expand ``cfg.paths`` into (datasets builder name, sorted file list); every file must exist."""
    if not cfg.paths:
        raise ValueError("data.paths is empty: data=local needs files, e.g. data.paths=[corpus.jsonl]")
    files: list[Path] = []
    for pattern in cfg.paths:
        path = Path(pattern).expanduser()
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and _file_format(p)))
        elif any(ch in pattern for ch in "*?["):
            files.extend(sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"data.paths: {pattern!r} does not exist")
    if not files:
        raise FileNotFoundError(f"data.paths={list(cfg.paths)} matched no txt/json/jsonl/parquet files")
    formats = {_file_format(p) for p in files}
    if None in formats or len(formats) != 1:
        raise ValueError(
            f"data.paths must all be one of {sorted(set(LOCAL_FORMATS))} (optionally .gz), in one format; "
            f"got {sorted(p.name for p in files)}"
        )
    return formats.pop(), [str(p) for p in files]


def _file_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return LOCAL_FORMATS.get(suffixes[-1]) if suffixes else None


def _check_corpus_file(path: Path, builder: str) -> None:
    """The checks that read no more than a file's ends: empty, binary, or a parquet file cut short."""
    if builder == "parquet":
        file_checks.check_parquet(path, CORPUS_FIX)
    else:
        file_checks.sniff_text(path, CORPUS_FIX)


def _corpus_damage(cfg: DataConfig, builder: str, files: list[str], error: Exception) -> UserInputError:
    """Why `datasets` could not read the files (its errors name neither the file nor the line): the first damaged
    file, found by reading each in full, or, where none is, the reader's own error."""
    for name in files:
        path = Path(name)
        if builder == "text":
            damage = file_checks.find_text_damage(path, CORPUS_FIX)
        elif builder == "json":
            damage = file_checks.find_json_rows_damage(path, cfg.text_field, CORPUS_FIX)
        else:
            damage = None  # parquet: check_parquet read its footer; damage inside a row group is the reader's error
        if damage is not None:
            return damage
    cause = error.__cause__ or error.__context__ or error
    return UserInputError(
        ", ".join(files), f"the {builder} reader of `datasets` failed ({type(cause).__name__}: {cause})", CORPUS_FIX
    )


def _load_local_dataset(cfg: DataConfig, streaming: bool) -> Any:
    datasets = _import_datasets(cfg)
    builder, files = _local_files(cfg)
    for name in files:
        _check_corpus_file(Path(name), builder)
    kwargs = {"sample_by": cfg.txt_sample_by} if builder == "text" else {}
    try:
        dataset = datasets.load_dataset(
            builder, data_files={"train": files}, split="train", streaming=streaming, **kwargs
        )
    except Exception as error:  # datasets wraps a bad file in DatasetGenerationError, naming neither file nor line
        raise _corpus_damage(cfg, builder, files, error) from error
    columns = dataset.column_names
    if columns is not None and cfg.text_field not in columns:
        raise ValueError(f"data.text_field={cfg.text_field!r} is not a column of {files}; columns: {columns}")
    feature = dataset.features[cfg.text_field] if dataset.features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        not_text = TypeError(f"column {cfg.text_field!r} holds {feature}, not text")
        raise _corpus_damage(cfg, builder, files, not_text)
    return dataset


def _is_document(text: str | None) -> bool:
    """Empty texts are dropped: an empty document would be a lone eos."""
    return bool(text and text.strip())


def _has_text(text_field: str) -> Callable[[dict[str, Any]], bool]:
    """Row filter for streams: keeps rows whose ``text_field`` is a document."""

    def keep(row: dict[str, Any]) -> bool:
        if text_field not in row:
            raise ValueError(f"data.text_field={text_field!r} is not in the rows; fields: {sorted(row)}")
        return _is_document(row[text_field])

    return keep


def _documents(cfg: DataConfig) -> list[str]:
    """All documents of an ``embedded`` or non-streamed ``local`` corpus, in file order."""
    if cfg.name == "embedded":
        documents = _read_embedded_documents()
    else:
        dataset = _load_local_dataset(cfg, streaming=False)
        documents = [t for t in dataset[cfg.text_field] if _is_document(t)]
    if cfg.max_documents is not None:
        documents = documents[: cfg.max_documents]
    if not documents:
        raise ValueError(f"data={cfg.name}: the corpus has no non-empty documents (paths={list(cfg.paths)})")
    return documents


def _validation_indices(cfg: DataConfig, n_documents: int) -> np.ndarray:
    """Sorted indices of the held-out documents: a ``split_seed``-seeded random subset."""
    n_val = cfg.val_documents if cfg.val_documents is not None else max(1, round(cfg.val_fraction * n_documents))
    if not 1 <= n_val < n_documents:
        raise ValueError(
            f"the validation split needs 1 <= held-out documents < {n_documents} (all documents), got {n_val} "
            f"(data.val_fraction={cfg.val_fraction}, data.val_documents={cfg.val_documents}); "
            "add documents or change the split"
        )
    return np.sort(np.random.default_rng(cfg.split_seed).permutation(n_documents)[:n_val])


def _split_documents(cfg: DataConfig, documents: list[str]) -> tuple[list[str], list[str]]:
    val = set(_validation_indices(cfg, len(documents)).tolist())
    train = [d for i, d in enumerate(documents) if i not in val]
    return train, [documents[i] for i in sorted(val)]


def _encoder(tokenizer: Any) -> Callable[[list[str]], list[np.ndarray]]:
    eos = tokenizer.eos_token_id
    dtype = _token_dtype(len(tokenizer))

    def encode(texts: list[str]) -> list[np.ndarray]:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(doc + [eos], dtype=dtype) for doc in ids]

    return encode


def _encode_all(encode: Callable[[list[str]], list[np.ndarray]], texts: Iterable[str]) -> Iterator[np.ndarray]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield from encode(batch)
            batch = []
    if batch:
        yield from encode(batch)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _pack(chunks: Iterable[np.ndarray], dtype: np.dtype) -> TokenArray:
    parts = list(chunks)
    tokens = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return TokenArray(tokens, len(parts))


# ----------------------------------------------------------------------------------------------------
# Token files: <prefix>.bin (raw ids, train documents then validation documents) + <prefix>.json (meta)


def _token_file_paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path).expanduser()
    prefix = path.with_suffix("") if path.suffix in {".bin", ".json"} else path
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def _private_temp_path(path: Path) -> Path:
    """A temporary name next to ``path`` that no other writer uses (host, process and thread in the name).

    Under DDP every rank may find the cache missing and write it at once; with a shared temporary name one
    rank would truncate the file another is writing or renaming.
    """
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_token_file(
    prefix: str | Path,
    train: Iterable[np.ndarray],
    val: Iterable[np.ndarray],
    tokenizer_name: str,
    vocab_size: int,
    extra: dict[str, Any],
    progress: ProgressLog | None = None,
) -> dict[str, Any]:
    """Stream documents' tokens to disk; validation documents go after all training documents. `progress` is
    updated after each document.

    Both files are written under private temporary names and renamed into place (``os.replace`` is atomic),
    the meta last: a present meta means a complete ``.bin``. Concurrent writers of the same prefix (ranks
    filling one cache) each rename a complete, identical file, so a reader never sees a partial one.
    """
    bin_path, meta_path = _token_file_paths(prefix)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(vocab_size)
    counts = {"train": [0, 0], "val": [0, 0]}  # [documents, tokens]
    tmp_bin, tmp_meta = _private_temp_path(bin_path), _private_temp_path(meta_path)
    try:
        with open(tmp_bin, "wb") as fh:
            for split, chunks in (("train", train), ("val", val)):
                for chunk in chunks:
                    fh.write(np.asarray(chunk, dtype=dtype).tobytes())
                    counts[split][0] += 1
                    counts[split][1] += len(chunk)
                    if progress is not None:
                        progress.update(counts["train"][0] + counts["val"][0], counts["train"][1] + counts["val"][1])
        meta = {
            "version": TOKEN_FILE_VERSION,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "tokenizer": tokenizer_name,
            "n_tokens": counts["train"][1] + counts["val"][1],
            "n_documents": counts["train"][0] + counts["val"][0],
            "n_train_documents": counts["train"][0],
            "n_val_documents": counts["val"][0],
            "val_start": counts["train"][1],  # token index where the validation documents begin
            **extra,
        }
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_meta, meta_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
    return meta


def _token_file_meta(meta_path: Path) -> dict[str, Any]:
    """The meta of a token file, checked: its keys, a token dtype, counts that fit each other."""
    meta = file_checks.read_json_object(meta_path, TOKEN_FILE_FIX, keys=TOKEN_META_KEYS)
    if meta["version"] != TOKEN_FILE_VERSION:
        raise UserInputError(
            meta_path,
            f"is a version {meta['version']!r} token file; this code reads version {TOKEN_FILE_VERSION}",
            TOKEN_FILE_FIX,
        )
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserInputError(
            meta_path,
            f"gives dtype {meta['dtype']!r}; token ids are stored as one of {', '.join(TOKEN_DTYPES)}",
            TOKEN_FILE_FIX,
        )
    counts = ("vocab_size", "n_tokens", "n_train_documents", "n_val_documents", "val_start")
    bad = [key for key in counts if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0]
    if bad:
        raise UserInputError(meta_path, f"holds {bad} that are not counts (integers >= 0)", TOKEN_FILE_FIX)
    if meta["val_start"] > meta["n_tokens"]:
        raise UserInputError(
            meta_path,
            f"says validation starts at token {meta['val_start']}, past its {meta['n_tokens']} tokens",
            TOKEN_FILE_FIX,
        )
    if meta["vocab_size"] > np.iinfo(np.dtype(meta["dtype"])).max + 1:
        raise UserInputError(
            meta_path, f"gives vocab_size {meta['vocab_size']}, more ids than {meta['dtype']} holds", TOKEN_FILE_FIX
        )
    return meta


def read_token_file(path: str | Path) -> tuple[dict[str, Any], TokenArray, TokenArray]:
    """Memory-map a token file: returns (meta, train, val)."""
    bin_path, meta_path = _token_file_paths(path)
    for p in (bin_path, meta_path):
        if not p.is_file():
            raise FileNotFoundError(
                f"data.paths: token file {p} does not exist; write it with scripts/tokenize_corpus.py"
            )
    meta = _token_file_meta(meta_path)
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = bin_path.stat().st_size
    if size != meta["n_tokens"] * itemsize:
        raise UserInputError(
            bin_path,
            f"holds {size} bytes, but {meta_path.name} says {meta['n_tokens']} "
            f"{meta['dtype']} tokens ({meta['n_tokens'] * itemsize} bytes): the two do "
            "not belong together, or the .bin was cut short",
            TOKEN_FILE_FIX,
        )
    if meta["n_tokens"] == 0:
        raise UserInputError(bin_path, "holds no tokens", TOKEN_FILE_FIX)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")
    split = meta["val_start"]
    return (
        meta,
        TokenArray(tokens[:split], meta["n_train_documents"]),
        TokenArray(tokens[split:], meta["n_val_documents"]),
    )


def write_token_file(cfg: DataConfig, out: str | Path) -> dict[str, Any]:
    """Tokenize the documents of ``cfg`` (any source but ``tokens``) into ``<out>.bin`` + ``<out>.json``.

    The stored split is the one ``cfg`` defines, so ``data=tokens`` trains and validates on the same
    documents as the source data would. Returns the meta dict.
    """
    _check_name(cfg)
    if cfg.name == "tokens":
        raise ValueError("data.name=tokens is already a token file; pick the source data to tokenize")
    tokenizer = load_tokenizer(cfg.tokenizer)
    encode = _encoder(tokenizer)
    extra = {"source": cfg.name, "paths": list(cfg.paths), "split_seed": cfg.split_seed}
    train_texts: Iterable[str]
    if _is_streamed(cfg):
        if cfg.name == "fineweb_edu" and cfg.max_documents is None:
            raise ValueError("data.max_documents must be set to tokenize fineweb_edu (it has ~10M documents)")
        opener, val_texts = _open_document_stream(cfg)
        train_texts = opener(cfg.split_seed, 0, 0, 1, 0)  # one pass, shuffled by split_seed
    else:
        train_texts, val_texts = _split_documents(cfg, _documents(cfg))
    return _write_token_file(
        out,
        _encode_all(encode, train_texts),
        _encode_all(encode, val_texts),
        cfg.tokenizer,
        len(tokenizer),
        extra,
        ProgressLog(f"tokenizing data={cfg.name} into {out}"),
    )


# ----------------------------------------------------------------------------------------------------
# Streaming (fineweb_edu, local with streaming: true)


def _is_streamed(cfg: DataConfig) -> bool:
    return cfg.name == "fineweb_edu" or (cfg.name == "local" and cfg.streaming)


def _check_hub_reachable(cfg: DataConfig) -> None:
    """Fail in seconds, not minutes, when the hub cannot be reached."""
    from huggingface_hub import constants

    advice = (
        "Use data=local (files on disk) or data=tokens (a token file from scripts/tokenize_corpus.py), "
        "or run where the hub is reachable."
    )
    if constants.HF_HUB_OFFLINE or _import_datasets(cfg).config.HF_HUB_OFFLINE:
        raise ConnectionError(
            "data=fineweb_edu streams from the hub, but offline mode is on (HF_HUB_OFFLINE or "
            "HF_DATASETS_OFFLINE is 1: set in the environment, or by train.py/eval.py when the data was not "
            "chosen as `data=fineweb_edu` on the command line). With network, pass `data=fineweb_edu` on the "
            f"command line or set HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0. {advice}"
        )
    url = urlparse(constants.ENDPOINT)
    address = (url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80))
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=cfg.hub_timeout_s).close()
        except OSError as error:
            errors.append(error)

    # getaddrinfo ignores socket timeouts, so the whole check runs in a thread we stop waiting for.
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(cfg.hub_timeout_s)
    if thread.is_alive() or errors:
        reason = errors[0] if errors else f"no answer within {cfg.hub_timeout_s} s"
        raise ConnectionError(f"data=fineweb_edu: cannot reach {address[0]}:{address[1]} ({reason}). {advice}")


def _streamed_dataset(cfg: DataConfig) -> Any:
    if cfg.name == "local":
        return _load_local_dataset(cfg, streaming=True)
    _check_hub_reachable(cfg)
    datasets = _import_datasets(cfg)
    return datasets.load_dataset(cfg.hub_path, name=cfg.hub_name, split=cfg.hub_split, streaming=True)


def _open_document_stream(cfg: DataConfig) -> tuple[DocumentOpener, list[str]]:
    """Returns (opener of the training stream, the held-out documents: the stream's first ones)."""
    from datasets.distributed import split_dataset_by_node

    n_val = cfg.val_documents if cfg.val_documents is not None else 1000
    if n_val < 1:
        raise ValueError(f"data.val_documents must be >= 1 for streamed data, got {n_val}")
    dataset = _streamed_dataset(cfg).filter(_has_text(cfg.text_field))
    try:
        val_texts = [row[cfg.text_field] for row in dataset.take(n_val)]
    except Exception as error:  # streamed files are read lazily: the first rows are where a bad file shows
        if cfg.name != "local":
            raise
        builder, files = _local_files(cfg)
        raise _corpus_damage(cfg, builder, files, error) from error
    if len(val_texts) < n_val:
        raise ValueError(
            f"data={cfg.name}: the stream has only {len(val_texts)} non-empty documents, all needed for the "
            f"{n_val} validation documents; add documents or lower data.val_documents"
        )
    train_rows = dataset.skip(n_val)
    if cfg.max_documents is not None:
        train_rows = train_rows.take(cfg.max_documents)

    def open_stream(seed: int, epoch: int, rank: int, world_size: int, skip: int) -> Iterator[str]:
        rows = train_rows
        if cfg.shuffle_buffer > 0:
            rows = rows.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer)
            rows.set_epoch(epoch)
        if world_size > 1:
            rows = split_dataset_by_node(rows, rank=rank, world_size=world_size)
        return documents(rows.skip(skip))

    def documents(rows: Any) -> Iterator[str]:
        try:
            for row in rows:
                yield row[cfg.text_field]
        except Exception as error:  # a damaged local file shows where the stream reaches it, which may be mid-run
            if cfg.name != "local":
                raise
            builder, files = _local_files(cfg)
            raise _corpus_damage(cfg, builder, files, error) from error

    return open_stream, val_texts


# ----------------------------------------------------------------------------------------------------
# Building


def _check_name(cfg: DataConfig) -> None:
    if cfg.name not in DATA_NAMES:
        raise ValueError(f"data={cfg.name!r} is not a data source; valid: {', '.join(DATA_NAMES)}")


def _cache_key(cfg: DataConfig) -> str:
    files = [EMBEDDED_CORPUS] if cfg.name == "embedded" else [Path(p) for p in _local_files(cfg)[1]]
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    fields = {k: v for k, v in asdict(cfg).items() if k not in {"cache_dir", "hub_timeout_s", "shuffle_buffer"}}
    blob = json.dumps({"files": stats, "cfg": fields, "version": TOKEN_FILE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _tokens_tokenizer(cfg: DataConfig, meta: dict[str, Any]) -> str:
    if cfg.tokenizer not in (TOKENIZER_FROM_FILE, meta["tokenizer"]):
        raise ValueError(
            f"data.tokenizer={cfg.tokenizer!r} but the token file was made with {meta['tokenizer']!r}; set "
            f"data.tokenizer={meta['tokenizer']} or data.tokenizer={TOKENIZER_FROM_FILE}"
        )
    return meta["tokenizer"]


def build_token_data(cfg: DataConfig, seq_len: int) -> TokenData:
    """Tokenize (or memory-map) the data of ``cfg`` and split it into training and validation sources.

    Raises:
        ValueError: unknown ``cfg.name``, empty corpus, or a split too small for one ``seq_len`` block.
        FileNotFoundError: missing files. ConnectionError: fineweb_edu with the hub unreachable.
    """
    _check_name(cfg)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    train: TokenSource
    if cfg.name == "tokens":
        if len(cfg.paths) != 1:
            raise ValueError(f"data=tokens needs exactly one path in data.paths (the token file), got {cfg.paths}")
        meta, train, val = read_token_file(cfg.paths[0])
        tokenizer = load_tokenizer(_tokens_tokenizer(cfg, meta))
    elif _is_streamed(cfg):
        opener, val_texts = _open_document_stream(cfg)  # first: an unreachable hub fails before anything else
        tokenizer = load_tokenizer(cfg.tokenizer)
        encode = _encoder(tokenizer)
        train = DocumentStream(opener, encode)
        val = _pack(_encode_all(encode, val_texts), _token_dtype(len(tokenizer)))
    elif cfg.cache_dir is not None:
        prefix = Path(cfg.cache_dir).expanduser() / f"{cfg.name}-{_cache_key(cfg)}"
        if not _token_file_paths(prefix)[1].is_file():  # the meta is renamed in last: present means complete
            write_token_file(cfg, prefix)
        _, train, val = read_token_file(prefix)
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
        encode = _encoder(tokenizer)
        train_docs, val_docs = _split_documents(cfg, _documents(cfg))
        dtype = _token_dtype(len(tokenizer))
        train, val = _pack(_encode_all(encode, train_docs), dtype), _pack(_encode_all(encode, val_docs), dtype)
    for split, source in (("training", train), ("validation", val)):
        if isinstance(source, TokenArray) and len(source) < seq_len:
            raise ValueError(
                f"the {split} split has {len(source)} tokens, fewer than seq_len={seq_len}: lower seq_len, "
                "add data, or change data.val_fraction / data.val_documents"
            )
    return TokenData(tokenizer=tokenizer, vocab_size=len(tokenizer), train=train, val=val)


def held_out_documents(cfg: DataConfig) -> list[str]:
    """The validation documents as text, in a fixed order (for perplexity and held-out eval tasks)."""
    _check_name(cfg)
    if cfg.name == "tokens":
        if len(cfg.paths) != 1:
            raise ValueError(f"data=tokens needs exactly one path in data.paths (the token file), got {cfg.paths}")
        meta, _, val = read_token_file(cfg.paths[0])
        tokenizer = load_tokenizer(_tokens_tokenizer(cfg, meta))
        tokens = np.asarray(val.tokens, dtype=np.int64)
        ends = np.flatnonzero(tokens == tokenizer.eos_token_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        return [tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=False)]
    if _is_streamed(cfg):
        return _open_document_stream(cfg)[1]
    return _split_documents(cfg, _documents(cfg))[1]
