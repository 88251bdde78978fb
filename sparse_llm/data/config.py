"""The training data's options (`data.*`, configs/data/<name>.yaml), apart from the pipeline so that composing a config
imports no torch, transformers or datasets. What each source does: sparse_llm/data/pipeline.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """Where the training text comes from and how it is split. Hydra group ``data``.

    Attributes:
        name: ``embedded`` | ``local`` | ``fineweb_edu`` | ``tokens``.
        tokenizer: ``embedded`` (the shipped 8192-entry BPE), a tokenizer.json file, a local directory or a hub
            id (``HuggingFaceTB/SmolLM2-360M``, vocab 49152, as in the paper). For ``tokens``: ``from_file``
            uses the tokenizer recorded in the token file; any other value must equal it.
        paths: ``local``: files, directories or glob patterns (txt/json/jsonl/parquet, optionally .gz).
            ``tokens``: one path, the ``.bin`` / ``.json`` file or their common prefix.
        text_field: column holding the text in json/jsonl/parquet files and in hub rows.
        txt_sample_by: how txt files split into documents: ``paragraph`` (blank lines), ``line`` or
            ``document`` (one per file).
        streaming: ``local`` only: read the files with the streaming packer instead of tokenizing them
            up front (the path fineweb_edu uses).
        hub_path, hub_name, hub_split: the hub dataset streamed by ``fineweb_edu``.
        hub_timeout_s: how long to wait for the hub before failing with a clear error.
        shuffle_buffer: documents held by the streaming shuffle buffer (0 disables shuffling).
        val_fraction: share of documents held out for validation (``embedded``, ``local``).
        val_documents: number of held-out documents; overrides ``val_fraction``. Streamed data holds out its
            first ``val_documents`` documents (1000 when unset).
        split_seed: seed of the random validation subset.
        max_documents: read at most this many documents (all sources but ``tokens``; training documents
            for streams). Useful for quick runs and for ``scripts/tokenize_corpus.py`` on fineweb_edu.
        cache_dir: if set, ``embedded`` and non-streamed ``local`` data are tokenized once into a token file
            in this directory, keyed by the files, the tokenizer and the split, and memory-mapped afterwards.
            Ranks of one run may share it: each writes private temporary files and renames them into place.
    """

    name: str = "embedded"
    tokenizer: str = "embedded"
    paths: list[str] = field(default_factory=list)
    text_field: str = "text"
    txt_sample_by: str = "paragraph"
    streaming: bool = False
    hub_path: str = "HuggingFaceFW/fineweb-edu"
    hub_name: str | None = "sample-10BT"
    hub_split: str = "train"
    hub_timeout_s: float = 10.0
    shuffle_buffer: int = 10_000
    val_fraction: float = 0.05
    val_documents: int | None = None
    split_seed: int = 0
    max_documents: int | None = None
    cache_dir: str | None = None
