"""Bad inputs through train.py, eval.py and generate.py, run as a user runs them: exit code 2 and one message naming
the file and what is wrong with it, never a traceback; a damaged newest checkpoint resumes from the one before.

Every case copies one small trained run (step checkpoints at steps 2 and 4, and final/), damages one thing or writes
one bad file, and runs a script. To add a case, append a Case to CASES. The scripts of the cases run two at a time,
each in a process of its own; the test of each case checks its own run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import background
from helpers.runs import TINY_MODEL, child_env

from sparse_llm.data.pipeline import DataConfig, write_token_file
from sparse_llm.telemetry.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# The tests' model with a 4-step run: a step takes well under a second on two cores.
SMALL = [
    *TINY_MODEL,
    "trainer.micro_batch=4",
    "trainer.global_batch=8",
    "trainer.warmup_steps=1",
    "trainer.val_every=0",
    "logging.wandb=false",
    "logging.progress_bar=false",
    "logging.every=1",
    "trainer.max_steps=4",
    "checkpoint.every=2",
    "checkpoint.keep_last=0",
]
DOCUMENT = "A line of plain English text about kernels, layers and the tokens that pass through them. " * 4


# ----------------------------------------------------------------------------------------------------
# Ways to damage a file


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def scribble(path: Path) -> None:
    path.write_text("{this is not JSON")


def binary_bytes(size: int = 4096) -> bytes:
    return bytes(range(256)) * (size // 256)


def jsonl_rows(n: int = 40) -> str:
    return "".join(json.dumps({"text": f"{DOCUMENT} Document {i}."}) + "\n" for i in range(n))


def write_parquet(path: Path) -> Path:
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"text": [f"{DOCUMENT} {i}" for i in range(40)]}), path)
    return path


def token_file(scratch: Path) -> Path:
    """A valid token file of the embedded corpus (its first 60 documents): <scratch>/tokens.bin + tokens.json."""
    write_token_file(DataConfig(max_documents=60, val_documents=5), scratch / "tokens")
    return scratch / "tokens"


# ----------------------------------------------------------------------------------------------------
# Arguments of each script, given the copied run and a scratch directory


def train_on(scratch: Path, *overrides: str) -> list[str]:
    return ["train.py", *SMALL, f"hydra.run.dir={scratch / 'train'}", *overrides]


def local_corpus(name: str, content: bytes | str | Callable[[Path], object]) -> Callable[[Path, Path], list[str]]:
    def setup(run: Path, scratch: Path) -> list[str]:
        path = scratch / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return train_on(scratch, "data=local", f"data.paths=[{path}]")

    return setup


def truncated_jsonl(path: Path) -> None:
    path.write_text(jsonl_rows())
    cut_in_half(path)


def streamed_second_file_cut_short(run: Path, scratch: Path) -> list[str]:
    """A streamed corpus of two files: the first holds the held-out documents and a step's worth more, the second is
    cut short, so the stream reaches the damage during training, not while it reads the held-out head."""
    first, second = scratch / "first.jsonl", scratch / "second.jsonl"
    first.write_text(jsonl_rows(8))
    truncated_jsonl(second)
    paths = f"data.paths=[{first},{second}]"
    return train_on(
        scratch, "data=local", paths, "data.streaming=true", "data.val_documents=5", "data.shuffle_buffer=0"
    )


def truncated_parquet(path: Path) -> None:
    cut_in_half(write_parquet(path))


def tokens_with(change: Callable[[Path, Path], None]) -> Callable[[Path, Path], list[str]]:
    def setup(run: Path, scratch: Path) -> list[str]:
        prefix = token_file(scratch)
        change(prefix.with_suffix(".bin"), prefix.with_suffix(".json"))
        return train_on(scratch, "data=tokens", f"data.paths=[{prefix}]", "data.tokenizer=from_file")

    return setup


def meta_dtype(bin_path: Path, meta_path: Path) -> None:
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "dtype": "float32"}))


def resume_after(*damages: tuple[str, Callable[[Path], None]]) -> Callable[[Path, Path], list[str]]:
    """Damage files of the run's checkpoints (paths relative to checkpoints/), then resume it with resume=auto."""

    def setup(run: Path, scratch: Path) -> list[str]:
        for relative, damage in damages:
            damage(run / "checkpoints" / relative)
        return ["train.py", *SMALL, f"hydra.run.dir={run}", "checkpoint.resume=auto"]

    return setup


def without_manifests(run: Path) -> None:
    for manifest in run.rglob("manifest.json"):
        manifest.unlink()


def resume_from(step: str, relative: str) -> Callable[[Path, Path], list[str]]:
    def setup(run: Path, scratch: Path) -> list[str]:
        cut_in_half(run / "checkpoints" / step / relative)
        return ["train.py", *SMALL, f"hydra.run.dir={run}", f"checkpoint.resume={run / 'checkpoints' / step}"]

    return setup


def load_with(
    script: str,
    relative: str,
    damage: Callable[[Path], None],
    *,
    manifest: bool = True,
    checkpoint: str = "final",
    extra: tuple[str, ...] = (),
) -> Callable[[Path, Path], list[str]]:
    """Damage `relative` (a file below the run) and run eval.py or generate.py on the run's `checkpoint`."""

    def setup(run: Path, scratch: Path) -> list[str]:
        if not manifest:
            without_manifests(run)
        damage(run / relative)
        arguments = [script, f"checkpoint={run / checkpoint}", "device=cpu", *extra]
        if script == "eval.py":
            arguments += ["tasks=none", "logging.wandb=false", f"out={scratch / 'eval'}"]
        return arguments

    return setup


def task_data(run: Path, scratch: Path, path: Path | None = None) -> list[str]:
    if path is None:
        path = scratch / "arc_easy.jsonl"
        truncated_jsonl(path)
    return [
        "eval.py",
        f"checkpoint={run / 'final'}",
        "device=cpu",
        "tasks=arc_easy",
        f"task_data.arc_easy={path}",
        "logging.wandb=false",
        f"out={scratch / 'eval'}",
    ]


def task_rows_without_fields(run: Path, scratch: Path) -> list[str]:
    """arc_easy rows that are valid JSON but lack the fields the task reads (its question, choices, answer key)."""
    path = scratch / "arc_easy.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "text": DOCUMENT}) + "\n" for i in range(4)))
    return task_data(run, scratch, path)


def tokenizer_option(run: Path, scratch: Path) -> list[str]:
    scribble(scratch / "tokenizer.json")
    return ["generate.py", f"checkpoint={run / 'final'}", "device=cpu", f"tokenizer={scratch / 'tokenizer.json'}"]


def remove(path: Path) -> None:
    path.unlink()


def remove_tokenizer(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()


def write_yaml_garbage(path: Path) -> None:
    path.write_text("data: [unclosed\n  name: : :\n")


# ----------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    """One bad input: `setup(copied run, scratch dir)` damages what it needs and returns the command line (script and
    overrides); the output must hold every string of `named` (the file and what is wrong with it)."""

    id: str
    setup: Callable[[Path, Path], list[str]]
    named: tuple[str, ...]
    exit_code: int = 2


RESUMED_FROM_STEP_2 = ("Resumed from", "checkpoints/step_2 at step 2")
CASES = [
    # data=local: empty, binary, cut short, wrongly shaped
    Case("local-empty-txt", local_corpus("corpus.txt", b""), ("corpus.txt", "is empty")),
    Case("local-binary-txt", local_corpus("corpus.txt", binary_bytes()), ("corpus.txt", "a binary file")),
    Case(
        "local-binary-past-the-head-txt",
        local_corpus("corpus.txt", DOCUMENT.encode() * 100 + b"\xff\xfe\x80" * 9),
        ("corpus.txt", f"is not UTF-8 text (byte {len(DOCUMENT.encode()) * 100} is 0xff)"),
    ),
    Case(
        "local-streamed-damage-mid-run",
        streamed_second_file_cut_short,
        ("second.jsonl", "is not valid JSON"),
    ),
    Case(
        "local-latin1-txt",
        local_corpus("corpus.txt", "Caf\xe9 au lait.\n\n".encode("latin-1") * 50),
        ("corpus.txt", "is not UTF-8 text", "iconv"),
    ),
    Case(
        "local-truncated-jsonl",
        local_corpus("corpus.jsonl", truncated_jsonl),
        ("corpus.jsonl", "is not valid JSON", "cut short"),
    ),
    Case("local-empty-jsonl", local_corpus("corpus.jsonl", ""), ("corpus.jsonl", "is empty")),
    Case("local-binary-jsonl", local_corpus("corpus.jsonl", binary_bytes()), ("corpus.jsonl", "a binary file")),
    Case(
        "local-jsonl-of-lists",
        local_corpus("corpus.jsonl", "[1, 2]\n[3, 4]\n"),
        ("corpus.jsonl", "line 1 holds a list, not a JSON object"),
    ),
    Case(
        "local-jsonl-numbers-as-text",
        local_corpus("corpus.jsonl", '{"text": 5}\n{"text": 6}\n'),
        ("corpus.jsonl", "field 'text' holds a number, not text"),
    ),
    Case(
        "local-truncated-json",
        local_corpus("corpus.json", lambda p: (p.write_text(json.dumps([{"text": DOCUMENT}] * 20)), cut_in_half(p))),
        ("corpus.json", "is not valid JSON", "cut short"),
    ),
    Case("local-truncated-parquet", local_corpus("corpus.parquet", truncated_parquet), ("corpus.parquet", "cut short")),
    Case(
        "local-binary-parquet",
        local_corpus("corpus.parquet", binary_bytes()),
        ("corpus.parquet", "is not a parquet file"),
    ),
    Case("local-empty-parquet", local_corpus("corpus.parquet", b""), ("corpus.parquet", "is empty")),
    # data=tokens and the tokenizer
    Case(
        "tokens-bin-wrong-size",
        tokens_with(lambda bin_path, meta: cut_in_half(bin_path)),
        ("tokens.bin", "says", "uint16 tokens"),
    ),
    Case("tokens-meta-dtype", tokens_with(meta_dtype), ("tokens.json", "dtype 'float32'")),
    Case("tokens-meta-garbage", tokens_with(lambda bin_path, meta: scribble(meta)), ("tokens.json", "not valid JSON")),
    Case(
        "data-tokenizer-garbage",
        lambda run, scratch: (
            scribble(scratch / "tok.json"),
            train_on(scratch, f"data.tokenizer={scratch / 'tok.json'}"),
        )[1],
        ("tok.json", "is not valid JSON"),
    ),
    # resume=auto over a damaged newest checkpoint: named, set aside, and the run goes on from the one before
    Case(
        "resume-truncated-model",
        resume_after(("step_4/model/model.safetensors", cut_in_half)),
        ("step_4/model/model.safetensors", "cut short", *RESUMED_FROM_STEP_2),
        exit_code=0,
    ),
    Case(
        "resume-truncated-optimizer",
        resume_after(("step_4/accelerator/optimizer.bin", cut_in_half)),
        ("step_4/accelerator/optimizer.bin", "cut short", *RESUMED_FROM_STEP_2),
        exit_code=0,
    ),
    Case(
        "resume-garbage-trainer-state",
        resume_after(("step_4/trainer_state.json", scribble)),
        ("step_4/trainer_state.json", *RESUMED_FROM_STEP_2),
        exit_code=0,
    ),
    Case(
        "resume-no-manifest-truncated-optimizer",
        resume_after(("", without_manifests), ("step_4/accelerator/optimizer.bin", cut_in_half)),
        ("has no manifest.json", "optimizer.bin", "damaged torch.save archive", *RESUMED_FROM_STEP_2),
        exit_code=0,
    ),
    Case(
        "resume-every-checkpoint-damaged",
        resume_after(
            ("step_4/model/model.safetensors", cut_in_half), ("step_2/accelerator/optimizer.bin", cut_in_half)
        ),
        ("checkpoints: holds no intact checkpoint", "step_2/accelerator/optimizer.bin", "run_name"),
    ),
    Case(
        "resume-named-damaged-checkpoint",
        resume_from("step_4", "model/model.safetensors"),
        ("step_4/model/model.safetensors", "cut short", "checkpoint.resume=auto"),
    ),
    # eval.py
    Case(
        "eval-truncated-model",
        load_with("eval.py", "final/model.safetensors", cut_in_half),
        ("final/model.safetensors", "cut short"),
    ),
    Case("eval-garbage-config", load_with("eval.py", "final/config.json", scribble), ("final/config.json",)),
    Case(
        "eval-missing-tokenizer",
        load_with("eval.py", "final/tokenizer.json", remove),
        ("final/tokenizer.json", "is missing"),
    ),
    Case(
        "eval-no-manifest-truncated-model",
        load_with("eval.py", "final/model.safetensors", cut_in_half, manifest=False),
        ("final/model.safetensors", "cut short"),
    ),
    Case(
        "eval-no-manifest-missing-tokenizer",
        load_with("eval.py", "final", remove_tokenizer, manifest=False),
        ("final: holds no tokenizer",),
    ),
    Case(
        "eval-step-checkpoint-truncated-model",
        load_with(
            "eval.py", "checkpoints/step_4/model/model.safetensors", cut_in_half, checkpoint="checkpoints/step_4"
        ),
        ("step_4/model/model.safetensors", "cut short"),
    ),
    Case(
        "eval-task-rows-without-fields",
        task_rows_without_fields,
        ("task_data.arc_easy=", "arc_easy.jsonl", "fields"),
    ),
    Case("eval-corrupt-task-data", task_data, ("arc_easy.jsonl", "is not valid JSON", "task_data.arc_easy")),
    Case(
        "eval-garbage-run-config",
        load_with("eval.py", ".hydra/config.yaml", write_yaml_garbage),
        (".hydra/config.yaml", "is not a readable run config"),
    ),
    # generate.py
    Case(
        "generate-truncated-model",
        load_with("generate.py", "final/model.safetensors", cut_in_half),
        ("final/model.safetensors", "cut short"),
    ),
    Case("generate-garbage-config", load_with("generate.py", "final/config.json", scribble), ("final/config.json",)),
    Case(
        "generate-missing-tokenizer",
        load_with("generate.py", "final/tokenizer.json", remove),
        ("final/tokenizer.json", "is missing"),
    ),
    Case(
        "generate-empty-prompt",
        load_with("generate.py", "final/config.json", lambda path: None, extra=('prompts=""',)),
        ("prompts=''", "a prompt is empty"),
    ),
    Case("generate-garbage-tokenizer-option", tokenizer_option, ("tokenizer.json", "is not valid JSON")),
]


# ----------------------------------------------------------------------------------------------------
# The test


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, entry_points) -> Path:
    """A 4-step run of the smallest model: checkpoints/step_2, checkpoints/step_4 and final/, each with a manifest."""
    run = tmp_path_factory.mktemp("bad_inputs") / "run"
    done = entry_points.run(["train.py", *SMALL, f"hydra.run.dir={run}"], child_env(), run.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


def script_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in child_env().items() if key != "HYDRA_FULL_ERROR"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def outcomes(request, trained_run, entry_points, tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """The runs of the cases this session selected: case id -> (its copy of the run, the future of its script's
    CompletedProcess). Each case's setup runs here, one after the other; the scripts run two at a time on the
    entry-point server, for two cores (the threads only wait on the server), and no background job starts a process
    meanwhile (helpers/background.py)."""
    selected = {
        item.callspec.params["case"].id
        for item in request.session.items
        if getattr(item, "function", None) is test_a_bad_input_is_named_without_a_traceback
    }
    started = {}
    with background.paused(), ThreadPoolExecutor(max_workers=2) as pool:
        for case in (case for case in CASES if case.id in selected):
            scratch = tmp_path_factory.mktemp(case.id)
            run = scratch / "run"
            try:
                shutil.copytree(trained_run, run)
                arguments = case.setup(run, scratch)
            except Exception as error:  # the case's test reports it
                started[case.id] = (run, Future())
                started[case.id][1].set_exception(error)
                continue
            started[case.id] = (run, pool.submit(entry_points.run, arguments, script_env(), scratch))
        yield started


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_without_a_traceback(case, outcomes):
    run, future = outcomes[case.id]
    done = future.result()
    output = done.stdout + done.stderr
    assert done.returncode == case.exit_code, output[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    for part in case.named:
        assert part in output, (part, output[-4000:])
    if case.exit_code == 0:  # a resume: the damaged checkpoint is kept aside, and metrics.jsonl holds one history
        assert (run / "checkpoints" / "step_4.damaged").is_dir()
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(set(steps)) == [1, 2, 3, 4]
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_the_cases_are_many_and_named_once():
    ids = [case.id for case in CASES]
    assert len(ids) >= 20 and len(set(ids)) == len(ids)


@pytest.mark.slow
def test_the_debug_switch_shows_the_traceback(trained_run, entry_points, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    arguments = load_with("eval.py", "final/model.safetensors", cut_in_half)(run, tmp_path)
    done = entry_points.run(arguments, script_env(HYDRA_FULL_ERROR="1"), tmp_path)
    assert done.returncode == 1 and "Traceback" in done.stderr and "UserInputError" in done.stderr
