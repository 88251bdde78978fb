"""Tokenizer loading: the shipped byte-level BPE, a local tokenizer, or one from the Hugging Face hub.

Every tokenizer returned has an end-of-document token (``eos_token_id``), which the data pipeline appends
after each document, and a padding token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import constants
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from sparse_llm.checks.errors import UserInputError
from sparse_llm.checks.files import read_json
from sparse_llm.model.convert import read_checkpoint

EMBEDDED = "embedded"
EMBEDDED_TOKENIZER_FILE = Path(__file__).resolve().parent / "assets" / "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
TOKENIZER_FILE = "tokenizer.json"
# Files from which transformers can build a tokenizer without tokenizer.json (converted from a slow tokenizer).
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_FIX = (
    "Point the tokenizer setting (data.tokenizer for train.py, tokenizer= for eval.py and generate.py) at "
    "a directory holding the model's tokenizer (tokenizer.save_pretrained writes it), a tokenizer.json "
    "file, or `embedded`."
)


def _from_tokenizer_file(path: Path) -> PreTrainedTokenizerFast:
    read_json(path, TOKENIZER_FIX)
    try:
        return PreTrainedTokenizerFast(
            tokenizer_file=str(path), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
        )
    except Exception as error:  # the tokenizers library raises plain Exceptions for a malformed file
        raise UserInputError(path, f"is JSON but not a tokenizer ({error})", TOKENIZER_FIX) from None


def _from_directory(path: Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved with save_pretrained; its files are checked before transformers reads them."""
    if not any((path / name).is_file() for name in (TOKENIZER_FILE, *SLOW_TOKENIZER_FILES)):
        raise UserInputError(path, f"holds no tokenizer (no {TOKENIZER_FILE})", TOKENIZER_FIX)
    for name in (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            read_json(path / name, TOKENIZER_FIX)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers and tokenizers raise many types for a malformed tokenizer
        raise UserInputError(
            path, f"holds a tokenizer that does not load ({type(error).__name__}: {error})", TOKENIZER_FIX
        ) from None


def _stock_config(name: str) -> dict[str, Any]:
    """`config=` for AutoTokenizer where `name` is a model directory whose config.json points at custom code (the
    paper's released checkpoints): the stock Llama config it reads as, so that no custom code is asked for."""
    config_file = Path(name) / "config.json"
    if not config_file.is_file() or "auto_map" not in json.loads(config_file.read_text()):
        return {}
    try:
        return {"config": read_checkpoint(name).config}
    except ValueError:
        return {}


def _from_pretrained(name: str) -> PreTrainedTokenizerBase:
    """Local directory or hub id; the local cache is tried first so that offline machines never wait. Custom code is
    never run (nor asked about)."""
    stock = _stock_config(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=False, **stock)
    except (OSError, ValueError) as cache_error:
        if Path(name).exists():
            raise ValueError(f"tokenizer={name!r}: cannot load a tokenizer from this path: {cache_error}") from None
        if constants.HF_HUB_OFFLINE:
            raise ValueError(
                f"tokenizer={name!r} is not a local directory and is not in the Hugging Face cache, and "
                "HF_HUB_OFFLINE is set. Download it on a machine with network "
                f"(`huggingface-cli download {name}`), pass a local directory, or use tokenizer=embedded."
            ) from None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except Exception as hub_error:  # network errors come in many types (OSError, HTTP, timeout)
        raise ValueError(
            f"tokenizer={name!r}: not found locally and could not be fetched from the Hugging Face hub "
            f"({type(hub_error).__name__}: {hub_error}). Pass a local directory holding tokenizer.json, "
            "or use tokenizer=embedded."
        ) from None


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer by name.

    Args:
        name: ``"embedded"`` for the byte-level BPE shipped with the package (vocab 8192, ``<|endoftext|>``
            as eos and bos, ``<pad>`` as padding); a path to a ``tokenizer.json`` file; a local directory
            saved with ``save_pretrained``; or a hub id such as ``HuggingFaceTB/SmolLM2-360M`` (vocab 49152).

    Returns:
        A fast tokenizer with ``eos_token_id`` and ``pad_token_id`` set (pad falls back to eos).

    Raises:
        UserInputError: a local tokenizer file or directory that is missing its files or holds damaged ones.
        ValueError: if the tokenizer cannot be found (offline and not cached) or has no eos token.
    """
    if name == EMBEDDED:
        tokenizer = _from_tokenizer_file(EMBEDDED_TOKENIZER_FILE)
    elif name.endswith(".json") and Path(name).is_file():
        tokenizer = _from_tokenizer_file(Path(name))
    elif Path(name).is_dir():
        tokenizer = _from_directory(Path(name))
    else:
        tokenizer = _from_pretrained(name)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer={name!r} has no eos token; documents must be separated by one. "
            "Pick a tokenizer with an eos token (e.g. tokenizer=embedded)."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out, so sharing eos is harmless
    return tokenizer
