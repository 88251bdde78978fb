"""Regenerate the corpus and tokenizer that ship with the package.

Writes, deterministically:
- ``sparse_llm/data/assets/embedded_corpus.txt.gz``: English prose from the Python standard library
  (the ``pydoc_data.topics`` help pages plus module, class and function docstrings), one document per
  help topic, module or class, documents separated by ``DOCUMENT_SEPARATOR``. The gzip header carries no
  timestamp or file name, so the bytes depend only on the text.
- ``sparse_llm/data/assets/tokenizer.json``: a byte-level BPE with ``VOCAB_SIZE`` entries trained on that text,
  with the special tokens ``<|endoftext|>`` (id 0, end/begin of document) and ``<pad>`` (id 1).

The text depends on the Python version that runs this script (docstrings change between releases);
the committed files were built with CPython 3.11. Run: ``python scripts/build_embedded_assets.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import inspect
import io
import os
import pkgutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

ASSETS = Path(__file__).resolve().parent.parent / "sparse_llm" / "data" / "assets"
DOCUMENT_SEPARATOR = "\n\n<|endoftext|>\n\n"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>"]
MIN_DOCUMENT_CHARS = 400  # shorter module/class documents are mostly one-line stubs; skip them
# Modules with side effects on import (printing, opening a browser or a GUI) or that are test suites.
SKIPPED_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "__hello__",
    "__phello__",
    "xxsubtype",
    "xxlimited",
    "xxlimited_35",
}


def _clean(doc: str | None) -> str:
    return inspect.cleandoc(doc).strip() if doc else ""


def _import_quietly(name: str) -> ModuleType | None:
    """Import a stdlib module, hiding its warnings and output; None if it is unavailable here."""
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # platform-specific modules (winreg, msvcrt, ...) and optional C extensions
            return None


def _stdlib_module_names() -> list[str]:
    """Public top-level stdlib modules plus one level of public submodules of packages, sorted."""
    names: list[str] = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIPPED_MODULES:
            continue
        module = _import_quietly(top)
        if module is None:
            continue
        names.append(top)
        for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda i: i.name):
            if not info.name.startswith("_") and info.name not in {"test", "tests"}:
                names.append(f"{top}.{info.name}")
    return names


def _section(title: str, doc: str) -> str:
    return f"{title}\n\n{doc}"


def _module_documents(name: str, seen: set[str]) -> list[str]:
    """One document for the module (its docstring and its functions'), one per public class."""
    module = _import_quietly(name)
    if module is None:
        return []

    def fresh(doc: str) -> bool:  # aliases and re-exports share docstrings; keep the first copy only
        if not doc or doc in seen:
            return False
        seen.add(doc)
        return True

    module_parts: list[str] = []
    module_doc = _clean(module.__doc__)
    if fresh(module_doc):
        module_parts.append(_section(f"Module {name}", module_doc))
    class_documents: list[str] = []
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            parts = []
            class_doc = _clean(obj.__doc__)
            if fresh(class_doc):
                parts.append(_section(f"class {name}.{attr}", class_doc))
            for method_name in sorted(vars(obj)):
                method = vars(obj)[method_name]
                if method_name.startswith("_") or not callable(method):
                    continue
                method_doc = _clean(getattr(method, "__doc__", None))
                if fresh(method_doc):
                    parts.append(_section(f"{attr}.{method_name}", method_doc))
            text = "\n\n".join(parts)
            if len(text) >= MIN_DOCUMENT_CHARS:
                class_documents.append(text)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            function_doc = _clean(obj.__doc__)
            if fresh(function_doc):
                module_parts.append(_section(f"{name}.{attr}", function_doc))
    module_text = "\n\n".join(module_parts)
    return ([module_text] if len(module_text) >= MIN_DOCUMENT_CHARS else []) + class_documents


def build_documents() -> list[str]:
    """All corpus documents in a fixed order: help topics (sorted by key), then modules (sorted)."""
    from pydoc_data.topics import topics

    documents = [_section(f"Help topic: {key}", _clean(topics[key])) for key in sorted(topics)]
    seen: set[str] = set()
    with warnings.catch_warnings():  # deprecated modules warn when their attributes are read
        warnings.simplefilter("ignore")
        for name in _stdlib_module_names():
            documents.extend(_module_documents(name, seen))
    for doc in documents:
        if DOCUMENT_SEPARATOR.strip() in doc:
            raise ValueError("a document contains the separator token; pick another separator")
    return documents


def write_corpus(documents: list[str], path: Path) -> None:
    raw = DOCUMENT_SEPARATOR.join(documents).encode("utf-8")
    with open(path, "wb") as fh:
        # mtime=0 and no file name in the header: the same text always gives the same bytes.
        with gzip.GzipFile(filename="", mode="wb", fileobj=fh, compresslevel=9, mtime=0) as gz:
            gz.write(raw)


def train_tokenizer(documents: list[str], path: Path) -> None:
    """Byte-level BPE: every byte is in the base alphabet, so any text encodes and decodes exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer reached {tokenizer.get_vocab_size()} entries, wanted {VOCAB_SIZE}")
    tokenizer.save(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSETS, help="directory for the two asset files")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    documents = build_documents()
    write_corpus(documents, args.out / "embedded_corpus.txt.gz")
    train_tokenizer(documents, args.out / "tokenizer.json")
    n_chars = sum(len(d) for d in documents)
    print(f"{len(documents)} documents, {n_chars / 1e6:.2f} M characters -> {args.out}")


if __name__ == "__main__":
    main()
