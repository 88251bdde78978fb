"""The configuration schemas, and the entry points up to a composed config, import none of the run's heavy packages:
`--help`, `--cfg job` and a config error answer in about a second, where torch and transformers take ten (docs/design.md
"Package layout"). Each check is a fresh interpreter under `-X importtime`, which names every module it imports."""

import subprocess
import sys

import pytest
from helpers.entry_points import ROOT, child_env

HEAVY = {"torch", "transformers", "datasets", "lm_eval"}
SCHEMAS = ("sparse_llm.training.config", "sparse_llm.evaluation.config", "sparse_llm.generation.config")
# A value of the wrong type for each script: our key check passes it, and Hydra refuses it while composing.
WRONG_TYPE = {"train.py": "trainer.max_steps=abc", "eval.py": "batch_size=abc", "generate.py": "max_new_tokens=abc"}


def _run(arguments: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -X importtime ARGUMENTS` in the repository root, and the heavy packages it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *arguments], cwd=ROOT, env=child_env(), capture_output=True, text=True
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, {name.split(".")[0] for name in imported} & HEAVY


def test_the_config_schemas_import_no_heavy_package():
    done, heavy = _run(["-c", "; ".join(f"import {module}" for module in SCHEMAS)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert not heavy, f"importing {SCHEMAS} imports {sorted(heavy)}"


@pytest.mark.parametrize("script", sorted(WRONG_TYPE))
@pytest.mark.parametrize("how", ["--help", "--cfg job", "wrong type"])
def test_an_entry_point_composes_its_config_without_heavy_packages(script: str, how: str):
    arguments, code = ([WRONG_TYPE[script]], 1) if how == "wrong type" else (how.split(), 0)
    done, heavy = _run([script, *arguments])
    assert done.returncode == code, done.stderr[-3000:]
    assert not heavy, f"{script} {' '.join(arguments)} imports {sorted(heavy)}"


def test_an_out_of_range_training_value_is_named_before_torch_loads(tmp_path):
    done, heavy = _run(["train.py", "trainer.micro_batch=0", "trainer.max_steps=-1", f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 2 and "trainer.micro_batch=0" in done.stderr + done.stdout, done.stderr[-3000:]
    assert not heavy, f"an out-of-range value imports {sorted(heavy)}"


@pytest.mark.parametrize("script", sorted(WRONG_TYPE))
def test_an_unknown_kernel_is_named_before_torch_loads(script, tmp_path):
    done, heavy = _run([script, "kernel=fast", f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 2 and "kernel='fast'" in done.stderr + done.stdout, done.stderr[-3000:]
    assert not heavy, f"an unknown kernel imports {sorted(heavy)}"
