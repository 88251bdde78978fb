"""End-to-end training on CPU: loss falls, resume reproduces an uninterrupted run, bad losses stop the run."""

import gc
import logging
import os
import shutil
import signal
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from helpers.runs import losses, small_config
from safetensors.torch import load_file, save_file

from sparse_llm.checks.errors import UserInputError
from sparse_llm.ffn import registry, step_scope
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.model.llama import build_model, sparse_mlps
from sparse_llm.telemetry.metrics import read_metrics
from sparse_llm.training import checkpoint
from sparse_llm.training import trainer as training
from sparse_llm.training.checkpoint import list_checkpoints, load_hf_weights
from sparse_llm.training.config import TrainerConfig
from sparse_llm.training.preemption import TrainingStopped
from sparse_llm.training.trainer import (
    FrozenHeap,
    NonFiniteLossError,
    Trainer,
    cosine_with_warmup,
    graphs_by_default,
    graphs_sparse_forwards,
    make_optimizer,
    plain_tensor,
    plan_batches,
    skip_update_if_non_finite,
    sparse_training_hint,
    train,
)

# The uninterrupted run that resumed runs must reproduce: 8 steps, a checkpoint every 4.
EIGHT_STEPS = ("trainer.max_steps=8", "checkpoint.every=4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run directory of EIGHT_STEPS (checkpoints step_4 and step_8, final/). Read it; copy it to change it."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(small_config(*EIGHT_STEPS), run_dir)
    return run_dir


class _Node:
    """An object that can hold a reference to itself and be watched by a weak reference."""


class _Collector:
    """Stands in for the gc module in the trainer: records what FrozenHeap asks of the collector, and keeps a freeze
    count of its own, so no test reads (or disturbs) the interpreter's."""

    def __init__(self, frozen: int = 0) -> None:
        self.frozen = frozen  # gc.get_freeze_count()
        self.calls: list[str] = []

    def get_freeze_count(self) -> int:
        return self.frozen

    def collect(self) -> int:
        self.calls.append("collect")
        return 0

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen += 1000

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
        self.frozen = 0


# Two steps of 4 micro-batches each.
TWO_STEPS = ("trainer.max_steps=2", "checkpoint.every=0", "trainer.micro_batch=2")


@dataclass
class SpiedRun:
    """A run of TWO_STEPS and what the trainer did in it."""

    run_dir: Path
    scopes: list[dict] = field(default_factory=list)  # the arguments of each step_scope.optimizer_step entered
    adding: list[bool] = field(default_factory=list)  # per micro-batch: whether it ran adding into .grad
    heap_freezes: int = 0  # FrozenHeap.freeze calls
    collector: _Collector = field(default_factory=_Collector)  # what FrozenHeap asked of the collector


@pytest.fixture(scope="module")
def spied_run(tmp_path_factory) -> SpiedRun:
    run = SpiedRun(tmp_path_factory.mktemp("spied"))
    real_scope, real_micro, real_freeze = training.optimizer_step, Trainer._micro_step, FrozenHeap.freeze

    def micro_step(self, *args, **kwargs):
        run.adding.append(step_scope.adding_into_grads())
        return real_micro(self, *args, **kwargs)

    def freeze(self):
        run.heap_freezes += 1
        real_freeze(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "optimizer_step", lambda **kw: run.scopes.append(kw) or real_scope(**kw))
        patch.setattr(Trainer, "_micro_step", micro_step)
        patch.setattr(FrozenHeap, "freeze", freeze)
        patch.setattr(training, "gc", run.collector)
        train(small_config(*TWO_STEPS), run.run_dir)
    return run


@pytest.mark.slow
def test_short_run_learns_and_saves_a_loadable_model(trained_run):
    records = read_metrics(trained_run / "metrics.jsonl")
    assert records[-1]["ce"] < records[0]["ce"] - 0.5
    assert 0 <= records[-1]["sparsity/mean"] <= 1 and records[-1]["l0/layer_01"] > 0
    assert records[-1]["backend/layer_00"] == "torch"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_run / "final")
    assert model.config.hidden_act == "relu" and model.config.num_hidden_layers == 2
    assert (trained_run / "training.png").is_file()


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tmp_path, uninterrupted):
    # The "crashed" run stops after its step-4 checkpoint; the resumed one continues from it.
    train(small_config("trainer.max_steps=4", "checkpoint.every=4"), tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4"]
    train(small_config(*EIGHT_STEPS, "checkpoint.resume=auto"), tmp_path)
    full, resumed = losses(uninterrupted), losses(tmp_path)
    assert set(full) == set(resumed) == {2, 4, 6, 8}
    for step in full:
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(tmp_path, monkeypatch, uninterrupted):
    common = ["trainer.max_steps=8", "checkpoint.every=0"]
    # The signal arrives during step 3 (as from a scheduler); no periodic checkpoint is due before the end. Step 3's
    # stop votes are read after step 4 is issued (its metrics are not logged: the host runs a step ahead), so the
    # run stops after step 4.
    step_fn = Trainer._optimizer_step

    def signalled_step(trainer, stop):
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_fn(trainer, stop)

    monkeypatch.setattr(Trainer, "_optimizer_step", signalled_step)
    with pytest.raises(TrainingStopped, match="SIGTERM after step 4") as stopped:
        train(small_config(*common), tmp_path)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4"]
    assert not (tmp_path / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the run
    monkeypatch.setattr(Trainer, "_optimizer_step", step_fn)
    train(small_config(*common, "checkpoint.resume=auto"), tmp_path)
    full, resumed = losses(uninterrupted), losses(tmp_path)
    assert set(full) == set(resumed) == {2, 4, 6, 8}
    for step in full:
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step


@pytest.mark.slow
def test_compiled_layers_train_as_the_eager_model(tmp_path):
    # On the CPU in float32 wherever it runs: on a GPU, bf16 autocast rounds the two differently.
    common = ["trainer.max_steps=3", "checkpoint.every=0", "logging.every=1", "trainer.cpu=true"]
    train(small_config(*common), tmp_path / "eager")
    torch._dynamo.reset()
    train(small_config(*common, "trainer.compile=true", "trainer.compile_backend=aot_eager"), tmp_path / "compiled")
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_an_unknown_compile_backend_is_named(tmp_path):
    with pytest.raises(ValueError, match="compile_backend='inductr'.*inductor"):
        Trainer(small_config("trainer.compile=true", "trainer.compile_backend=inductr"), tmp_path)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.cuda_graphs=true"], "trainer.compile=true"),
        (["trainer.cuda_graphs=true", "trainer.compile=true", "trainer.compile_backend=aot_eager"], "inductor"),
        (
            ["trainer.cuda_graphs=true", "trainer.compile=true", "trainer.gradient_checkpointing=true"],
            "gradient_checkpointing",
        ),
        (["trainer.cuda_graphs=true", "trainer.compile=true", "trainer.cpu=true"], "needs a CUDA GPU"),
    ],
)
def test_cuda_graphs_settings_that_cannot_work_are_named(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=named):
        Trainer(small_config(*overrides), tmp_path)


def test_cuda_graphs_mark_every_micro_batch_and_hold_the_gradients(tmp_path, monkeypatch, spied_run):
    """The trainer's side of trainer.cuda_graphs with several micro-batches a step, on the CPU with the graphs
    themselves stubbed out (tests/gpu/test_train_graphs.py replays real ones): a graph step begins before every
    micro-batch, and the gradients exist from the start and are zeroed in place, never freed, so no backward graph's
    output buffer becomes a .grad. The loss matches a run without the setting."""
    marks = []
    monkeypatch.setattr(training, "check_cuda_graphs_setup", lambda t, device: None)
    monkeypatch.setattr(training, "compile_layers", lambda model, backend, cuda_graphs: model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    trainer = Trainer(small_config(*TWO_STEPS, "trainer.compile=true", "trainer.cuda_graphs=true"), tmp_path)
    held = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None and not g.any() for g in held)
    trainer.run()
    assert len(marks) == 2 * 4
    assert all(p.grad is g and not g.any() for p, g in zip(trainer.model.parameters(), held, strict=True))
    assert list(losses(tmp_path)) == [2]
    assert losses(tmp_path) == pytest.approx(losses(spied_run.run_dir), rel=1e-5)


def test_each_optimizer_step_runs_its_micro_batches_in_one_step_scope(spied_run):
    """The trainer enters step_scope.optimizer_step once per update, around all of its micro-batches, and lets the op
    reuse its casts and add gradients into .grad (one process here; DDP too, FSDP neither); its forwards are CUDA
    graphs only with trainer.cuda_graphs=true."""
    assert spied_run.scopes == [{"reuse_casts": True, "add_into_grads": True, "graph_forwards": False}] * 2
    assert spied_run.adding == [True] * 8 and not step_scope.adding_into_grads()


def test_sparse_training_without_cuda_graphs_gets_a_hint_naming_the_missing_settings():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    eager, compiled = TrainerConfig(), TrainerConfig(compile=True)
    graphed = TrainerConfig(compile=True, cuda_graphs=True)
    assert "trainer.compile=true (which brings trainer.cuda_graphs)" in sparse_training_hint("twell", eager, cuda)
    assert "trainer.compile=true (which brings trainer.cuda_graphs)" in sparse_training_hint("auto", eager, cuda)
    hint = sparse_training_hint("auto", compiled, cuda)
    assert "trainer.cuda_graphs=true" in hint and "trainer.compile=true" not in hint
    assert sparse_training_hint("twell", graphed, cuda) is None  # already set
    assert sparse_training_hint("torch", eager, cuda) is None  # trains densely
    assert sparse_training_hint("auto", eager, cpu) is None  # no kernels there
    assert sparse_training_hint("twell", eager, cuda, fsdp=True) is None  # FSDP refuses trainer.compile


def test_cuda_graphs_follow_compile_where_they_can_run_for_sparse_models(tmp_path):
    """Left unset, trainer.cuda_graphs is on with trainer.compile for a model that may train on the sparse kernels,
    on a CUDA GPU, with inductor and without gradient checkpointing; off anywhere else."""
    cuda = torch.device("cuda")
    assert graphs_by_default(TrainerConfig(compile=True), cuda, sparse=True)
    assert not graphs_by_default(TrainerConfig(), cuda, sparse=True)
    assert not graphs_by_default(TrainerConfig(compile=True), cuda, sparse=False)  # dense: spare the pools' memory
    assert not graphs_by_default(TrainerConfig(compile=True), torch.device("cpu"), sparse=True)
    assert not graphs_by_default(TrainerConfig(compile=True, gradient_checkpointing=True), cuda, sparse=True)
    assert not graphs_by_default(TrainerConfig(compile=True, compile_backend="aot_eager"), cuda, sparse=True)
    trainer = Trainer(small_config("trainer.compile=true", "trainer.compile_backend=aot_eager"), tmp_path / "cpu")
    assert trainer.cfg.trainer.cuda_graphs is False  # resolved at start: a CPU run


def test_the_sparse_op_is_graphed_on_a_gpu_without_gradient_checkpointing_or_fsdp():
    """With or without trainer.compile and trainer.cuda_graphs: each micro-batch's backward runs before the next
    forward everywhere else."""
    cuda = torch.device("cuda")
    assert graphs_sparse_forwards(TrainerConfig(), cuda)
    assert graphs_sparse_forwards(TrainerConfig(compile=True, cuda_graphs=False), cuda)
    assert not graphs_sparse_forwards(TrainerConfig(), torch.device("cpu"))
    assert not graphs_sparse_forwards(TrainerConfig(gradient_checkpointing=True), cuda)  # its recompute is a forward
    assert not graphs_sparse_forwards(TrainerConfig(), cuda, fsdp=True)


class CheapDense(TorchFFN):
    """The dense path under another name, priced at nothing: a sparse backend that always wins once priced."""

    name = "cheap"

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        return 0.0


def test_layers_switch_after_their_first_observation_and_the_switch_is_logged(tmp_path, monkeypatch, caplog):
    """A training layer of `kernel=auto` has no price before its first observation (the window read at the first
    logged step, step 2), stays on the dense path until then, and moves to the cheaper backend at the next step: the
    trainer names each layer in one log line with that step and counts them in backend/sparse_layers."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    registry.register_backend(CheapDense())
    with caplog.at_level(logging.INFO, logger="sparse_llm.training.trainer"):
        trainer = Trainer(small_config("trainer.max_steps=4"), tmp_path / "run")
        trainer.run()
    switches = [r.getMessage() for r in caplog.records if "changed backend" in r.getMessage()]
    assert len(switches) == 1 and switches[0].startswith("step 3: FFN layers changed backend: layer 00: torch -> cheap")
    assert switches[0].count("torch -> cheap") == len(sparse_mlps(trainer.model))
    sparse_layers = {
        r["step"]: r.get("backend/sparse_layers") for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
    }
    assert sparse_layers[2] == 0 and sparse_layers[4] == len(sparse_mlps(trainer.model))


def test_non_finite_loss_stops_with_a_clear_message_and_no_update(tmp_path):
    # Step 1 is not logged (logging.every=2), so its values are read after step 2 is issued: both updates must
    # have been skipped on the device.
    trainer = Trainer(small_config("trainer.max_steps=3", "checkpoint.every=0"), tmp_path)
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.fill_(float("nan"))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(NonFiniteLossError, match="Step 1: .*checkpoint"):
        trainer.run()
    assert trainer.step == 2
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) or (p.isnan().all() and before[name].isnan().all()), name


def test_a_non_finite_step_leaves_weights_and_optimizer_state_alone():
    layer = torch.nn.Linear(4, 3)
    optimizer = make_optimizer(layer, small_config(), torch.device("cpu"))

    def step(loss_value: float) -> tuple[list[bool], dict[str, torch.Tensor]]:
        """Which parameters one step moved, and AdamW's state of the weight after it."""
        before = [p.detach().clone() for p in layer.parameters()]
        layer(torch.randn(2, 4)).sum().backward()
        assert skip_update_if_non_finite(optimizer, torch.tensor([loss_value, 0.5]))
        optimizer.step()
        optimizer.found_inf = None
        optimizer.zero_grad()
        moved = [not torch.equal(p, b) for p, b in zip(layer.parameters(), before, strict=True)]
        return moved, {k: v.clone() for k, v in optimizer.state[layer.weight].items()}

    moved, state = step(1.0)
    assert all(moved)
    moved, state_after_inf = step(float("inf"))
    assert not any(moved)
    assert state.keys() == state_after_inf.keys()
    assert all(torch.equal(state[k], state_after_inf[k]) for k in state)


def test_zero_steps_write_the_initial_model_and_negative_steps_are_named(tmp_path):
    final = Trainer(small_config("trainer.max_steps=0"), tmp_path / "zero").run()
    assert (final / "model.safetensors").is_file() and not (tmp_path / "zero" / "training.png").exists()
    with pytest.raises(ValueError, match="trainer.max_steps=-1"):
        Trainer(small_config("trainer.max_steps=-1"), tmp_path / "negative")


@pytest.mark.slow
def test_a_checkpoint_holds_the_weights_once_and_a_resume_reads_them_from_model_dir(tmp_path, uninterrupted):
    """accelerator/ keeps no second copy of the weights. A resume overwrites the fresh trainer's (zeroed) weights
    with model/'s; a checkpoint that still holds them in accelerator/ (the layout before) resumes from those."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    step_dir = tmp_path / "run" / "checkpoints" / "step_8"
    assert not list((step_dir / "accelerator").glob("model*")) and (step_dir / "model" / "model.safetensors").is_file()
    saved = load_file(step_dir / "model" / "model.safetensors")

    def resumed_weights(run_dir: Path) -> dict[str, torch.Tensor]:
        trainer = Trainer(small_config(*EIGHT_STEPS, "checkpoint.resume=auto"), run_dir)
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.zero_()
        return load_file(trainer.run() / "model.safetensors")

    shutil.copytree(tmp_path / "run", tmp_path / "before")
    old_dir = tmp_path / "before" / "checkpoints" / "step_8"
    (old_dir / "manifest.json").unlink()  # that layout predates manifests too
    (old_dir / "model" / "model.safetensors").rename(old_dir / "accelerator" / "model.safetensors")
    save_file({key: torch.zeros_like(value) for key, value in saved.items()}, old_dir / "model" / "model.safetensors")
    for resumed in (resumed_weights(tmp_path / "run"), resumed_weights(tmp_path / "before")):
        assert resumed.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(resumed[key], value), key


def test_hf_weights_load_from_shards_with_a_tied_head_and_another_models_are_named(tmp_path):
    model_cfg = replace(small_config().model, vocab_size=128)
    assert model_cfg.tie_embeddings
    model = build_model(model_cfg)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # the shards' path
    fresh = build_model(model_cfg)
    load_hf_weights(fresh, tmp_path / "hf")
    for (key, value), loaded in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(value, loaded), key
    deeper = build_model(replace(model_cfg, num_layers=3))
    with pytest.raises(ValueError, match=r"does not hold this model's weights \(missing \['model\.layers\.2"):
        load_hf_weights(deeper, tmp_path / "hf")
    wider = build_model(replace(model_cfg, intermediate_size=512))
    with pytest.raises(
        ValueError,
        match=r"\(shapes \['model\.layers\.0\.mlp\.gate_proj\.weight \(256, 64\) for "
        r"\(512, 64\)'",
    ):
        load_hf_weights(wider, tmp_path / "hf")


@pytest.mark.slow
def test_grad_clip_zero_trains_unclipped_and_logs_the_norm(tmp_path):
    common = ["trainer.max_steps=3", "checkpoint.every=0", "logging.every=1", "trainer.lr=5e-3"]
    runs = {}
    for clip in ("0", "1e9", "1e-3"):  # off; a bound no norm reaches; a bound every step's norm exceeds
        train(small_config(*common, f"trainer.grad_clip={clip}"), tmp_path / clip)
        runs[clip] = read_metrics(tmp_path / clip / "metrics.jsonl")
    assert [r["loss"] for r in runs["0"]] == [r["loss"] for r in runs["1e9"]]
    assert [r["grad_norm"] for r in runs["0"]] == [r["grad_norm"] for r in runs["1e9"]]
    assert all(r["grad_norm"] > 1e-3 for r in runs["0"])
    assert runs["1e-3"][-1]["loss"] != runs["0"][-1]["loss"]  # clipping does change the run


def test_resume_auto_refuses_to_retrain_a_finished_run_that_has_no_checkpoint(trained_run):
    before = sorted(trained_run.rglob("*"))
    with pytest.raises(FileExistsError, match=r"holds a finished run \(final/\) but no step checkpoint"):
        Trainer(small_config("trainer.max_steps=2", "checkpoint.every=0", "checkpoint.resume=auto"), trained_run)
    assert sorted(trained_run.rglob("*")) == before  # refused before it wrote anything


def test_a_value_out_of_range_stops_the_trainer_before_it_builds_anything(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.micro_batch=0 \(give a value >= 1\)"):
        Trainer(small_config("trainer.micro_batch=0"), tmp_path)
    assert not any(tmp_path.iterdir())


def test_resume_from_a_missing_path_names_it(tmp_path):
    trainer = Trainer(small_config("checkpoint.resume=" + str(tmp_path / "nope")), tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        trainer.run()


@pytest.mark.slow
def test_resuming_past_max_steps_says_so_and_writes_final(tmp_path, caplog, uninterrupted):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "final")  # so that the resumed run must write it
    final = train(small_config("trainer.max_steps=2", "checkpoint.every=4", "checkpoint.resume=auto"), tmp_path)
    assert "nothing left to train" in caplog.text and "trainer.max_steps=2" in caplog.text
    assert final.is_dir()


def test_global_batch_must_divide_over_ranks():
    cfg = small_config("trainer.global_batch=10", "trainer.micro_batch=4")
    with pytest.raises(ValueError, match="global batch of 10"):
        plan_batches(cfg, world=1)
    plan = plan_batches(small_config("trainer.global_batch=16", "trainer.micro_batch=4"), world=2)
    assert plan.accumulation == 2 and plan.tokens_per_step == 16 * 64


def test_cosine_schedule_shape():
    assert cosine_with_warmup(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert cosine_with_warmup(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(55, 10, 100, 0.1) == pytest.approx(0.55)


@pytest.mark.slow
def test_resume_mid_dead_window_with_reinit_reproduces_the_run(tmp_path):
    """The open dead-neuron window, the dispatchers' observations and the layers' L1 weights travel with the
    checkpoint."""
    common = [
        "trainer.max_steps=8",
        "checkpoint.every=4",
        "sparsity.reinit_dead=true",
        "sparsity.dead_window_steps=3",
        "logging.every=1",
        "sparsity.layer_balance=0.5",
    ]

    def run(run_dir: Path, *overrides: str) -> None:
        trainer = Trainer(small_config(*common, *overrides), run_dir)
        with torch.no_grad():  # zero gate rows never fire: dead neurons for the window to find and re-initialise
            for layer in trainer.model.model.layers:
                layer.mlp.gate_proj.weight[:32].zero_()
        trainer.run()

    run(tmp_path / "full")
    # A new run resumed from step 4, when the window of steps 4-6 is open; the zeroing is overwritten by the
    # checkpoint's weights.
    run(tmp_path / "resumed", f"checkpoint.resume={tmp_path / 'full' / 'checkpoints' / 'step_4'}")
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")}
    assert sum(r["reinit_neurons"] for r in full) >= 64  # the window of steps 1-3 found the zeroed rows
    assert list(resumed) == [5, 6, 7, 8]
    for record in full[4:]:
        assert resumed[record["step"]]["loss"] == pytest.approx(record["loss"], rel=1e-5), record["step"]
        assert resumed[record["step"]]["reinit_neurons"] == record["reinit_neurons"], record["step"]
        assert resumed[record["step"]].get("dead/mean") == record.get("dead/mean"), record["step"]
        weights = [record[f"l1_weight/layer_{layer:02d}"] for layer in (0, 1)]
        assert [resumed[record["step"]][f"l1_weight/layer_{layer:02d}"] for layer in (0, 1)] == pytest.approx(weights)
    assert full[-1]["l1_weight/layer_00"] != pytest.approx(1.0)  # the layers' L0 differ, so their weights moved


def test_validation_runs_on_its_own_schedule(tmp_path):
    train(small_config("trainer.max_steps=6", "trainer.val_every=2", "logging.every=3", "checkpoint.every=0"), tmp_path)
    with_val = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "val/ce" in r]
    assert with_val == [2, 4, 6]


@pytest.fixture
def collector(monkeypatch) -> _Collector:
    collector = _Collector()
    monkeypatch.setattr(training, "gc", collector)
    return collector


def test_frozen_heap_freezes_once_after_a_collection_and_gives_the_objects_back_on_exit(collector):
    with FrozenHeap() as heap:
        assert collector.calls == []  # nothing frozen before the first step has run
        heap.freeze()
        assert collector.calls == ["collect", "freeze"]  # what is garbage already is not kept
        heap.freeze()  # once only
        assert collector.calls == ["collect", "freeze"]
    assert collector.calls == ["collect", "freeze", "unfreeze"]
    with pytest.raises(KeyboardInterrupt), FrozenHeap() as heap:  # a run that stops early gives them back too
        heap.freeze()
        raise KeyboardInterrupt
    assert collector.calls[3:] == ["collect", "freeze", "unfreeze"]


def test_frozen_heap_leaves_a_callers_own_freeze_alone(monkeypatch):
    collector = _Collector(frozen=5)  # the caller froze objects of its own before the run
    monkeypatch.setattr(training, "gc", collector)
    with FrozenHeap() as heap:
        heap.freeze()
    assert collector.calls == [] and collector.frozen == 5  # neither frozen again nor given back


def test_garbage_made_after_the_freeze_is_still_collected():
    """What FrozenHeap relies on: gc.freeze() keeps only the objects alive at that moment out of collections."""
    with FrozenHeap() as heap:
        heap.freeze()
        cycle = _Node()
        cycle.self = cycle
        collected = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert collected() is None


def test_the_trainer_freezes_after_its_first_step_and_gives_the_objects_back(spied_run):
    assert spied_run.heap_freezes == 2  # asked after every step; done after the first only
    assert spied_run.collector.calls == ["collect", "freeze", "unfreeze"]


def test_a_fresh_run_refuses_a_used_run_dir(trained_run):
    before = sorted(trained_run.rglob("*"))
    with pytest.raises(FileExistsError, match="checkpoint.resume=auto"):
        Trainer(small_config("trainer.max_steps=2"), trained_run)
    assert sorted(trained_run.rglob("*")) == before


class _Messages(logging.Handler):
    """Keeps the message of every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class PrunedRun:
    """A run of 6 steps with a checkpoint every 2 and checkpoint.keep_last=2, and what it wrote on the way."""

    run_dir: Path
    on_disk: list[tuple[str, list[str]]] = field(default_factory=list)  # per checkpoint: the ones complete meanwhile
    log: _Messages = field(default_factory=_Messages)  # the trainer's log


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory) -> PrunedRun:
    run = PrunedRun(tmp_path_factory.mktemp("pruned"))
    real_export = checkpoint.export_model

    def export(accelerator, model, tokenizer, out_dir):
        if out_dir.name == "model":  # a step checkpoint's (final/ is exported too)
            run.on_disk.append((out_dir.parent.name, [p.name for p in list_checkpoints(run.run_dir)]))
        real_export(accelerator, model, tokenizer, out_dir)

    logger = logging.getLogger("sparse_llm.training.trainer")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(run.log)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(checkpoint, "export_model", export)
            train(small_config("trainer.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=2"), run.run_dir)
    finally:
        logger.removeHandler(run.log)
        logger.setLevel(level)
    return run


def test_checkpoints_are_pruned_and_partial_ones_ignored(tmp_path, pruned_run):
    assert [p.name for p in list_checkpoints(pruned_run.run_dir)] == ["step_4", "step_6"]
    saved = [m for m in pruned_run.log.messages if m.startswith("Checkpoint: ")]
    assert [Path(m.split(": ", 1)[1]).name for m in saved] == ["step_2", "step_4", "step_6"]  # the run's log says so
    assert not (pruned_run.run_dir / "final.partial").exists()
    assert (pruned_run.run_dir / "final" / "config.json").is_file()
    shutil.copytree(pruned_run.run_dir / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "step_8.partial").mkdir()  # a write that crashed half-way
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_6"


def test_checkpoints_make_room_before_a_write(pruned_run):
    """With keep_last=2 the oldest checkpoint goes before the next is written, so the disk never holds three (one
    complete checkpoint stays while the new one is written)."""
    on_disk = [("step_2.partial", []), ("step_4.partial", ["step_2"]), ("step_6.partial", ["step_4"])]
    assert pruned_run.on_disk == on_disk


# Failures a writer meets: a full disk, a permission, torch.save's own error (it raises RuntimeError, not OSError).
WRITE_FAILURES = [
    OSError(28, "No space left on device"),
    PermissionError(13, "Permission denied"),
    RuntimeError(
        "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/3: file write failed"
    ),
]


@pytest.mark.parametrize("failure", WRITE_FAILURES, ids=lambda error: type(error).__name__)
def test_a_failed_checkpoint_write_says_what_to_change_and_leaves_no_partial(tmp_path, monkeypatch, failure):
    """A failure in torch.save at the step-4 checkpoint: an error naming the failure, the free space, the complete
    checkpoint to resume from and the settings to change; the partial directory is gone and step 2's checkpoint
    resumes."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if "step_4.partial" in str(path):
            raise failure
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    common = ["trainer.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=1"]
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        train(small_config(*common), tmp_path)
    message = str(raised.value)
    for part in (
        "checkpoints/step_4: writing it failed",
        str(failure).split(":")[0],
        "B are free there",
        "step_2 (",
        "checkpoint.resume=auto",
        "checkpoint.keep_last (now 1",
        "checkpoint.every",
    ):
        assert part in message, part
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]
    monkeypatch.setattr(torch, "save", real_save)
    train(small_config(*common, "checkpoint.resume=auto"), tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_6"]


@pytest.mark.parametrize("failure", WRITE_FAILURES, ids=lambda error: type(error).__name__)
def test_a_failed_final_export_leaves_no_partial_and_names_the_checkpoint_to_resume(tmp_path, monkeypatch, failure):
    """A failure when final/ is written: no final.partial is left, the error names the step-4 checkpoint, and a
    resume from it writes final/."""
    real_export = checkpoint.export_model

    def export(accelerator, model, tokenizer, out_dir):
        if out_dir.name == "final.partial":
            raise failure
        real_export(accelerator, model, tokenizer, out_dir)

    monkeypatch.setattr(checkpoint, "export_model", export)
    common = ["trainer.max_steps=4", "checkpoint.every=4"]
    with pytest.raises(
        checkpoint.CheckpointWriteError,
        match=rf"final: writing it failed \({type(failure).__name__}.*"
        r"step_4 \(",
    ):
        train(small_config(*common), tmp_path)
    assert not (tmp_path / "final.partial").exists() and not (tmp_path / "final").exists()
    monkeypatch.setattr(checkpoint, "export_model", real_export)
    train(small_config(*common, "checkpoint.resume=auto"), tmp_path)
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipped, and left alone
def test_deferred_clipping_in_fused_adamw_matches_clip_grad_norm(max_norm):
    from sparse_llm.training.trainer import defer_clipping

    torch.manual_seed(0)
    start = [torch.randn(7, 5), torch.randn(5)]
    grads = [torch.randn(7, 5), torch.randn(5)]

    def stepped(deferred: bool) -> tuple[list[torch.Tensor], float]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
        if deferred:
            norm = defer_clipping(optimizer, params, max_norm)
            assert norm is not None and optimizer.grad_scale is not None
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.grad_scale = None
        # Adam's first step barely depends on the gradients' scale: the moments show whether the clip applied.
        moments = [optimizer.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]
        return [p.detach() for p in params] + moments, float(norm)

    (want, want_norm), (got, got_norm) = stepped(False), stepped(True)
    assert got_norm == pytest.approx(want_norm, rel=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_optimizers_without_a_gradient_scale_are_clipped_before_the_step():
    from sparse_llm.training.trainer import defer_clipping

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param], foreach=True)
    assert defer_clipping(optimizer, [param], 1.0) is None and getattr(optimizer, "grad_scale", None) is None


def test_an_fsdp_gradient_norm_joins_the_step_readout(tmp_path):
    """FSDP2's clip_grad_norm_ returns a DTensor; the step's readout concatenates it with plain tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        norm = DTensor.from_local(torch.tensor(2.5), mesh, [Partial()])
        losses = torch.tensor([3.0, 0.5])
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            torch.cat([losses, norm.reshape(1)])
        values = torch.cat([losses, plain_tensor(norm).reshape(1)])
        assert type(values) is torch.Tensor and values.tolist() == [3.0, 0.5, 2.5]
        plain = torch.tensor(1.5)
        assert plain_tensor(plain) is plain
    finally:
        dist.destroy_process_group()


def test_running_out_of_memory_names_the_settings_that_shrink_a_step(tmp_path, monkeypatch):
    def step_out_of_memory(trainer, stop):
        if trainer.step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return step_fn(trainer, stop)

    step_fn = Trainer._optimizer_step
    monkeypatch.setattr(Trainer, "_optimizer_step", step_out_of_memory)
    with pytest.raises(UserInputError, match="step 2 ran out of memory") as error:
        train(small_config("trainer.max_steps=3", "checkpoint.every=0"), tmp_path)
    assert error.value.path == "trainer.micro_batch"
    assert "trainer.gradient_checkpointing=true" in error.value.fix
    assert isinstance(error.value.__cause__, torch.OutOfMemoryError)
