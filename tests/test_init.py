"""Starting from pretrained checkpoints: the paper's released format, HF Llama and Mistral read as stock Llamas,
refusals that name the field, train.py init= (resume wins over it), sparsifying a dense SiLU model, the converter."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.runs import child_env
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

from sparse_llm.data.pipeline import DataConfig
from sparse_llm.data.tokenizer import load_tokenizer
from sparse_llm.evaluation.evaluate import held_out_metrics, resolve_checkpoint
from sparse_llm.generation.generate import GenerateConfig, generate
from sparse_llm.model.convert import CheckpointError, convert, load_stock, main, read_checkpoint
from sparse_llm.model.llama import ModelConfig, build_model, load_pretrained, sparse_mlps, swap_to_relu
from sparse_llm.telemetry.metrics import read_metrics
from sparse_llm.training.config import TrainConfig, register_configs
from sparse_llm.training.init import check_tokenizer, checked_model_config
from sparse_llm.training.sparsity import l1_coefficient
from sparse_llm.training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]
register_configs()
TOKENIZER = load_tokenizer("embedded")
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": len(TOKENIZER),
    "max_position_embeddings": 64,
    "rope_theta": 1e5,
    "tie_word_embeddings": True,
}
IDS = torch.randint(0, len(TOKENIZER), (2, 24), generator=torch.Generator().manual_seed(0))
# A run small enough for a few seconds on two cores: 2 micro-batches of 4 x 64 tokens a step, 200 documents.
RUN = [
    "trainer.micro_batch=4",
    "trainer.global_batch=8",
    "trainer.warmup_steps=1",
    "trainer.val_every=100",
    "trainer.val_batches=2",
    "logging.wandb=false",
    "logging.progress_bar=false",
    "logging.every=1",
    "checkpoint.every=0",
    "data.max_documents=200",
]


def stock(act: str = "relu", seed: int = 0, **changes) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**SHAPE, **changes}, hidden_act=act)).eval()


def write_reference(path: Path, model: LlamaForCausalLM, transposed_down: bool = False, **fields) -> Path:
    """`model` saved as the reference code saves its SparseLlamaForCausalLM: model_type llama_sparse_relu, an auto_map
    to its custom code, sparsity_* fields, the leftover hidden_act "silu", the FFN width in
    sparsity_new_intermediate_size (intermediate_size keeps the dense width it replaced); down_proj as [N, K] where
    its hybrid kernel ran."""
    path.mkdir(parents=True)
    config = {
        **model.config.to_dict(),
        "model_type": "llama_sparse_relu",
        "architectures": ["SparseLlamaForCausalLM"],
        "hidden_act": "silu",
        "intermediate_size": 512,
        "auto_map": {
            "AutoConfig": "sparse_models.SparseLlamaConfig",
            "AutoModelForCausalLM": "sparse_models.SparseLlamaForCausalLM",
        },
        "sparsity_train_batch_size": 512,
        "sparsity_per_device_train_batch_size": 8,
        "sparsity_max_seq_len": 2048,
        "sparsity_tokens_until_dead": None,
        "sparsity_l1_coeff": 2e-5,
        "sparsity_start_warmup_step": None,
        "sparsity_end_warmup_step": None,
        "sparsity_new_intermediate_size": model.config.intermediate_size,
        "sparsity_gated_mlp": True,
        "mlp_bias": False,
        "sparsity_reinitialize": True,
        "sparsity_do_track": True,
        "sparsity_mlp_execution_logic": "training",
        "sparsity_baseline_run": False,
        "sparsity_use_hybrid_kernel": transposed_down,
        "sparsity_l0_cutoff": -1,
        "sparsity_l0_cutoff_period": 20,
        **fields,
    }
    (path / "config.json").write_text(json.dumps(config))
    state = {
        key: value.t().contiguous() if transposed_down and key.endswith("down_proj.weight") else value
        for key, value in model.state_dict().items()
        if key != "lm_head.weight"
    }
    save_file(state, path / "model.safetensors")
    TOKENIZER.save_pretrained(path)
    return path


def write_hf(path: Path, model) -> Path:
    model.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


def run_config(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="train", overrides=RUN + list(overrides)))


# ------------------------------------------------------------------------------------------------- reading formats


def test_reference_checkpoint_reads_as_a_stock_relu_llama_and_says_so(tmp_path, caplog):
    source = stock()
    path = write_reference(tmp_path / "ref", source)
    with caplog.at_level("INFO"):
        ours = load_pretrained(path, kernel="torch").eval()
    assert [r.message for r in caplog.records].count(
        f"{path}: the reference format (llama_sparse_relu) read as a stock LlamaForCausalLM(hidden_act='relu', "
        "intermediate_size=256); its hidden_act='silu' is a leftover that the reference MLP never applied"
    ) == 1
    assert ours.config.hidden_act == "relu" and ours.config.intermediate_size == 256
    assert not hasattr(ours.config, "sparsity_l1_coeff") and len(sparse_mlps(ours)) == 2
    torch.testing.assert_close(ours(IDS).logits, source(IDS).logits, rtol=0, atol=0)
    assert load_tokenizer(str(path)).get_vocab() == TOKENIZER.get_vocab()  # no custom code asked for
    assert resolve_checkpoint(str(path)) == path  # eval.py takes it


def test_reference_hybrid_layout_down_proj_is_transposed_back(tmp_path):
    source = stock()
    path = write_reference(tmp_path / "ref", source, transposed_down=True)
    assert load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].shape == (256, 64)
    torch.testing.assert_close(
        load_pretrained(path, kernel="torch").eval()(IDS).logits, source(IDS).logits, rtol=0, atol=0
    )


def test_generate_runs_on_a_reference_checkpoint(tmp_path):
    path = write_reference(tmp_path / "ref", stock())
    result = generate(GenerateConfig(checkpoint=str(path), device="cpu", max_new_tokens=3, temperature=0))
    assert result.new_tokens == 3


@pytest.mark.parametrize(
    "change,message",
    [
        ({"sparsity_gated_mlp": False}, "sparsity_gated_mlp=False"),
        ({"sparsity_new_intermediate_size": 0}, "sparsity_new_intermediate_size=0"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"vocab_size": None}, "lacks vocab_size"),
        ({"model_type": "qwen2"}, "biases on q_proj/k_proj/v_proj"),
        ({"model_type": "qwen2_sparse_relu"}, "biases on q_proj/k_proj/v_proj"),
        ({"model_type": "qwen3"}, "q_norm, k_norm"),
        ({"model_type": "gpt2"}, "not a Llama-architecture model"),
    ],
)
def test_unreadable_configs_name_the_field(tmp_path, change, message):
    path = write_reference(tmp_path / "ref", stock(), **change)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        read_checkpoint(path)


def test_missing_and_misshapen_weights_are_named(tmp_path):
    path = write_reference(tmp_path / "ref", stock())
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, path / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"missing: model.layers.1.mlp.up_proj.weight; misshapen: "
        r"model.norm.weight \(3,\) \(config says \(64,\)\)",
    ):
        load_pretrained(path)


@pytest.mark.slow
def test_entry_points_exit_2_on_an_unreadable_checkpoint(tmp_path, entry_points):
    path = write_reference(tmp_path / "ref", stock(), sparsity_gated_mlp=False)
    done = entry_points.run(["generate.py", f"checkpoint={path}"], child_env(), tmp_path)
    assert done.returncode == 2 and "sparsity_gated_mlp=False" in done.stderr and "Traceback" not in done.stderr
    assert main([str(path), str(tmp_path / "out")]) == 2


def test_ffn_width_the_kernels_cannot_take_loads_on_auto_and_is_refused_by_twell(tmp_path, caplog):
    source = stock(intermediate_size=200)
    path = write_reference(tmp_path / "ref", source)
    with pytest.raises(ValueError, match="kernel=twell cannot run this model: FFN width N=200 is not a multiple"):
        load_pretrained(path, kernel="twell")
    with caplog.at_level("WARNING"):
        ours = load_pretrained(path, kernel="auto").eval()
    assert "the sparse kernels will not run on this model (FFN width N=200" in caplog.text
    torch.testing.assert_close(ours(IDS).logits, source(IDS).logits, rtol=0, atol=0)


def test_mistral_reads_as_a_llama_capped_at_its_sliding_window(tmp_path):
    torch.manual_seed(0)
    config = MistralConfig(**{**SHAPE, "sliding_window": 32}, num_key_value_heads=2, head_dim=16)
    source = MistralForCausalLM(config).eval()
    checkpoint = read_checkpoint(write_hf(tmp_path / "mistral", source))
    assert checkpoint.config.max_position_embeddings == 32 and "sliding_window=32" in checkpoint.mapping
    ids = IDS[:, :32]
    torch.testing.assert_close(load_stock(checkpoint).eval()(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_converter_writes_a_plain_llama_with_its_tokenizer(tmp_path):
    source = stock()
    ref = write_reference(tmp_path / "ref", source, transposed_down=True)
    assert main([str(ref), str(tmp_path / "plain")]) == 0
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_act"] == "relu" and config["intermediate_size"] == 256
    assert not [key for key in config if key.startswith("sparsity_") or key == "auto_map"]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()  # stock class, no custom code
    assert type(plain) is LlamaForCausalLM
    torch.testing.assert_close(plain(IDS).logits, source(IDS).logits, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "plain").get_vocab() == TOKENIZER.get_vocab()
    with pytest.raises(FileExistsError, match="not empty"):
        convert(ref, tmp_path / "plain")


# ------------------------------------------------------------------------------------------------- training from init


@pytest.mark.slow
def test_train_from_a_reference_checkpoint_starts_at_its_weights(tmp_path):
    source = stock()
    path = write_reference(tmp_path / "ref", source)
    trainer = Trainer(run_config(f"init={path}", "trainer.max_steps=2"), tmp_path / "run")
    assert trainer.cfg.model.intermediate_size == 256 and trainer.cfg.data.tokenizer == str(path)
    expected = trainer._val_ce(source)
    final = trainer.run()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[0]["step"] == 0 and records[0]["val/ce"] == pytest.approx(expected, rel=1e-6)
    assert records[-1]["step"] == 2 and records[-1]["l0/layer_01"] > 0
    trained = AutoModelForCausalLM.from_pretrained(final)
    assert trained.config.hidden_act == "relu" and trained.config.intermediate_size == 256
    assert load_tokenizer(str(final)).get_vocab() == TOKENIZER.get_vocab()


def test_model_settings_that_disagree_with_the_checkpoint_are_named(tmp_path):
    checkpoint = read_checkpoint(write_reference(tmp_path / "ref", stock()))
    found = checked_model_config(ModelConfig(), checkpoint, "ref")  # the default group: nothing given
    assert (found.hidden_size, found.intermediate_size, found.vocab_size) == (64, 256, len(TOKENIZER))
    assert checked_model_config(ModelConfig(hidden_size=64), checkpoint, "ref") == found  # given, and agreeing
    with pytest.raises(
        ValueError,
        match=r"model.hidden_size=2048 \(the checkpoint has 64\); model.intermediate_size="
        r"5632 \(the checkpoint has 256\); model.num_layers=8",
    ):
        Trainer(run_config(f"init={checkpoint.path}", "model=0.5b"), tmp_path / "run")


def test_token_file_of_another_tokenizer_is_refused(tmp_path):
    checkpoint = read_checkpoint(write_reference(tmp_path / "ref", stock()))
    words = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2}, unk_token="a"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<|endoftext|>")
    tokens = DataConfig(name="tokens", tokenizer="from_file", paths=["data/other.bin"])
    with pytest.raises(ValueError, match="data.paths=data/other.bin was tokenized with .*scripts/tokenize_corpus.py"):
        check_tokenizer(other, tokens, checkpoint)
    check_tokenizer(TOKENIZER, tokens, checkpoint)
    grown = load_tokenizer("embedded")
    grown.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="more than the 8192 rows of the embedding"):
        check_tokenizer(grown, DataConfig(), checkpoint)


@pytest.mark.slow
def test_a_resumed_init_run_resumes_the_run_not_the_init(tmp_path):
    path = write_reference(tmp_path / "ref", stock())
    # A constant learning rate: the first run's schedule, which ends at its own max_steps, sets the lr of the step
    # after its last checkpoint, and the comparison is about the weights.
    common = [f"init={path}", "checkpoint.every=2", "trainer.min_lr_ratio=1"]
    train(run_config(*common, "trainer.max_steps=4"), tmp_path / "full")
    train(run_config(*common, "trainer.max_steps=2"), tmp_path / "cut")
    (path / "model.safetensors").unlink()  # a resume needs the run's own weights only
    train(run_config(*common, "trainer.max_steps=4", "checkpoint.resume=auto"), tmp_path / "cut")
    full = {r["step"]: r for r in read_metrics(tmp_path / "full" / "metrics.jsonl")}
    cut = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in cut if "val/ce" in r] == [0, 2, 4]  # the start is logged once, by the first run
    for record in cut[-2:]:
        assert record["loss"] == pytest.approx(full[record["step"]]["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------- the SiLU path


@pytest.mark.slow
def test_dense_silu_baseline_then_sparsify_then_eval(tmp_path):
    small = [
        "model.hidden_size=64",
        "model.intermediate_size=256",
        "model.num_layers=2",
        "model.max_position_embeddings=64",
    ]
    dense_final = train(run_config(*small, "model.hidden_act=silu", "trainer.max_steps=2"), tmp_path / "dense")
    dense_records = read_metrics(tmp_path / "dense" / "metrics.jsonl")
    assert all(r["l1_coeff"] == 0 and "l0/mean" not in r for r in dense_records if "loss" in r)
    dense = AutoModelForCausalLM.from_pretrained(dense_final).eval()
    assert dense.config.hidden_act == "silu"

    trainer = Trainer(run_config(f"init={dense_final}", "recipe=sparsify", "trainer.max_steps=2"), tmp_path / "sparse")
    dense_ce = trainer._val_ce(dense)
    swapped_ce = trainer._val_ce(swap_to_relu(dense))
    final = trainer.run()
    records = read_metrics(tmp_path / "sparse" / "metrics.jsonl")
    assert records[0]["val/ce_dense_source"] == pytest.approx(dense_ce, rel=1e-6)
    assert records[0]["val/ce"] == pytest.approx(swapped_ce, rel=1e-6) and swapped_ce != dense_ce
    first = records[1]  # recipe=sparsify: a lower peak lr (reached at once: RUN's one warm-up step), L1 along a sine
    assert (
        first["lr"] == pytest.approx(3e-4)
        and first["l1_coeff"] == pytest.approx(l1_coefficient(trainer.cfg.l1, 0, 200, "sine"))
        and first["l0/layer_00"] > 0
    )
    model = load_pretrained(final, kernel="torch")
    scored = held_out_metrics(model, torch.randint(0, len(TOKENIZER), (130,)), seq_len=64, batch_size=2)
    assert 0 <= scored["sparsity"]["sparsity_mean"] <= 1 and math.isfinite(scored["perplexity"]["ce"])


def test_dense_models_refuse_the_sparse_kernels_and_sparsify_needs_an_init(tmp_path):
    with pytest.raises(ValueError, match="kernel=twell needs a ReLU model; this one has hidden_act='silu'"):
        build_model(ModelConfig(hidden_act="silu", vocab_size=64), kernel="twell")
    with pytest.raises(ValueError, match="model.hidden_act='swish2'"):
        build_model(ModelConfig(hidden_act="swish2", vocab_size=64))
    with pytest.raises(ValueError, match="sparsify.relu=true sparsifies a pretrained model: give it with init="):
        Trainer(run_config("sparsify.relu=true"), tmp_path / "run")


def test_sine_ramp_of_the_l1_coefficient():
    assert l1_coefficient(1.0, 0, 2, "sine") == pytest.approx(math.sin(math.pi / 4))
    assert l1_coefficient(1.0, 1, 2, "sine") == 1.0 and l1_coefficient(1.0, 0, 4, "linear") == 0.25
    with pytest.raises(ValueError, match="l1_warmup_shape='cosine'"):
        l1_coefficient(1.0, 0, 2, "cosine")
