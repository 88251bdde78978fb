"""Evaluate checkpoints: held-out perplexity, FFN sparsity, and multiple-choice benchmarks through lm-eval.

``evaluate(cfg, out_dir)`` is what eval.py runs. For each checkpoint (``checkpoint`` and, if set,
``compare``) it:
1. loads the HF-layout model with its FFNs as ``SparseMLP`` s on the chosen backend (``kernel``);
2. measures cross-entropy / perplexity on held-out text (``data``: the validation documents of the data the
   checkpoint's run trained on, read from the run's ``.hydra/config.yaml``; the embedded corpus when there is
   no such file) and, on the same tokens, each layer's L0 (non-zeros of h per token),
   sparsity (1 - L0/N), the fraction of neurons that never fired, and the backend that ran;
3. runs the lm-eval tasks (``tasks``) with an lm-eval ``HFLM`` wrapped around that same model object, so
   the scores are those of the backend under test.
The results go to the console (one column per checkpoint), to ``<out>/results.json`` (written once, at the
end, atomically: a failed run leaves no results file) and to W&B (offline by default).

Mean accuracy: the mean over the leaf tasks run of ``acc``, and of ``acc_norm`` where a task reports it
(``acc`` otherwise: winogrande and commonsense_qa have no acc_norm). With ``tasks=paper`` that is the
paper's seven-task mean.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sparse_llm.checks.errors import UserInputError
from sparse_llm.checks.files import read_json_object
from sparse_llm.data.config import DataConfig
from sparse_llm.data.pipeline import held_out_documents
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.evaluation import tasks as mc_tasks
from sparse_llm.evaluation.config import EvalConfig, HeldOutTaskConfig
from sparse_llm.evaluation.report import RESULTS_FILE, format_table, log_telemetry, write_results
from sparse_llm.evaluation.tasks import TaskDataError
from sparse_llm.ffn import kernel_set
from sparse_llm.ffn.kernel_choice import validate_kernel
from sparse_llm.ffn.mlp import recording_statistics
from sparse_llm.ffn.registry import get_backend
from sparse_llm.model.convert import read_checkpoint
from sparse_llm.model.llama import load_pretrained, sparse_mlps
from sparse_llm.training import manifest

log = logging.getLogger(__name__)

OUTPUTS_DIR = Path("outputs")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def newest_final(root: Path = OUTPUTS_DIR) -> Path:
    """The most recently written ``<root>/*/final`` model directory."""
    finals = [p.parent for p in root.glob("*/final/config.json")]
    if not finals:
        raise FileNotFoundError(
            f"checkpoint is unset and no trained model was found under {root}/*/final. Train one first "
            "(python train.py) or pass checkpoint=<model directory>."
        )
    return max(finals, key=lambda p: (p / "config.json").stat().st_mtime)


def resolve_checkpoint(path: str, key: str = "checkpoint") -> Path:
    """The HF-layout model directory that ``path`` names (a run dir -> its final/, step_N -> its model/)."""
    if not path:
        given = newest_final()
        log.info("%s unset: using the newest trained model, %s", key, given)
    else:
        given = Path(path).expanduser()
    if not given.exists():
        raise FileNotFoundError(
            f"{key}={path!r} does not exist; pass a run's final/ or checkpoints/step_N/model directory"
        )
    for candidate in (given, given / "final", given / "model"):
        if (candidate / "config.json").is_file():
            if candidate != given:
                log.info("%s=%s: evaluating the model in %s", key, path, candidate)
            break
    else:
        raise FileNotFoundError(
            f"{key}={path!r} is not a model directory in HF layout (no config.json in it, nor in final/ or "
            "model/ below it). Pass a run's final/ or checkpoints/step_N/model directory."
        )
    damaged = (
        f"Pass an intact checkpoint (another checkpoints/step_N/model of the run), or restore this one from a "
        f"copy; if you edited a file on purpose, delete its {manifest.MANIFEST_FILE} to skip the checksums."
    )
    root, under = manifest.model_dir_root(candidate)
    manifest.verify(root, damaged, under)  # before anything loads: a damaged file is named, not a loader's traceback
    read_json_object(candidate / "config.json", damaged)  # garbage is named with its line, not a JSON traceback
    read_checkpoint(candidate)  # a model that cannot be read as a stock Llama fails here, naming the field
    if not any(candidate.glob("*.safetensors")) and not any(candidate.glob("*.bin")):
        raise FileNotFoundError(
            f"{key}={path!r}: {candidate} has a config.json but no weights (*.safetensors); pass a "
            "complete model directory"
        )
    return candidate


def training_step(model_dir: Path) -> int | None:
    """The optimizer step a checkpoint was saved at, from train.py's files next to it (None if unknown)."""
    for state in (model_dir / "training_summary.json", model_dir.parent / "trainer_state.json"):
        if state.is_file():
            step = read_json_object(state, "Restore the file from a copy of the run, or delete it.", keys=("step",))
            return int(step["step"])
    return None


def checkpoint_label(model_dir: Path) -> str:
    """Short column name: ``<run>/final`` or ``<run>/step_N``."""
    if model_dir.name == "model":
        return f"{model_dir.parent.parent.parent.name}/{model_dir.parent.name}"
    return f"{model_dir.parent.name}/{model_dir.name}"


# ----------------------------------------------------------------------------------------------------
# Held-out data: the checkpoint's run's, unless the user chose one

# Settings that change how the text is read or fetched, not which documents are held out.
_DATA_READ_SETTINGS = ("cache_dir", "hub_timeout_s", "shuffle_buffer")


def overrides_data(overrides: list[str]) -> bool:
    """Whether Hydra command-line ``overrides`` set ``data`` (``data=local``, ``data.paths=...``, ``+data.x=``)."""
    keys = (item.split("=", 1)[0].lstrip("+~") for item in overrides)
    return any(key.split(".", 1)[0] == "data" for key in keys)


def run_dir_of(model_dir: Path) -> Path | None:
    """The train.py run directory of ``<run>/final`` or ``<run>/checkpoints/step_N/model`` (None otherwise)."""
    if model_dir.name == "final":
        return model_dir.parent
    if model_dir.name == "model" and model_dir.parent.parent.name == "checkpoints":
        return model_dir.parent.parent.parent
    return None


def run_data_config(model_dir: Path) -> DataConfig | None:
    """The ``data`` section the checkpoint's run was trained with, from ``<run>/.hydra/config.yaml``.

    None when the checkpoint is not in a run directory, the run has no Hydra config (e.g. ``train()`` called
    from Python), or its ``data`` section does not fit the current ``DataConfig`` (logged).
    """
    run = run_dir_of(model_dir)
    saved = run / ".hydra" / "config.yaml" if run is not None else None
    if saved is None or not saved.is_file():
        return None
    try:
        section = OmegaConf.load(saved).get("data")
    except Exception as error:  # YAML's scanner and parser errors, or a file that is not a mapping
        raise UserInputError(
            saved,
            f"is not a readable run config ({type(error).__name__}: {' '.join(str(error).split())})",
            "Restore it from a copy of the run, or pass the held-out data on the command line "
            "(data=<name> and its data.* keys).",
        ) from None
    if section is None:
        return None
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), section))
    except OmegaConfBaseException as error:
        log.warning("%s: its data section does not fit this version's DataConfig (%s); ignoring it", saved, error)
        return None


def _held_out_identity(data: DataConfig) -> dict[str, Any]:
    """The settings that decide which documents are held out and how they are tokenized."""
    return {key: value for key, value in asdict(data).items() if key not in _DATA_READ_SETTINGS}


def _describe(data: DataConfig) -> str:
    paths = f" paths={list(data.paths)}" if data.paths else ""
    return f"data={data.name}{paths} tokenizer={data.tokenizer}"


def choose_data(given: DataConfig, data_set_by_user: bool, model_dirs: list[Path]) -> DataConfig:
    """The held-out data to evaluate on: ``given`` if the user set it, else the first checkpoint's run's data.

    Logs the choice, and warns when the data differs from what a checkpoint's run trained on (perplexity is
    then measured on other text than the run's validation split).
    """
    runs = [(model_dir, run_data_config(model_dir)) for model_dir in model_dirs]
    chosen = given
    if not data_set_by_user and runs[0][1] is not None:
        chosen = runs[0][1]
        log.info("Held-out text: %s, the data %s was trained on", _describe(chosen), runs[0][0])
    else:
        why = "as set" if data_set_by_user else "eval.yaml's default: no run config records the training data"
        log.info("Held-out text: %s (%s)", _describe(chosen), why)
    for model_dir, trained_on in runs:
        if trained_on is not None and _held_out_identity(trained_on) != _held_out_identity(chosen):
            log.warning(
                "%s was trained on %s but the held-out text is %s: perplexity and "
                "heldout_continuation are not on its validation split",
                model_dir,
                _describe(trained_on),
                _describe(chosen),
            )
    return chosen


# ----------------------------------------------------------------------------------------------------
# Device, dtype, backend


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device=cpu or device=auto")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> None:
    """A forced backend must run on ``device`` in ``dtype``; fail before loading anything if it cannot."""
    validate_kernel(kernel)
    if kernel == "auto":
        return
    reason = get_backend(kernel).unavailable_reason(device)
    if reason is not None:
        raise ValueError(
            f"kernel={kernel} cannot run on {device}: {reason.rstrip('.')}. Use kernel=auto or kernel=torch."
        )
    if kernel == "twell" and dtype != torch.bfloat16:
        raise ValueError(
            f"kernel=twell runs bf16 models, but dtype={str(dtype).removeprefix('torch.')}; use "
            "dtype=bfloat16 (or dtype=auto on a GPU), or kernel=auto"
        )


# ----------------------------------------------------------------------------------------------------
# Held-out perplexity and sparsity


def held_out_tokens(tokenizer: Any, documents: list[str], max_tokens: int | None) -> torch.Tensor:
    """The documents' tokens, each followed by eos, as one ``[n_tokens]`` int64 stream."""
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    stream = [t for doc in ids for t in (*doc, tokenizer.eos_token_id)]
    if max_tokens is not None:
        stream = stream[:max_tokens]
    if len(stream) < 2:
        raise ValueError("the held-out text has fewer than 2 tokens; hold out more documents (data.*)")
    return torch.tensor(stream, dtype=torch.int64)


class _LayerStats:
    """Per-layer L0 sum/max, fired-neuron mask and backend paths accumulated over forwards."""

    def __init__(self, n_layers: int, n_neurons: int) -> None:
        self.n = n_neurons
        self.tokens = 0
        self.l0_sum = [0] * n_layers
        self.l0_max = [0] * n_layers
        self.fired_LN = torch.zeros(n_layers, n_neurons, dtype=torch.bool)
        self.paths: list[set[str]] = [set() for _ in range(n_layers)]

    def add(self, mlps: list[Any]) -> None:
        """Fold in each layer's ``last_result`` (call right after a forward)."""
        for layer, mlp in enumerate(mlps):
            result = mlp.last_result
            self.l0_sum[layer] += int(result.l0_M.sum())
            self.l0_max[layer] = max(self.l0_max[layer], int(result.l0_M.max()))
            self.fired_LN[layer] |= result.fired_N.cpu()
            self.paths[layer].add(result.path)
        self.tokens += int(mlps[0].last_result.l0_M.numel())

    def summary(self) -> dict[str, Any]:
        layers = []
        for layer in range(len(self.l0_sum)):
            l0 = self.l0_sum[layer] / self.tokens
            layers.append(
                {
                    "layer": layer,
                    "l0_mean": l0,
                    "l0_max": self.l0_max[layer],
                    "sparsity": 1 - l0 / self.n,
                    "never_fired": float((~self.fired_LN[layer]).float().mean()),
                    "backend": "+".join(sorted(self.paths[layer])),
                }
            )
        l0_mean = sum(x["l0_mean"] for x in layers) / len(layers)
        return {
            "neurons": self.n,
            "tokens": self.tokens,
            "l0_mean": l0_mean,
            "sparsity_mean": 1 - l0_mean / self.n,
            "layers": layers,
        }


@torch.no_grad()
def held_out_metrics(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, batch_size: int) -> dict[str, Any]:
    """Cross-entropy / perplexity of ``tokens`` [n_tokens] in windows of ``seq_len``; FFN sparsity on them.

    Windows do not overlap (each starts without context); a last window shorter than ``seq_len`` is scored
    too. CE is averaged over all predicted tokens (seq_len - 1 per full window), computed in fp32.
    """
    mlps = sparse_mlps(model)
    if not mlps:
        raise ValueError("the model has no SparseMLP layers; load it with sparse_llm.model.llama.load_pretrained")
    device = next(model.parameters()).device
    n_full = len(tokens) // seq_len
    batches = list(torch.split(tokens[: n_full * seq_len].view(n_full, seq_len), batch_size))
    tail = tokens[n_full * seq_len :]
    if len(tail) >= 2:  # a lone last token predicts nothing
        batches.append(tail[None])
    stats = _LayerStats(len(mlps), mlps[0].intermediate_size)
    nll, predicted = 0.0, 0
    model.eval()
    with recording_statistics(model):
        for ids_BT in batches:
            ids_BT = ids_BT.to(device)
            logits_BTV = model(input_ids=ids_BT).logits
            stats.add(mlps)
            nll += float(
                F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1).float(), ids_BT[:, 1:].flatten(), reduction="sum")
            )
            predicted += ids_BT[:, 1:].numel()
    ce = nll / predicted
    return {
        "perplexity": {"ce": ce, "ppl": math.exp(min(ce, 50.0)), "tokens": predicted, "seq_len": seq_len},
        "sparsity": stats.summary(),
    }


# ----------------------------------------------------------------------------------------------------
# lm-eval


class _FirstTruncationOnly(logging.Filter):
    """Lets lm-eval's first "context exceeds the model's maximum length" warning through, counts the rest.

    lm-eval warns once per truncated request, which floods the console for short-context models.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Combined length of context"):
            return True
        self.dropped += 1
        return self.dropped == 1


def run_lm_eval(
    model: torch.nn.Module, tokenizer: Any, specs: list[Any], manager: Any, cfg: EvalConfig, hub_tasks: list[str]
) -> dict[str, Any]:
    """Score ``model`` (the loaded object, on its backend) on the task specs; returns lm-eval's results."""
    lm_eval = mc_tasks.import_lm_eval()
    from jinja2.exceptions import UndefinedError  # lm-eval's (optional) dependency: its templates read a row's fields
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=cfg.batch_size)
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    truncations = _FirstTruncationOnly()
    hf_log.addFilter(truncations)
    try:
        output = lm_eval.simple_evaluate(
            model=lm, tasks=specs, task_manager=manager, limit=cfg.limit, num_fewshot=cfg.num_fewshot, log_samples=False
        )
    except (ConnectionError, FileNotFoundError) as error:
        advice = "".join(
            f"\n- {n}: {mc_tasks.local_data_advice(n, manager.task_index[n].cfg)}"
            for n in hub_tasks
            if n in manager.task_index and manager.task_index[n].cfg
        )
        raise TaskDataError(
            f"lm-eval could not load a task's data ({type(error).__name__}: {error}).{advice}"
        ) from error
    except (KeyError, IndexError, TypeError, ValueError, UndefinedError) as error:
        local = {name: path for name, path in cfg.task_data.items() if path}
        if not local:
            raise
        # lm-eval reads each row's fields as the task's config names them: a row without one fails deep inside it
        files = ", ".join(f"task_data.{name}={path}" for name, path in local.items())
        raise TaskDataError(
            f"lm-eval failed on the rows of {files} ({type(error).__name__}: {error}). Check that every row has the "
            "fields the task reads (docs/evaluation.md, local task data)."
        ) from error
    finally:
        hf_log.removeFilter(truncations)
    if truncations.dropped:
        log.warning(
            "%d lm-eval requests were longer than the model's context and lost tokens on the left", truncations.dropped
        )
    if output is None:
        raise RuntimeError("lm-eval returned no results (it does so only on non-zero ranks of distributed runs)")
    return output


def summarize_tasks(output: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Per-task metrics (``acc``, ``acc_stderr``, ...) with n examples, version and shots; and the means."""
    groups = set(output.get("group_subtasks", {}))
    tasks: dict[str, dict[str, Any]] = {}
    for name, metrics in output["results"].items():
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            if "," in key and isinstance(value, (int, float)):
                metric, filt = key.split(",", 1)
                row[metric if filt == "none" else key] = value
        samples = output.get("n-samples", {}).get(name)
        row.update(
            n=samples["effective"] if samples else None,
            version=output.get("versions", {}).get(name),
            n_shot=output.get("n-shot", {}).get(name),
            group=name in groups,
        )
        tasks[name] = row
    leaves = {n: r for n, r in tasks.items() if not r["group"] and "acc" in r}
    means: dict[str, Any] = {"mean_over": sorted(leaves)}
    if leaves:
        means["mean_acc"] = sum(r["acc"] for r in leaves.values()) / len(leaves)
        means["mean_acc_norm"] = sum(r.get("acc_norm", r["acc"]) for r in leaves.values()) / len(leaves)
    return tasks, means


# ----------------------------------------------------------------------------------------------------
# One checkpoint


@dataclass
class _Plan:
    """What every checkpoint is evaluated on (built once, shared by ``checkpoint`` and ``compare``)."""

    names: list[str]
    specs: list[Any]
    manager: Any
    hub_tasks: list[str]
    documents: list[str]
    device: torch.device
    dtype: torch.dtype
    tokenizers: dict[Path, Any]  # model directory -> its tokenizer
    heldout: HeldOutTaskConfig  # cfg.heldout with max_tokens resolved


def _checkpoint_tokenizer(model_dir: Path, cfg: EvalConfig) -> Any:
    try:
        return load_tokenizer(cfg.tokenizer or str(model_dir))
    except ValueError as error:
        raise ValueError(f"{model_dir}: no usable tokenizer ({error}); pass tokenizer=<name or path>") from None


def evaluate_checkpoint(model_dir: Path, cfg: EvalConfig, plan: _Plan) -> dict[str, Any]:
    """Load one checkpoint on the configured backend and measure everything on it."""
    tokenizer = plan.tokenizers[model_dir]
    model = load_pretrained(model_dir, kernel=cfg.kernel, dtype=plan.dtype, device=str(plan.device))
    kernel_set.warm(model, plan.device, training=False)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but {model_dir} was built for "
            f"{model.config.vocab_size}; pass the tokenizer the model was trained with"
        )
    seq_len = cfg.seq_len or model.config.max_position_embeddings
    tokens = held_out_tokens(tokenizer, plan.documents, cfg.perplexity_tokens)
    record: dict[str, Any] = {
        "label": checkpoint_label(model_dir),
        "checkpoint": str(model_dir.resolve()),
        "step": training_step(model_dir),
    }
    record.update(held_out_metrics(model, tokens, seq_len, cfg.batch_size))
    record["backend"] = {"kernel": cfg.kernel, "layers": [x["backend"] for x in record["sparsity"]["layers"]]}
    if plan.specs:
        output = run_lm_eval(model, tokenizer, plan.specs, plan.manager, cfg, plan.hub_tasks)
        tasks, means = summarize_tasks(output)
        record["tasks"] = tasks
        record.update(means)
    del model
    gc.collect()
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
    return record


# ----------------------------------------------------------------------------------------------------
# Entry


def _software(ran_lm_eval: bool) -> dict[str, Any]:
    import transformers

    lm_eval_version = mc_tasks.import_lm_eval().__version__ if ran_lm_eval else None
    return {
        "lm_eval": lm_eval_version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_offline": mc_tasks.hub_env_summary(),
    }


def _heldout_fitted(
    cfg: HeldOutTaskConfig, model_dirs: list[Path], tokenizers: dict[Path, Any]
) -> tuple[HeldOutTaskConfig, Callable[[str], int]]:
    """``cfg`` with ``max_tokens`` resolved (default: the smallest context of the models) and a token counter.

    The counter takes the most tokens any of the models' tokenizers needs, without special tokens (lm-eval
    adds none for causal models), so the requests fit every model evaluated.
    """
    contexts = [json.loads((d / "config.json").read_text())["max_position_embeddings"] for d in model_dirs]
    max_tokens = cfg.max_tokens if cfg.max_tokens is not None else min(contexts)

    def count_tokens(text: str) -> int:
        return max(len(t(text, add_special_tokens=False)["input_ids"]) for t in tokenizers.values())

    return replace(cfg, max_tokens=max_tokens), count_tokens


def _plan(cfg: EvalConfig, out_dir: Path, model_dirs: list[Path]) -> _Plan:
    """Check the settings and the tasks' data, and build the task specs; fails before any model loads."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_kernel(cfg.kernel, device, dtype)
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size={cfg.batch_size} must be >= 1")
    mc_tasks.check_task_files(dict(cfg.task_data))
    names = mc_tasks.expand_task_names(cfg.tasks)
    manager = None  # tasks=none runs no benchmark and needs no lm-eval
    if names:
        manager = mc_tasks.task_manager(names)
        mc_tasks.check_known(names, manager)
    tokenizers = {model_dir: _checkpoint_tokenizer(model_dir, cfg) for model_dir in model_dirs}
    documents = held_out_documents(cfg.data)
    heldout, count_tokens = _heldout_fitted(cfg.heldout, model_dirs, tokenizers)
    heldout_file = None
    if mc_tasks.HELDOUT_TASK in names:
        rows = mc_tasks.build_heldout_examples(documents, heldout, count_tokens)
        heldout_file = mc_tasks.write_jsonl(rows, out_dir / f"{mc_tasks.HELDOUT_TASK}.jsonl")
        log.info(
            "%s: %d examples from %d held-out documents -> %s",
            mc_tasks.HELDOUT_TASK,
            len(rows),
            len(documents),
            heldout_file,
        )
    specs = mc_tasks.task_specs(names, dict(cfg.task_data), heldout_file, manager)
    hub_tasks = [n for n in names if n != mc_tasks.HELDOUT_TASK and not cfg.task_data.get(n)]
    if hub_tasks:
        mc_tasks.check_hub_tasks(hub_tasks, manager, cfg.hub_timeout_s)
    return _Plan(names, specs, manager, hub_tasks, documents, device, dtype, tokenizers, heldout)


def compare_paths(compare: Any) -> list[str]:
    """``compare`` as a list of paths: "" -> [], "a" -> ["a"], ["a", "b"] (or a ListConfig) -> ["a", "b"]."""
    if isinstance(compare, str):
        return [compare] if compare else []
    if isinstance(compare, Sequence) and all(isinstance(path, str) and path for path in compare):
        return list(compare)
    raise ValueError(f"compare={compare!r}: give one checkpoint path or a list of them, e.g. compare=[a,b]")


def evaluate(cfg: EvalConfig, out_dir: Path, data_set_by_user: bool = True) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint`` (and ``cfg.compare``); print the table, write results.json, log to W&B.

    ``data_set_by_user=False`` (eval.py, when ``data`` is not on the command line) replaces ``cfg.data`` by
    the data the checkpoint's run was trained on, when the run recorded it (see ``choose_data``).

    Raises (before any model is evaluated): FileNotFoundError for a missing or non-HF checkpoint,
    ValueError for an unknown task or a bad setting, TaskDataError for task data that cannot be read.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / RESULTS_FILE
    if stale.exists():
        log.warning("Removing %s of an earlier run: it is rewritten when this run completes", stale)
        stale.unlink()
    model_dirs = [resolve_checkpoint(cfg.checkpoint)]
    model_dirs += [resolve_checkpoint(path, key="compare") for path in compare_paths(cfg.compare)]
    cfg = replace(cfg, data=choose_data(cfg.data, data_set_by_user, model_dirs))
    plan = _plan(cfg, out_dir, model_dirs)
    models = []
    for model_dir in model_dirs:
        log.info("Evaluating %s (kernel=%s, %s, %s)", model_dir, cfg.kernel, plan.device, plan.dtype)
        models.append(evaluate_checkpoint(model_dir, cfg, plan))
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("checkpoint", "compare", "logging", "out")}
    settings.update(
        tasks=plan.names,
        heldout=asdict(plan.heldout),
        device=str(plan.device),
        dtype=str(plan.dtype).removeprefix("torch."),
        device_name=torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "cpu",
    )
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = {
        "complete": True,
        "created_utc": created,
        "settings": settings,
        "software": _software(bool(plan.specs)),
        "models": models,
    }
    print(format_table(models), flush=True)
    log_telemetry(cfg.logging, out_dir, results)
    log.info("Results: %s", write_results(out_dir, results))
    return results
