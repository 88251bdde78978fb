"""Checks of the files the programs read, run where each file is opened: an empty, binary, truncated or wrongly shaped
file becomes a UserInputError that names it, says what is wrong and what to do, instead of a library's traceback that
names neither.

Cheap checks (the size, the first bytes, a format's own header or footer) run before every read. Whole-file checks
(every line of a JSON-lines corpus, every byte of a text corpus) are `find_*_damage` functions, run only to explain a
reader's failure, so a healthy multi-gigabyte corpus is not read twice.
"""

from __future__ import annotations

import codecs
import gzip
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

from sparse_llm.checks.errors import UserInputError

SNIFF_BYTES = 8192
READ_CHUNK = 8 << 20
PARQUET_MAGIC = b"PAR1"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive format


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "null")


def _open_binary(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


def check_not_empty(path: Path, fix: str) -> None:
    if path.stat().st_size == 0:
        raise UserInputError(path, "is empty (0 bytes)", fix)


def read_json(path: Path, fix: str) -> Any:
    """The JSON value in `path`; a UserInputError naming the file (and the line and column) if it holds none."""
    check_not_empty(path, fix)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise UserInputError(
            path,
            f"is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}): a binary file, not JSON",
            fix,
        ) from None
    except json.JSONDecodeError as error:
        raise UserInputError(
            path, f"is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})", fix
        ) from None


def read_json_object(path: Path, fix: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object in `path`, which must hold `keys`."""
    value = read_json(path, fix)
    if not isinstance(value, dict):
        raise UserInputError(path, f"holds {_json_kind(value)}, not a JSON object", fix)
    missing = [key for key in keys if key not in value]
    if missing:
        raise UserInputError(path, f"lacks the key(s) {missing}", fix)
    return value


def sniff_text(path: Path, fix: str) -> None:
    """`path` (optionally .gz) is non-empty and starts as UTF-8 text: no NUL byte or invalid UTF-8 in its first
    SNIFF_BYTES bytes (a binary file renamed .txt/.jsonl fails here)."""
    check_not_empty(path, fix)
    try:
        with _open_binary(path) as fh:
            head = fh.read(SNIFF_BYTES)
    except (OSError, EOFError) as error:  # gzip: not a gzip file, or cut short
        raise UserInputError(path, f"cannot be decompressed ({error})", fix) from None
    if not head:
        raise UserInputError(path, "holds no text once decompressed", fix)
    _check_text_bytes(path, head, 0, codecs.getincrementaldecoder("utf-8")(), final=False, fix=fix)


def _check_text_bytes(
    path: Path, data: bytes, offset: int, decoder: codecs.IncrementalDecoder, final: bool, fix: str
) -> None:
    zero = data.find(b"\0")
    if zero >= 0:
        raise UserInputError(path, f"holds a NUL byte at byte {offset + zero}: a binary file, not text", fix)
    try:
        decoder.decode(data, final=final)
    except UnicodeDecodeError as error:
        raise UserInputError(
            path,
            f"is not UTF-8 text (byte {offset + error.start} is "
            f"{data[error.start]:#04x}): a binary file, or text in another encoding "
            "(convert it with iconv -t utf-8)",
            fix,
        ) from None


def find_text_damage(path: Path, fix: str) -> UserInputError | None:
    """Read all of `path` (optionally .gz): the first NUL byte, invalid UTF-8 or a cut-short gzip stream, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with _open_binary(path) as fh:
            while chunk := fh.read(READ_CHUNK):
                _check_text_bytes(path, chunk, offset, decoder, final=False, fix=fix)
                offset += len(chunk)
        _check_text_bytes(path, b"", offset, decoder, final=True, fix=fix)
    except UserInputError as damage:
        return damage
    except (OSError, EOFError) as error:
        return UserInputError(path, f"cannot be decompressed past byte {offset} ({error}): it was cut short", fix)
    return None


def find_json_rows_damage(path: Path, text_field: str | None, fix: str) -> UserInputError | None:
    """Parse all of `path` (.json/.jsonl, optionally .gz) as datasets' json reader does: JSON lines, or one JSON
    document holding a list of objects. The first line that is not a JSON object (with a string `text_field`, if
    given), or None."""
    damage = find_text_damage(path, fix)
    if damage is not None:
        return damage
    with _open_binary(path) as fh:
        text = fh.read().decode("utf-8")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    rows: list[tuple[int, str]] = (
        [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
        if whole is None
        else [(1, json.dumps(row)) for row in (whole if isinstance(whole, list) else [whole])]
    )
    if not rows:
        return UserInputError(path, "holds no rows (only blank lines)", fix)
    for number, line in rows:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            cut = " (the file ends there: it was cut short)" if number == rows[-1][0] else ""
            return UserInputError(
                path, f"line {number} is not valid JSON (column {error.colno}: {error.msg}){cut}", fix
            )
        if not isinstance(row, dict):
            return UserInputError(
                path, f"line {number} holds {_json_kind(row)}, not a JSON object (one row per line)", fix
            )
        if text_field is not None and not isinstance(row.get(text_field), (str, type(None))):
            return UserInputError(
                path, f"line {number}: field {text_field!r} holds {_json_kind(row[text_field])}, not text", fix
            )
    return None


def check_parquet(path: Path, fix: str) -> None:
    """A parquet file starts and ends with its magic bytes and has a readable footer (its schema and row groups)."""
    check_not_empty(path, fix)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(size - 4, 0))
        tail = fh.read(4)
    if head != PARQUET_MAGIC:
        raise UserInputError(path, "is not a parquet file (it does not start with PAR1)", fix)
    if tail != PARQUET_MAGIC:
        raise UserInputError(path, "is a parquet file cut short (it does not end with PAR1)", fix)
    import pyarrow.parquet

    try:
        pyarrow.parquet.read_metadata(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid/OSError types for a bad footer
        raise UserInputError(path, f"has an unreadable parquet footer ({error})", fix) from None


def check_safetensors(path: Path, fix: str) -> None:
    """A safetensors file's header parses and the tensors it lists end exactly at the file's end: catches a file cut
    short (or grown) without reading the tensors."""
    check_not_empty(path, fix)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise UserInputError(path, f"holds {size} bytes, fewer than a safetensors header", fix)
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > size - 8:
            raise UserInputError(
                path,
                f"is cut short or not a safetensors file: its header claims {header_bytes} bytes, the file has {size}",
                fix,
            )
        raw = fh.read(header_bytes)
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, IndexError):
        raise UserInputError(path, "has no readable safetensors header: it is damaged or another format", fix) from None
    expected = 8 + header_bytes + max(ends, default=0)
    if size != expected:
        how = "it was cut short" if size < expected else "it is longer than its tensors"
        raise UserInputError(path, f"holds {size} bytes where its header lists {expected}: {how}", fix)


def check_torch_archive(path: Path, fix: str) -> None:
    """A torch.save file (a zip archive) has its central directory, which a file cut short lacks. Files in torch's
    old (non-zip) pickle format pass unread."""
    check_not_empty(path, fix)
    with open(path, "rb") as fh:
        if fh.read(4) != ZIP_MAGIC:
            return
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise UserInputError(path, f"is a damaged torch.save archive, probably cut short ({error})", fix) from None


def check_file_format(path: Path, fix: str) -> None:
    """The format check that fits `path`'s name, used for checkpoint files without a manifest: JSON files parse,
    safetensors files match their header, torch.save archives have their directory; other files must exist."""
    name = path.name
    if name.endswith(".json"):
        read_json(path, fix)
    elif name.endswith(".safetensors"):
        check_safetensors(path, fix)
    elif name.endswith((".bin", ".pt", ".pkl")):
        check_torch_archive(path, fix)
