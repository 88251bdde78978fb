"""Config composition for every model size, and the errors a user gets for bad keys or values."""

from pathlib import Path

import pytest
import torch
from helpers.runs import child_env
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from sparse_llm.cli.overrides import unknown_key_message
from sparse_llm.evaluation.config import EvalConfig
from sparse_llm.generation.config import GenerateConfig
from sparse_llm.model.llama import build_model, count_parameters
from sparse_llm.training.config import TrainConfig, register_configs

ROOT = Path(__file__).resolve().parents[1]
register_configs()


def _compose(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize(
    "size,layers,billions", [("0.5b", 8, 0.512), ("1b", 18, 1.026), ("1.5b", 28, 1.539), ("2b", 38, 2.053)]
)
def test_paper_sizes_compose_and_build(size, layers, billions):
    cfg = _compose(f"model={size}", "l1=1e-5")
    assert (cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_layers) == (2048, 5632, layers)
    assert (cfg.model.num_heads, cfg.model.vocab_size, cfg.model.max_position_embeddings) == (32, 49152, 2048)
    assert cfg.l1 == 1e-5 and cfg.trainer.global_batch == 512 and cfg.trainer.warmup_steps == 600
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert count_parameters(model) / 1e9 == pytest.approx(billions, abs=1e-3)


def test_default_is_tiny_on_the_embedded_corpus():
    cfg = _compose()
    assert cfg.model.name == "tiny" and cfg.data.name == "embedded" and cfg.kernel == "auto"


def test_misspelt_key_fails():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("trainer.lrr=1e-3")
    assert "lrr" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("trainer.max_steps=many")
    assert isinstance(err.value.__cause__, ValidationError)


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("model=3b")
    message = str(err.value)
    assert "model/3b" in message and "1b" in message and "tiny" in message


def test_cli_prints_resolved_config(entry_points, tmp_path):
    out = entry_points.run(["train.py", "model=1b", "--cfg", "job"], child_env(), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "num_layers: 18" in out.stdout and "intermediate_size: 5632" in out.stdout


def test_cli_error_names_the_bad_key_and_the_likely_one(entry_points, tmp_path):
    out = entry_points.run(["train.py", "trainer.max_stesp=1"], child_env(), tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown config key 'trainer.max_stesp'" in out.stderr, out.stderr
    assert "Did you mean 'trainer.max_steps'?" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "schema,override,suggestion",
    [
        (TrainConfig, "l11=1e-5", "'l1'"),
        (TrainConfig, "model.hidden_sise=64", "'model.hidden_size'"),
        (TrainConfig, "checkpoint.keep_lats=1", "'checkpoint.keep_last'"),
        (EvalConfig, "checkpont=outputs/a/final", "'checkpoint'"),
        (GenerateConfig, "max_new_token=5", "'max_new_tokens'"),
    ],
)
def test_misspelt_override_suggests_the_key_meant(schema, override, suggestion):
    message = unknown_key_message(["--cfg", "job", override], schema)
    assert message is not None and f"Did you mean {suggestion}" in message  # the closest first


def test_a_retired_key_names_what_replaced_it():
    message = unknown_key_message(["train_kernels=true"], TrainConfig)
    assert message.startswith("config key 'train_kernels' was removed") and "kernel=torch trains dense" in message


def test_far_off_key_lists_the_keys_of_its_level():
    message = unknown_key_message(["trainer.zzzz=1"], TrainConfig)
    assert "TrainerConfig has no 'zzzz'" in message and "max_steps, micro_batch" in message
    assert unknown_key_message(["trainer.learning_rat=1"], TrainConfig).startswith(
        "unknown config key 'trainer.learning_rat'"
    )


def test_overrides_the_check_leaves_to_hydra_pass():
    overrides = [
        "model=2b",
        "data.paths=[a=b,c]",
        "+trainer.extra=1",
        "~logging.wandb",
        "hydra/job_logging=disabled",
        "hydra.run.dir=/tmp/x",
        "--cfg",
        "job",
        "-m",
        "trainer.seq_len=null",
    ]
    assert unknown_key_message(overrides, TrainConfig) is None
    assert unknown_key_message(["task_data.arc_easy=arc.jsonl", "tasks=paper"], EvalConfig) is None  # a mapping


def test_run_dir_stamp_is_shared_by_ranks_of_one_launch(monkeypatch):
    """Ranks compose their configs at different moments; under a launcher they must agree on the run dir."""
    import os
    import time

    import psutil

    from sparse_llm.training.config import launch_stamp

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    first = launch_stamp()
    an_hour_later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: an_hour_later)  # a rank that composes its config much later
    assert launch_stamp() == first
    parent_start = psutil.Process(os.getppid()).create_time()
    assert first == time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(parent_start))


def test_cli_input_error_is_a_message_not_a_traceback(entry_points, tmp_path):
    arguments = ["train.py", "data=local", f"data.paths=[{tmp_path}/missing.txt]", f"hydra.run.dir={tmp_path}/run"]
    out = entry_points.run(arguments, child_env(), tmp_path)
    assert out.returncode == 2
    assert "missing.txt" in out.stderr + out.stdout and "Traceback" not in out.stderr


def test_several_machines_need_an_explicit_run_name(monkeypatch):
    from sparse_llm.training.config import launch_stamp

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="run_name"):
        launch_stamp()


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["trainer.micro_batch=0"], ["trainer.micro_batch=0 (give a value >= 1)"]),
        (["trainer.seq_len=0"], ["trainer.seq_len=0 (give a value >= 1, or null"]),
        (["trainer.lr=-1", "checkpoint.every=-2"], ["trainer.lr=-1.0 (give a value > 0)", "checkpoint.every=-2"]),
        (["trainer.beta2=1.0", "l1=-1e-5"], ["trainer.beta2=1.0 (give a value within [0, 1))", "l1=-1e-05"]),
        (["trainer.grad_clip=-1"], ["trainer.grad_clip=-1.0 (give a value >= 0 (0: no clipping))"]),
    ],
)
def test_values_out_of_range_are_named_together(overrides, named):
    from sparse_llm.training.config import check_ranges

    with pytest.raises(ValueError, match="^Out of range: ") as err:
        check_ranges(_compose(*overrides))
    for part in named:
        assert part in str(err.value)
    check_ranges(_compose())  # the defaults pass
    check_ranges(_compose("model=2b", "trainer.grad_clip=0", "l1=0", "trainer.val_every=0"))
