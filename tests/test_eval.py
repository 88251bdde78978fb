"""eval.py: held-out perplexity and sparsity, lm-eval tasks (embedded, local files), compare, error paths."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.runs import TRAINED, child_env, small_config
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import sparse_llm.evaluation.evaluate as evaluation
from sparse_llm.data.pipeline import DataConfig
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.evaluation import tasks
from sparse_llm.evaluation.config import EvalConfig, HeldOutTaskConfig, register_eval_configs
from sparse_llm.evaluation.evaluate import evaluate
from sparse_llm.evaluation.tasks import TaskDataError, build_heldout_examples
from sparse_llm.model.llama import build_model
from sparse_llm.telemetry.metrics import LoggingConfig
from sparse_llm.training.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
register_configs()
register_eval_configs()

ARC_ROWS = [
    {
        "id": f"q{i}",
        "question": f"Which number follows {i}?",
        "answerKey": "A",
        "choices": {"text": [str(i + 1), "a cat", "the sky", "blue"], "label": ["A", "B", "C", "D"]},
    }
    for i in range(5)
]


def _compose(config_name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


@pytest.fixture(scope="module")
def models(trained_run, tmp_path_factory) -> dict[str, Path]:
    """The `final/` of the trained run the tests share, and a random-init model of its shape with its tokenizer."""
    tokenizer = load_tokenizer("embedded")
    random_dir = tmp_path_factory.mktemp("runs") / "random" / "final"
    torch.manual_seed(0)
    build_model(small_config(*TRAINED).model, vocab_size=len(tokenizer)).save_pretrained(random_dir)
    tokenizer.save_pretrained(random_dir)
    return {"trained": trained_run / "final", "random": random_dir}


def eval_config(**changes) -> EvalConfig:
    base = EvalConfig(
        batch_size=8,
        device="cpu",
        heldout=HeldOutTaskConfig(examples=24, context_words=24, continuation_words=8),
        logging=LoggingConfig(wandb=False, progress_bar=False, console=False),
    )
    return replace(base, **changes)


@pytest.fixture
def arc_full_index(monkeypatch):
    """lm-eval's index of every built-in task (~14 s) made of its ARC folder alone: tests that fall back to it."""
    from lm_eval import tasks as lm_eval_tasks

    arc_dir = Path(lm_eval_tasks.__file__).parent / "arc"

    class ArcOnly(lm_eval_tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True):
            super().__init__(include_path=arc_dir if include_defaults else include_path, include_defaults=False)

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", ArcOnly)


# ----------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
def test_embedded_tasks_end_to_end_with_compare(models, tmp_path, capsys):
    out = tmp_path / "eval"
    compare = [str(models["random"]), str(models["trained"])]
    results = evaluate(eval_config(checkpoint=str(models["trained"]), compare=compare), out)
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results, default=str))
    trained, random, trained_again = results["models"]
    assert trained_again["perplexity"] == trained["perplexity"]  # evaluation is deterministic
    assert trained["step"] == 40 and random["step"] is None
    task = trained["tasks"]["heldout_continuation"]
    assert task["n"] == 24 and task["version"] == tasks.HELDOUT_VERSION and task["n_shot"] == 0
    assert 0.0 <= task["acc"] <= 1.0 and 0.0 <= task["acc_norm"] <= 1.0
    assert trained["mean_acc"] == task["acc"]
    # Training lowers held-out perplexity far below a random model's (~vocab size).
    assert trained["perplexity"]["ppl"] < 0.5 * random["perplexity"]["ppl"]
    sparsity = trained["sparsity"]
    assert len(sparsity["layers"]) == 2 and sparsity["neurons"] == 256
    assert all(0 < layer["l0_mean"] <= layer["l0_max"] <= 256 for layer in sparsity["layers"])
    assert trained["backend"] == {"kernel": "auto", "layers": ["torch", "torch"]}
    settings = results["settings"]
    assert settings["batch_size"] == 8 and settings["dtype"] == "float32"
    assert settings["tasks"] == ["heldout_continuation"] and results["software"]["lm_eval"]
    table = capsys.readouterr().out
    assert "trained/final" in table and "random/final" in table and "heldout_continuation acc" in table
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 40 and records[0]["compare/ppl"] == random["perplexity"]["ppl"]
    assert records[0]["compare_2/ppl"] == trained["perplexity"]["ppl"]


def test_tasks_none_measures_perplexity_and_sparsity_without_lm_eval(models, tmp_path, monkeypatch):
    def no_lm_eval():
        raise ImportError("lm-eval is not installed")

    monkeypatch.setattr(tasks, "import_lm_eval", no_lm_eval)
    results = evaluate(eval_config(checkpoint=str(models["trained"]), tasks="none"), tmp_path / "eval")
    (trained,) = results["models"]
    assert "tasks" not in trained and "mean_acc" not in trained
    assert trained["perplexity"]["ppl"] > 1.0 and len(trained["sparsity"]["layers"]) == 2
    assert results["settings"]["tasks"] == [] and results["software"]["lm_eval"] is None
    with pytest.raises(ValueError, match="tasks=none"):
        tasks.expand_task_names("")


def test_compare_takes_one_checkpoint_or_a_list():
    assert evaluation.compare_paths("") == []
    assert evaluation.compare_paths("runs/a") == ["runs/a"]
    assert evaluation.compare_paths(["runs/a", "runs/b"]) == ["runs/a", "runs/b"]
    for bad in (["runs/a", ""], [3], 3):
        with pytest.raises(ValueError, match="compare="):
            evaluation.compare_paths(bad)


def test_local_arc_file_runs_through_lm_eval(models, tmp_path):
    data = tasks.write_jsonl(ARC_ROWS, tmp_path / "arc_rows.jsonl")
    cfg = eval_config(checkpoint=str(models["trained"]), tasks="arc_easy", task_data={"arc_easy": str(data)}, limit=4)
    results = evaluate(cfg, tmp_path / "eval")
    arc = results["models"][0]["tasks"]["arc_easy"]
    assert arc["n"] == 4 and arc["version"] == 1.0
    assert 0.0 <= arc["acc"] <= 1.0 and "acc_norm" in arc


def test_heldout_examples_are_deterministic_and_well_formed():
    documents = [" ".join(f"{topic}{i}" for i in range(100)) for topic in ("apple", "river", "stone")]
    cfg = HeldOutTaskConfig(examples=5, context_words=10, continuation_words=5, choices=3, seed=1)
    rows = build_heldout_examples(documents, cfg)
    assert rows == build_heldout_examples(documents, cfg)
    assert len(rows) == 5
    for row in rows:
        topic = row["context"].split()[0].rstrip("0123456789")
        truth = row["choices"][row["label"]]
        # The true continuation follows the context; the distractors come from other documents.
        last_seen = int(row["context"].split()[-1].removeprefix(topic))
        assert int(truth.split()[0].removeprefix(topic)) == last_seen + 1
        others = [c for i, c in enumerate(row["choices"]) if i != row["label"]]
        assert len(others) == 2 and not any(c.startswith(topic) for c in others)
    assert len({row["label"] for row in build_heldout_examples(documents, replace(cfg, examples=30))}) == 3


def test_heldout_passages_are_shortened_to_fit_max_tokens():
    documents = [" ".join(f"{topic}{i}" for i in range(100)) for topic in ("apple", "river", "stone")]
    cfg = HeldOutTaskConfig(examples=6, context_words=10, continuation_words=5, choices=3, seed=1)
    full = build_heldout_examples(documents, cfg)
    n_words = lambda text: len(text.split())  # noqa: E731 - one word per token, to check the budget exactly
    fitted = build_heldout_examples(documents, replace(cfg, max_tokens=12), n_words)
    assert fitted == build_heldout_examples(documents, replace(cfg, max_tokens=12), n_words)
    for long, short in zip(full, fitted, strict=True):
        # Same example, its passage cut from the start to 12 - 5 = 7 words: the words before the continuation.
        assert short["choices"] == long["choices"] and short["label"] == long["label"]
        assert short["context"].split() == long["context"].split()[-7:]
    assert build_heldout_examples(documents, replace(cfg, max_tokens=15), n_words) == full
    with pytest.raises(ValueError, match="continuation_words"):
        build_heldout_examples(documents, replace(cfg, max_tokens=5), n_words)


def test_default_heldout_requests_fit_the_models_context(models, tmp_path):
    """The tiny model has 128 positions; some default passages (40 + 12 words) are longer than that."""
    cfg = eval_config(checkpoint=str(models["trained"]), heldout=HeldOutTaskConfig())
    evaluation._plan(cfg, tmp_path, [models["trained"]])
    rows = [json.loads(line) for line in (tmp_path / "heldout_continuation.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(str(models["trained"]))
    lengths = [
        max(len(tokenizer(f"{row['context']} {c}", add_special_tokens=False)["input_ids"]) for c in row["choices"])
        for row in rows
    ]
    assert len(rows) == 300 and max(lengths) <= 128
    assert any(len(row["context"].split()) < 40 for row in rows)  # some passages had to be shortened


def test_heldout_examples_need_two_documents():
    with pytest.raises(ValueError, match="two"):
        build_heldout_examples(
            ["one two three " * 20, "short"], HeldOutTaskConfig(context_words=5, continuation_words=5)
        )


def test_task_names_expand_aliases_in_order():
    assert tasks.expand_task_names("paper")[:2] == ["arc_easy", "arc_challenge"]
    assert len(tasks.expand_task_names(["paper", "piqa"])) == 7
    assert tasks.expand_task_names("embedded,arc_easy") == ["heldout_continuation", "arc_easy"]


# ----------------------------------------------------------------------------------------------------
# lm-eval's task index: the requested tasks' folders, or every built-in task


@pytest.mark.parametrize("name", tasks.PAPER_TASKS)
def test_a_paper_task_is_found_in_the_index_of_its_folder_alone(name):
    from lm_eval.tasks._index import Kind

    (folder,) = tasks.builtin_task_dirs([name])
    manager = tasks.task_manager([name])
    assert manager.include_path == [folder] and folder.is_dir()
    entry = manager.task_index[name]
    assert entry.kind is Kind.TASK and entry.yaml_path.parent == folder
    tasks.check_known([name], manager)
    assert tasks.builtin_task_config(name, manager)["task"] == name  # its !function entries resolve from there too


def test_task_folders_are_those_of_the_builtin_tasks_asked_for():
    arc_dir = Path(tasks.import_lm_eval().__file__).parent / "tasks" / "arc"
    assert tasks.builtin_task_dirs(["arc_easy", tasks.HELDOUT_TASK, "arc_challenge"]) == [arc_dir]
    assert len(tasks.builtin_task_dirs(tasks.PAPER_TASKS)) == 6
    assert tasks.builtin_task_dirs([tasks.HELDOUT_TASK]) == []
    assert tasks.task_manager([tasks.HELDOUT_TASK]).all_tasks == []
    assert tasks.builtin_task_dirs(["arc_easy", "lambada_openai"]) is None  # no folder known: the full index


def test_a_task_its_folder_does_not_define_is_looked_up_in_the_full_index(monkeypatch, arc_full_index):
    monkeypatch.setitem(tasks.BUILTIN_TASK_DIRS, "arc_easy", "piqa")  # as if a later lm-eval had moved it
    manager = tasks.task_manager(["arc_easy"])
    assert manager.task_index["arc_easy"].yaml_path.parent.name == "arc"


def test_no_other_folder_of_lm_eval_declares_a_paper_task():
    """What makes the index of the tasks' folders agree with the full one: each paper task is declared (`task: <name>`)
    in its own folder's YAMLs alone. A text scan of every task YAML (~1 s; the full index parses them in ~14 s)."""
    root = Path(tasks.import_lm_eval().__file__).parent / "tasks"
    declared = re.compile(r"^task:\s*['\"]?([\w-]+)['\"]?\s*$", re.MULTILINE)
    folders: dict[str, set[str]] = {}
    for path in root.rglob("*.yaml"):
        for name in declared.findall(path.read_text(errors="ignore")):
            if name in tasks.BUILTIN_TASK_DIRS:
                folders.setdefault(name, set()).add(path.relative_to(root).parts[0])
    assert folders == {name: {folder} for name, folder in tasks.BUILTIN_TASK_DIRS.items()}


# ----------------------------------------------------------------------------------------------------
# Held-out data: the run's, unless set


def _run_with_data(root: Path, data: dict) -> Path:
    """A run directory whose .hydra/config.yaml records ``data``; returns the run directory."""
    (root / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"data": data, "l1": 2e-5}), root / ".hydra" / "config.yaml")
    return root


def _local_documents(path: Path, n: int = 12) -> Path:
    words = ("river", "stone", "apple", "cloud", "field", "lamp")
    rows = [{"text": " ".join(f"{words[i % 6]}{i}x{j}" for j in range(100))} for i in range(n)]
    return tasks.write_jsonl(rows, path)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data=local", True),
        ("data.paths=[a.jsonl]", True),
        ("+data.max_documents=5", True),
        ("checkpoint=outputs/run/final", False),
        ("heldout.examples=3", False),
        ("database=x", False),
    ],
)
def test_data_overrides_are_recognised(override, expected):
    assert evaluation.overrides_data(["tasks=embedded", override]) is expected


def test_unset_data_defaults_to_the_runs_data(tmp_path, caplog):
    run = _run_with_data(tmp_path / "run", {"name": "local", "paths": ["docs.jsonl"], "val_documents": 3})
    for model_dir in (run / "final", run / "checkpoints" / "step_5" / "model"):
        with caplog.at_level("INFO", logger="sparse_llm.evaluation.evaluate"):
            chosen = evaluation.choose_data(DataConfig(), data_set_by_user=False, model_dirs=[model_dir])
        assert (chosen.name, chosen.paths, chosen.val_documents) == ("local", ["docs.jsonl"], 3)
        assert "Held-out text: data=local" in caplog.text
    # A checkpoint outside a run directory, or a run without a Hydra config: eval.yaml's default stays.
    assert evaluation.choose_data(DataConfig(), False, [tmp_path / "elsewhere" / "final"]) == DataConfig()


def test_user_data_that_differs_from_the_runs_is_kept_with_a_warning(tmp_path, caplog):
    run = _run_with_data(tmp_path / "run", {"name": "local", "paths": ["docs.jsonl"]})
    with caplog.at_level("WARNING", logger="sparse_llm.evaluation.evaluate"):
        chosen = evaluation.choose_data(DataConfig(name="embedded"), True, [run / "final"])
    assert chosen.name == "embedded"
    assert "was trained on data=local" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sparse_llm.evaluation.evaluate"):  # a different cache_dir is the same data
        evaluation.choose_data(DataConfig(name="local", paths=["docs.jsonl"], cache_dir="c"), True, [run / "final"])
    assert "was trained on" not in caplog.text


def test_evaluate_scores_the_runs_held_out_text(models, tmp_path):
    docs = _local_documents(tmp_path / "docs.jsonl")
    run = _run_with_data(tmp_path / "run", {"name": "local", "paths": [str(docs)], "val_documents": 4})
    shutil.copytree(models["trained"], run / "final")
    results = evaluate(eval_config(checkpoint=str(run / "final")), tmp_path / "eval", data_set_by_user=False)
    assert results["settings"]["data"]["name"] == "local"
    assert results["settings"]["data"]["paths"] == [str(docs)]


# ----------------------------------------------------------------------------------------------------
# Errors: each names the problem, and no results file is left behind


def test_missing_checkpoint_is_named_and_no_stale_results_survive(tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.json").write_text('{"complete": true}')
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        evaluate(eval_config(checkpoint=str(tmp_path / "nope")), out)
    assert not (out / "results.json").exists()


def test_non_hf_checkpoint_dir_is_rejected(tmp_path):
    (tmp_path / "run" / "weights.pt").parent.mkdir()
    (tmp_path / "run" / "weights.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="HF layout"):
        evaluate(eval_config(checkpoint=str(tmp_path / "run")), tmp_path / "eval")


def test_run_dir_resolves_to_its_final_model(models):
    assert evaluation.resolve_checkpoint(str(models["trained"].parent)) == models["trained"]


def test_unset_checkpoint_without_trained_models_says_to_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="python train.py"):
        evaluate(eval_config(), tmp_path / "eval")


def test_unknown_task_suggests_close_names(models, tmp_path, arc_full_index):
    with pytest.raises(ValueError, match="unknown task 'arc_esy'.*arc_easy"):
        evaluate(eval_config(checkpoint=str(models["trained"]), tasks="arc_esy"), tmp_path / "eval")
    assert not (tmp_path / "eval" / "results.json").exists()


def test_hub_task_offline_without_cache_fails_with_local_file_advice(models, tmp_path, monkeypatch):
    from datasets import config as ds_config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(ds_config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    advice = r"(?s)arc_challenge.*ARC-Challenge.*split='test'.*task_data\.arc_challenge="
    with pytest.raises(TaskDataError, match=advice):
        evaluate(eval_config(checkpoint=str(models["trained"]), tasks="arc_challenge"), tmp_path / "eval")


def test_missing_local_task_file_is_named(models, tmp_path):
    cfg = eval_config(
        checkpoint=str(models["trained"]), tasks="arc_easy", task_data={"arc_easy": str(tmp_path / "absent.jsonl")}
    )
    with pytest.raises(TaskDataError, match="task_data.arc_easy=.*absent.jsonl.*does not exist"):
        evaluate(cfg, tmp_path / "eval")


def test_task_data_for_a_task_not_run_is_an_error(models, tmp_path):
    data = tasks.write_jsonl(ARC_ROWS, tmp_path / "arc_rows.jsonl")
    cfg = eval_config(checkpoint=str(models["trained"]), tasks="embedded", task_data={"arc_easy": str(data)})
    with pytest.raises(ValueError, match="arc_easy"):
        evaluate(cfg, tmp_path / "eval")


def test_failure_during_scoring_leaves_no_results_file(models, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(evaluation, "run_lm_eval", broken)
    with pytest.raises(RuntimeError, match="scoring failed"):
        evaluate(eval_config(checkpoint=str(models["trained"])), tmp_path / "eval")
    assert not (tmp_path / "eval" / "results.json").exists()


def test_forced_twell_kernel_without_a_gpu_fails_before_loading(models, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="kernel=twell cannot run"):
        evaluate(eval_config(checkpoint=str(models["trained"]), kernel="twell"), tmp_path / "eval")


def test_forced_twell_kernel_with_a_non_bf16_dtype_fails_before_loading(monkeypatch):
    monkeypatch.setattr(evaluation.get_backend("twell"), "unavailable_reason", lambda device: None)
    with pytest.raises(ValueError, match="kernel=twell runs bf16 models, but dtype=float32.*dtype=bfloat16"):
        evaluation.check_kernel("twell", torch.device("cuda"), torch.float32)
    evaluation.check_kernel("twell", torch.device("cuda"), torch.bfloat16)
    evaluation.check_kernel("auto", torch.device("cuda"), torch.float32)


# ----------------------------------------------------------------------------------------------------
# Config and entry point


def test_eval_config_composes_and_rejects_misspelt_keys():
    overrides = ["tasks=[paper,piqa]", "task_data.piqa=/data/piqa.jsonl", "heldout.examples=10", "kernel=torch"]
    cfg: EvalConfig = OmegaConf.to_object(_compose("eval", overrides))
    assert cfg.tasks == ["paper", "piqa"] and cfg.task_data["piqa"] == "/data/piqa.jsonl"
    assert cfg.task_data["arc_easy"] is None and cfg.heldout.examples == 10 and cfg.data.name == "embedded"
    with pytest.raises(ConfigCompositionException):
        _compose("eval", ["batch_sise=4"])


@pytest.mark.slow
def test_eval_py_reports_a_bad_checkpoint_and_writes_no_results(entry_points, tmp_path):
    out = tmp_path / "eval"
    command = ["eval.py", f"checkpoint={tmp_path / 'missing'}", f"out={out}", "logging.wandb=false"]
    env = {k: v for k, v in child_env().items() if k != "HYDRA_FULL_ERROR"}
    run = entry_points.run(command, env, tmp_path)
    # An input error is one message and exit code 2, without a traceback.
    assert run.returncode == 2
    assert "missing' does not exist" in run.stderr and "Traceback" not in run.stderr
    assert not (out / "results.json").exists()
    debug = entry_points.run(command, {**env, "HYDRA_FULL_ERROR": "1"}, tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


# ----------------------------------------------------------------------------------------------------
# GPU: the sparse kernels score like the dense path


@pytest.mark.gpu
def test_twell_scores_match_torch_on_gpu(models, tmp_path):
    reason = "no CUDA GPU"
    if torch.cuda.is_available():
        reason = evaluation.get_backend("twell").unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"twell kernels unavailable: {reason}")
    runs = {}
    for kernel in ("torch", "twell"):
        cfg = eval_config(
            checkpoint=str(models["trained"]),
            kernel=kernel,
            device="cuda",
            dtype="bfloat16",
            heldout=HeldOutTaskConfig(examples=200),
        )
        runs[kernel] = evaluate(cfg, tmp_path / kernel)["models"][0]
    dense, sparse = runs["torch"], runs["twell"]
    assert all(layer.startswith("twell") for layer in sparse["backend"]["layers"])
    assert sparse["perplexity"]["ce"] == pytest.approx(dense["perplexity"]["ce"], rel=5e-3)
    for metric in ("acc", "acc_norm"):
        a, b = dense["tasks"]["heldout_continuation"][metric], sparse["tasks"]["heldout_continuation"][metric]
        assert abs(a - b) <= 0.03, (metric, a, b)
    assert sparse["sparsity"]["l0_mean"] == pytest.approx(dense["sparsity"]["l0_mean"], rel=0.02)
