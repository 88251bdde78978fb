"""The lm-eval tasks eval.py runs, and where their data comes from.

Three kinds of task:
- ``heldout_continuation``: a multiple-choice benchmark built from held-out text (by default the
  validation documents of the embedded corpus, so it needs no download). Each example is a passage and
  ``choices`` candidate continuations: the true one and continuations of passages from other documents.
  Scored by lm-eval like HellaSwag (log-likelihood of each continuation; acc and length-normalised acc_norm).
- A built-in lm-eval task read from local files: ``task_data.<task>=<file>`` points the task at a json,
  jsonl or parquet file holding the split it evaluates, in the schema of its Hugging Face dataset.
- A built-in lm-eval task read from the Hugging Face hub (or its local cache).

Task names accept two aliases: ``paper`` (the seven zero-shot tasks of the paper's Table 6) and
``embedded`` (``heldout_continuation``).

lm-eval is imported lazily: it is an optional extra (``pip install 'sparse-llm[eval]'``).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from sparse_llm.checks import files as file_checks
from sparse_llm.evaluation.config import HeldOutTaskConfig

PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "winogrande", "commonsense_qa")
HELDOUT_TASK = "heldout_continuation"
NO_TASKS = "none"  # tasks=none: held-out perplexity and sparsity only, which need no lm-eval
TASK_ALIASES = {"paper": PAPER_TASKS, "embedded": (HELDOUT_TASK,)}
LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Dataset builders that read files named in the config (data_files), not a hub repository.
FILE_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
HELDOUT_VERSION = 1.1  # 1.1: passages shortened to fit the model's context
# The folder of lm_eval/tasks/ that defines each task of PAPER_TASKS. lm-eval's full index reads all ~14,000 task YAMLs
# (~14 s); these folders alone take a fraction of a second and give the same entries, since each of these tasks is
# defined once, in its folder, without reference to other entries (tests/test_eval.py checks that no other folder
# declares one).
BUILTIN_TASK_DIRS = {
    "arc_easy": "arc",
    "arc_challenge": "arc",
    "hellaswag": "hellaswag",
    "openbookqa": "openbookqa",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "commonsense_qa": "commonsense_qa",
}

log = logging.getLogger(__name__)


class TaskDataError(RuntimeError):
    """A task's data cannot be read (offline and not cached, missing file, unreachable hub)."""


def import_lm_eval() -> Any:
    """The lm_eval module, or an ImportError saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise ImportError(
            "eval.py needs lm-eval for its benchmarks: pip install 'sparse-llm[eval]' (lm-eval>=0.4.13)."
        ) from None
    return lm_eval


# ----------------------------------------------------------------------------------------------------
# Task names


def expand_task_names(tasks: str | Sequence[str]) -> list[str]:
    """``"paper"``, ``"a,b"`` or ``["paper", "piqa"]`` -> task names in order, aliases expanded, once each.

    ``"none"`` -> [] (no benchmark task).
    """
    if tasks == NO_TASKS:
        return []
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"tasks: {item!r} is not a task name; pass a name, names joined by commas, or a list")
        for part in (p.strip() for p in item.split(",")):
            for name in TASK_ALIASES.get(part, (part,)):
                if name and name not in names:
                    names.append(name)
    if not names:
        raise ValueError(
            f"tasks={tasks!r} names no task; use e.g. tasks=embedded, tasks=paper or tasks=none (perplexity and "
            "sparsity only)"
        )
    return names


def builtin_task_dirs(names: Sequence[str]) -> list[Path] | None:
    """The folders of lm-eval's built-in tasks (``lm_eval/tasks/<folder>``) that define the built-in tasks among
    ``names``: [] when there are none, None when one has no folder in ``BUILTIN_TASK_DIRS``."""
    builtin = [name for name in names if name != HELDOUT_TASK]
    if not all(name in BUILTIN_TASK_DIRS for name in builtin):
        return None
    root = Path(import_lm_eval().__file__).parent / "tasks"
    return [root / folder for folder in sorted({BUILTIN_TASK_DIRS[name] for name in builtin})]


def task_manager(names: Sequence[str]) -> Any:
    """lm-eval's TaskManager for the tasks ``names``: it indexes only their folders (``builtin_task_dirs``), or every
    built-in task when a name has no known folder or its folder does not define it."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    folders = builtin_task_dirs(names)
    if folders is not None:
        manager = TaskManager(include_path=folders, include_defaults=False)
        # Another lm-eval version may have moved a task: the full index still finds it.
        if all(name in manager.task_index for name in names if name != HELDOUT_TASK):
            return manager
    return TaskManager()


def check_known(names: Sequence[str], manager: Any) -> None:
    """Raise ValueError naming each task that is neither ours nor known to lm-eval, with close matches."""
    known = set(manager.all_tasks)
    for name in names:
        if name == HELDOUT_TASK or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"tasks: unknown task {name!r}.{hint} Valid names: any lm-eval task (list them with "
            f"`lm-eval ls tasks`), {HELDOUT_TASK}, the aliases {', '.join(TASK_ALIASES)}, or {NO_TASKS} "
            "(perplexity and sparsity only)."
        )


# ----------------------------------------------------------------------------------------------------
# The held-out continuation benchmark


def _passages(document: str, context_words: int, continuation_words: int) -> list[tuple[str, str]]:
    """Non-overlapping (context, continuation) pairs of a document, cut at word boundaries.

    Both keep the document's own spacing inside them; the gap between them becomes the single space that
    lm-eval puts between context and continuation.
    """
    words = [m.span() for m in re.finditer(r"\S+", document)]
    stride = context_words + continuation_words
    pairs = []
    for start in range(0, len(words) - stride + 1, stride):
        ctx_end = start + context_words
        context = document[words[start][0] : words[ctx_end - 1][1]]
        continuation = document[words[ctx_end][0] : words[start + stride - 1][1]]
        pairs.append((context, continuation))
    return pairs


def _fit_context(context: str, choices: Sequence[str], count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """``context`` without as few leading words as needed for ``context + " " + choice`` to fit ``max_tokens``.

    Dropping words at the start keeps the text right before the continuations, which is what the model
    needs to tell the true one from the distractors.
    """
    for start in (m.start() for m in re.finditer(r"\S+", context)):
        shortened = context[start:]
        if max(count_tokens(f"{shortened} {choice}") for choice in choices) <= max_tokens:
            return shortened
    raise ValueError(
        f"a held-out continuation does not fit heldout.max_tokens={max_tokens} tokens even after one word of "
        "passage; lower heldout.continuation_words"
    )


def build_heldout_examples(
    documents: Sequence[str], cfg: HeldOutTaskConfig, count_tokens: Callable[[str], int] | None = None
) -> list[dict[str, Any]]:
    """Deterministic multiple-choice examples from held-out documents.

    Returns rows ``{"id", "context", "choices": [str] * cfg.choices, "label": int}``; the true continuation
    is ``choices[label]``, the others are continuations of passages of other documents. With
    ``count_tokens`` (text -> number of tokens of the evaluated model's tokenizer) and ``cfg.max_tokens``
    set, passages are shortened from their start until every request fits ``cfg.max_tokens``.

    Raises:
        ValueError: bad settings, fewer than two documents with a full passage, or no passage at all.
    """
    for key in ("examples", "context_words", "continuation_words"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"heldout.{key}={getattr(cfg, key)} must be >= 1")
    if cfg.choices < 2:
        raise ValueError(f"heldout.choices={cfg.choices} must be >= 2 (the true continuation + distractors)")
    if cfg.max_tokens is not None and cfg.max_tokens < 2:
        raise ValueError(f"heldout.max_tokens={cfg.max_tokens} must be >= 2 (a passage and a continuation)")
    if (count_tokens is None) != (cfg.max_tokens is None):
        raise ValueError("build_heldout_examples: pass count_tokens together with heldout.max_tokens")
    pool = [
        (doc, ctx, cont)
        for doc, text in enumerate(documents)
        for ctx, cont in _passages(text, cfg.context_words, cfg.continuation_words)
    ]
    doc_ids = np.array([doc for doc, _, _ in pool], dtype=np.int64)
    if len(set(doc_ids.tolist())) < 2:
        raise ValueError(
            f"the held-out text has {len(set(doc_ids.tolist()))} document(s) of at least "
            f"{cfg.context_words + cfg.continuation_words} words; distractors need two. Lower "
            "heldout.context_words / heldout.continuation_words or hold out more documents."
        )
    rng = np.random.default_rng(cfg.seed)
    chosen = np.sort(rng.permutation(len(pool))[: cfg.examples])
    rows = []
    shortened = 0
    for number, i in enumerate(chosen.tolist()):
        doc, context, truth = pool[i]
        others = np.flatnonzero(doc_ids != doc)
        # Distinct texts: two passages can share a continuation (boilerplate), which would make a tie.
        candidates = list(dict.fromkeys(pool[j][2] for j in rng.permutation(others).tolist()))
        distractors = [c for c in candidates if c != truth][: cfg.choices - 1]
        if len(distractors) < cfg.choices - 1:
            raise ValueError(f"only {len(distractors)} distinct distractor continuations exist; lower heldout.choices")
        label = int(rng.integers(cfg.choices))
        choices = distractors[:label] + [truth] + distractors[label:]
        if count_tokens is not None and cfg.max_tokens is not None:
            fitted = _fit_context(context, choices, count_tokens, cfg.max_tokens)
            shortened += fitted != context
            context = fitted
        rows.append({"id": f"{HELDOUT_TASK}-{number}", "context": context, "choices": choices, "label": label})
    if shortened:
        log.info(
            "%s: %d of %d passages lost words at their start to fit %d tokens",
            HELDOUT_TASK,
            shortened,
            len(rows),
            cfg.max_tokens,
        )
    return rows


def write_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def heldout_task_config(data_file: Path) -> dict[str, Any]:
    """lm-eval task config of ``heldout_continuation`` reading the rows of ``build_heldout_examples``."""
    return {
        "task": HELDOUT_TASK,
        "dataset_path": "json",
        "dataset_name": None,
        # Absolute: lm-eval resolves data_files against the working directory.
        "dataset_kwargs": {"data_files": {"test": str(Path(data_file).resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": HELDOUT_VERSION},
    }


# ----------------------------------------------------------------------------------------------------
# Built-in tasks: local files or the hub


def builtin_task_config(name: str, manager: Any) -> dict[str, Any]:
    """The full config dict of a built-in lm-eval task (includes merged, ``!function`` entries resolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise ValueError(f"task_data.{name}: {name!r} is not a single lm-eval task defined by a YAML file")
    config = dict(load_yaml(entry.yaml_path, resolve_func=True))
    if "task" not in config or "group" in config:
        raise ValueError(f"task_data.{name}: {name!r} is a group of tasks; point each of its tasks at a file")
    return config


def evaluated_split(config: dict[str, Any]) -> str:
    """The split lm-eval scores: the test split if the task has one, else validation."""
    split = config.get("test_split") or config.get("validation_split")
    if not split:
        raise ValueError(f"task {config.get('task')!r} has neither a test nor a validation split")
    return split


def check_task_file(name: str, data_file: str) -> tuple[Path, str]:
    """The path and dataset builder (json or parquet) of task ``name``'s local file, read through: it must exist and
    hold rows (JSON objects one per line or in a list, or a readable parquet file)."""
    path = Path(data_file).expanduser()
    builder = LOCAL_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"task_data.{name}={data_file!r}: use a .json, .jsonl or .parquet file (rows in the schema of "
            "the task's Hugging Face dataset)"
        )
    if not path.is_file():
        raise TaskDataError(f"task_data.{name}={data_file!r} does not exist; pass the path of its data file")
    fix = (
        f"task_data.{name} needs the rows of the split the task scores, in its Hugging Face dataset's schema: "
        "export them again (README, Evaluation) or repair the file."
    )
    if builder == "parquet":
        file_checks.check_parquet(path, fix)
    else:
        damage = file_checks.find_json_rows_damage(path, None, fix)
        if damage is not None:
            raise damage
    return path, builder


def check_task_files(task_data: dict[str, str | None]) -> None:
    """Read every local task file through before anything slower (lm-eval's task index, a model) starts."""
    for name, data_file in task_data.items():
        if data_file:
            check_task_file(name, data_file)


def local_task_config(name: str, data_file: str, manager: Any) -> dict[str, Any]:
    """Config of built-in task ``name`` reading its evaluated split from ``data_file`` (json/jsonl/parquet).

    The file must hold rows in the schema of the task's Hugging Face dataset. Zero-shot only: the task's
    other splits (few-shot examples) are dropped.
    """
    path, builder = check_task_file(name, data_file)
    config = builtin_task_config(name, manager)
    split = evaluated_split(config)
    for key in ("tag", "training_split", "validation_split", "test_split", "fewshot_split"):
        config.pop(key, None)
    config.update(
        dataset_path=builder,
        dataset_name=None,
        dataset_kwargs={"data_files": {split: str(path.resolve())}},
        test_split=split,
    )
    return config


def _hub_cache_has(dataset: str) -> bool:
    """Whether the hub cache or the datasets cache holds anything of hub dataset ``dataset`` (org/name)."""
    from datasets import config as ds_config
    from huggingface_hub import constants

    hub_dir = Path(constants.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    datasets_dir = Path(ds_config.HF_DATASETS_CACHE) / dataset.replace("/", "___")
    return hub_dir.is_dir() or datasets_dir.is_dir()


def _hub_reachable(timeout_s: float) -> str | None:
    """None if the hub endpoint accepts a TCP connection within ``timeout_s``, else the reason."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    address = (url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80))
    errors: list[BaseException] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except OSError as error:
            errors.append(error)

    # Name resolution ignores socket timeouts, so the attempt runs in a thread we stop waiting for.
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"no answer from {address[0]} within {timeout_s} s"
    return f"{address[0]}: {errors[0]}" if errors else None


def _offline() -> bool:
    from datasets import config as ds_config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or ds_config.HF_HUB_OFFLINE)


def local_data_advice(name: str, config: dict[str, Any]) -> str:
    """How to point task ``name`` at a local file, naming the dataset, subset and split to export."""
    subset = f", {config['dataset_name']!r}" if config.get("dataset_name") else ""
    split = evaluated_split(config)
    return (
        "export it where the hub is reachable, e.g. datasets.load_dataset("
        f"{config.get('dataset_path')!r}{subset}, split={split!r}).to_json('{name}.jsonl'), copy "
        f"the file here and pass task_data.{name}=<path>."
    )


def check_hub_tasks(names: Sequence[str], manager: Any, timeout_s: float) -> None:
    """Fail in seconds when a hub-hosted task's data cannot be had, instead of hanging in lm-eval.

    Offline (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``, eval.py's default): the dataset must be in the
    local cache. Online: the hub must answer within ``timeout_s``. One error lists every task lacking data.
    """
    from lm_eval.tasks._index import Kind

    offline = _offline()
    unreachable: str | None = None
    missing: list[str] = []
    for name in names:
        entry = manager.task_index.get(name)
        if entry is None or entry.cfg is None or entry.kind is not Kind.TASK:
            continue  # groups, tags and Python-defined tasks: lm-eval reports their data errors itself
        dataset = entry.cfg.get("dataset_path")
        if not dataset or dataset in FILE_BUILDERS or Path(dataset).exists():
            continue
        if offline and _hub_cache_has(dataset):
            continue
        if not offline and unreachable is None:
            unreachable = _hub_reachable(timeout_s) or ""
        if offline or unreachable:
            missing.append(f"- {name} (dataset {dataset}): {local_data_advice(name, entry.cfg)}")
    if not missing:
        return
    if offline:
        why = (
            "they are not in the local Hugging Face cache and offline mode is on (HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE; eval.py sets them by default). With network, run with HF_HUB_OFFLINE=0 "
            "HF_DATASETS_OFFLINE=0."
        )
    else:
        why = (
            f"the Hugging Face hub cannot be reached ({unreachable}). Datasets already in the cache are "
            "read with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1."
        )
    raise TaskDataError(f"{len(missing)} task(s) cannot read their data: {why}\n" + "\n".join(missing))


def task_specs(
    names: Sequence[str], task_data: dict[str, str | None], heldout_file: Path | None, manager: Any
) -> list[str | dict[str, Any]]:
    """What to hand to ``lm_eval.simple_evaluate(tasks=...)``: a name or a config dict per task.

    ``task_data`` maps task names to local files; None values (the unset defaults of eval.yaml) are ignored.
    """
    task_data = {name: path for name, path in task_data.items() if path}
    unused = sorted(set(task_data) - set(names))
    if unused:
        raise ValueError(f"task_data names tasks that are not run: {unused}; add them to tasks, or remove them")
    specs: list[str | dict[str, Any]] = []
    for name in names:
        if name == HELDOUT_TASK:
            if heldout_file is None:
                raise ValueError(f"{HELDOUT_TASK} needs its data file; build it with build_heldout_examples")
            specs.append(heldout_task_config(heldout_file))
        elif name in task_data:
            specs.append(local_task_config(name, task_data[name], manager))
        else:
            specs.append(name)
    return specs


def hub_env_summary() -> dict[str, str | None]:
    """The offline switches in effect (recorded with the results)."""
    return {key: os.environ.get(key) for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
