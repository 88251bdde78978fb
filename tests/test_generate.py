"""generate.py: sampling from a checkpoint, batched prompts, and clear errors."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.runs import child_env

from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.generation.generate import GenerateConfig, generate, report
from sparse_llm.model.llama import ModelConfig, build_model
from sparse_llm.training.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random-init tiny model with the embedded tokenizer, saved as train.py saves a run's final/."""
    path = tmp_path_factory.mktemp("run") / "final"
    tokenizer = load_tokenizer("embedded")
    torch.manual_seed(0)
    build_model(TINY, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    write_manifest(path)
    return path


def config(checkpoint: Path, **changes) -> GenerateConfig:
    return replace(GenerateConfig(checkpoint=str(checkpoint), device="cpu", max_new_tokens=8), **changes)


def test_a_batch_of_prompts_decodes_as_each_prompt_alone(checkpoint):
    prompts = ["The function returns", "A"]  # different lengths: the batch pads the shorter one
    batch = generate(config(checkpoint, prompts=prompts, temperature=0))
    alone = [generate(config(checkpoint, prompts=p, temperature=0)).continuations[0] for p in prompts]
    assert batch.continuations == alone
    assert 0 < batch.new_tokens <= 2 * 8 and batch.seconds > 0
    assert batch.ffn_paths == {"torch": TINY.num_layers}  # on the CPU every layer takes the dense path


def test_sampling_follows_the_seed(checkpoint):
    first, again = (generate(config(checkpoint, prompts="The", seed=3)) for _ in range(2))
    other = generate(config(checkpoint, prompts="The", seed=4))
    assert first.continuations == again.continuations
    assert other.continuations != first.continuations  # random weights: near-uniform next-token choices


def test_report_shows_prompts_speed_and_paths(checkpoint):
    text = report(generate(config(checkpoint, prompts=["x", "y"])))
    assert text.startswith("--- x\nx") and "--- y\ny" in text
    assert re.search(r"tokens/s, 2 prompts decoded together, then [0-9.]+ ms a step\); FFN layers on: torch x2", text)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"max_new_tokens": 100}, "exceeds the model's context of 64"),
        ({"top_p": 0.0}, "top_p=0.0 must be in"),
        ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
        ({"prompts": []}, "pass a string or a list of strings"),
    ],
)
def test_bad_options_are_named(checkpoint, changes, message):
    with pytest.raises(ValueError, match=message):
        generate(config(checkpoint, **changes))


def test_the_script_prints_continuations_and_exits_2_on_input_errors(checkpoint, entry_points, tmp_path):
    run = ["generate.py", f"checkpoint={checkpoint}", "max_new_tokens=4", "device=cpu"]
    ok = entry_points.run(run + ["prompts=Hello"], child_env(), tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("--- Hello\nHello") and "one prompt" in ok.stdout
    missing = entry_points.run(run[:1] + [f"checkpoint={tmp_path / 'nope'}"], child_env(), tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
