"""The trainer's model and optimizer under FSDP2 on CPU (gloo, 2 ranks): training steps give one process's.

accelerate runs no FSDP without a GPU (a CPU launch of the FSDP config runs as plain data parallel), so each rank
tells its accelerator that it is an FSDP run with the plugin settings of the shipped configs/accelerate/fsdp.yaml,
and then prepares the model and the trainer's AdamW as the trainer does: accelerate's own sharding (decoder layers,
the tied embeddings with the final norm), the optimizer moved onto the sharded parameters, its gradient clipping.
The fused layers hand their FFN output on to the next layer, also across the sharded units.
"""

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from sparse_llm.config import TrainConfig
from sparse_llm.model import ModelConfig, build_model
from sparse_llm.training import make_optimizer, plain_tensor

TINY = ModelConfig(hidden_size=64, intermediate_size=256, num_layers=3, num_heads=4, vocab_size=97,
                   max_position_embeddings=64)
CONFIG = Path(__file__).resolve().parents[1] / "configs/accelerate/fsdp.yaml"
WORLD = 2
STEPS = 3


def _fsdp_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    settings = yaml.safe_load(CONFIG.read_text())["fsdp_config"]
    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=settings["fsdp_version"], auto_wrap_policy=settings["fsdp_auto_wrap_policy"],
        transformer_cls_names_to_wrap=settings["fsdp_transformer_layer_cls_to_wrap"],
        reshard_after_forward=settings["fsdp_reshard_after_forward"])
    return acc


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: plain_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _rank(rank: int, port: int, result: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    acc = _fsdp_accelerator()
    cfg = TrainConfig()
    torch.manual_seed(0)
    model = build_model(TINY, kernel="torch")
    reference = copy.deepcopy(model)
    ref_optimizer = make_optimizer(reference, cfg, acc.device)
    model, optimizer = acc.prepare(model, make_optimizer(model, cfg, acc.device))
    ids_BS = torch.randint(TINY.vocab_size, (2 * WORLD, 32), generator=torch.Generator().manual_seed(1))
    mine_BS = ids_BS[2 * rank:2 * rank + 2]
    rows = []
    for _ in range(STEPS):
        before, ref_before = _snapshot(model), _snapshot(reference)
        loss = model(input_ids=mine_BS, labels=mine_BS).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(input_ids=ids_BS, labels=ids_BS).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.trainer.grad_clip)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        after, ref_after = _snapshot(model), _snapshot(reference)
        update_errors = {n: ((after[n] - before[n]) - (ref_after[n] - ref_before[n])).norm().item()
                         / (ref_after[n] - ref_before[n]).norm().item() for n in ref_after}
        rows.append({"loss": acc.reduce(loss.detach(), "mean").item(), "ref_loss": ref_loss.item(),
                     "updates": update_errors})
    if rank == 0:
        Path(result).write_text(json.dumps({"sharded": type(model.model.layers[0]).__name__, "steps": rows,
                                            "tied": model.lm_head.weight is model.model.embed_tokens.weight}))


@pytest.mark.slow
def test_fsdp2_training_steps_give_one_process_losses_and_updates(tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = tmp_path / "steps.json"
    mp.spawn(_rank, args=(port, str(result)), nprocs=WORLD)
    run = json.loads(result.read_text())
    assert run["sharded"] == "FSDPFusedDecoderLayer" and run["tied"]
    assert len(run["steps"]) == STEPS
    for step in run["steps"]:
        assert step["loss"] == pytest.approx(step["ref_loss"], rel=1e-6)
        assert len(step["updates"]) == 3 * 9 + 2  # every parameter, the tied embedding once
        assert max(step["updates"].values()) < 1e-4, step["updates"]
