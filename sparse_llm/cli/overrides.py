"""Command-line overrides checked against a script's config schema before Hydra composes it.

Hydra refuses a key its schema lacks ("Key 'lrr' not in 'TrainerConfig'"); the check here also says which key was
probably meant, and lists the keys where nothing is close; a key a schema retired (its class attribute `RETIRED`, key ->
what to do instead) is named with its replacement. Only plain `a.b=value` overrides are checked: `+key=`
(add), `~key` (delete), flags, Hydra's own keys, group paths (`hydra/job_logging=...`) and keys below a mapping field
pass through to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Sequence


def unknown_key_message(overrides: Sequence[str], schema: type) -> str | None:
    """What is wrong with the first override whose key is not a field path of `schema` (a dataclass), or None."""
    for override in overrides:
        if override.startswith(("+", "~", "-")) or "=" not in override:
            continue
        key = override.split("=", 1)[0]
        if "/" in key or key == "hydra" or key.startswith("hydra."):
            continue
        message = _unknown_part(key, schema)
        if message is not None:
            return message
    return None


def exit_on_unknown_key(overrides: Sequence[str], schema: type, script: str) -> None:
    """Print `unknown_key_message` for `script` and exit with code 2 (an input error), if there is one."""
    message = unknown_key_message(overrides, schema)
    if message is not None:
        print(f"{script}: {message}", file=sys.stderr)
        sys.exit(2)


def _unknown_part(key: str, schema: type) -> str | None:
    node: type | None = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if node is None:  # below a mapping or a plain value: Hydra checks the rest
            return None
        hints = typing.get_type_hints(node)
        names = [f.name for f in dataclasses.fields(node)]
        retired = getattr(node, "RETIRED", {})
        if part not in names and part in retired:
            return f"config key '{key}' was removed: {retired[part]}"
        if part not in names:
            prefix = ".".join(parts[:depth] + [""])
            close = difflib.get_close_matches(part, names, n=3)
            hint = (
                "Did you mean " + " or ".join(f"'{prefix}{name}'" for name in close) + "?"
                if close
                else f"Its keys: {', '.join(sorted(names))}."
            )
            return f"unknown config key '{key}': {node.__name__} has no '{part}'. {hint}"
        node = _dataclass_of(hints[part])
    return None


def _dataclass_of(annotation: object) -> type | None:
    """The dataclass a field holds (also through `X | None`), or None for any other type."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(filter(None, map(_dataclass_of, typing.get_args(annotation))), None)
    return None
