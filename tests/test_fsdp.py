"""The model under FSDP2 on CPU (gloo, 2 ranks): one training step gives one process's gradients and update.

accelerate runs no FSDP without a GPU, so the ranks shard the model themselves, with torch's `fully_shard` on the
modules that the shipped configs/accelerate/fsdp.yaml wraps (through accelerate's own wrap policy), and step the
trainer's AdamW. This covers what FSDP2 does to this model: the fused decoder layers handing their FFN output to the
next layer, the tied embeddings, and the optimizer on sharded parameters.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from sparse_llm.config import TrainConfig
from sparse_llm.model import ModelConfig, build_model
from sparse_llm.training import make_optimizer, plain_tensor

TINY = ModelConfig(hidden_size=64, intermediate_size=256, num_layers=3, num_heads=4, vocab_size=97,
                   max_position_embeddings=64)
CONFIG = Path(__file__).resolve().parents[1] / "configs/accelerate/fsdp.yaml"
WORLD = 2


def _shard_as_configured(model: torch.nn.Module) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import fully_shard

    settings = yaml.safe_load(CONFIG.read_text())["fsdp_config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy=settings["fsdp_auto_wrap_policy"],
        transformer_cls_names_to_wrap=settings["fsdp_transformer_layer_cls_to_wrap"])
    wrapped = fsdp2_prepare_auto_wrap_policy(plugin, model)
    for module in [m for m in model.modules() if wrapped(m) and m is not model]:
        fully_shard(module)
    fully_shard(model)


def _step(model: torch.nn.Module, ids_BS: torch.Tensor) -> tuple[dict, dict]:
    """One update of `model` on `ids_BS`: each parameter's full gradient and update."""
    optimizer = make_optimizer(model, TrainConfig(), torch.device("cpu"))
    before = {n: plain_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    model(input_ids=ids_BS, labels=ids_BS, use_cache=False).loss.backward()
    grads = {n: plain_tensor(p.grad).clone() for n, p in model.named_parameters()}
    optimizer.step()
    return grads, {n: plain_tensor(p.detach()) - before[n] for n, p in model.named_parameters()}


def _rank(rank: int, store: str, result: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        reference = build_model(TINY, kernel="torch")
        model = copy.deepcopy(reference)
        ids_BS = torch.randint(TINY.vocab_size, (2 * WORLD, 32), generator=torch.Generator().manual_seed(1))
        ref_grads, ref_updates = _step(reference, ids_BS)
        _shard_as_configured(model)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        grads, updates = _step(model, ids_BS[2 * rank:2 * rank + 2])
        if rank == 0:
            def error(ours: torch.Tensor, ref: torch.Tensor) -> float:
                return ((ours - ref).norm() / ref.norm()).item()

            Path(result).write_text(json.dumps({
                "tied": tied, "sharded": type(model.model.layers[0]).__name__,
                "grads": {n: error(grads[n], ref_grads[n]) for n in ref_grads},
                "updates": {n: error(updates[n], ref_updates[n]) for n in ref_updates},
            }))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_step_gives_one_process_gradients_and_update(tmp_path):
    result = tmp_path / "errors.json"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(result)), nprocs=WORLD)
    errors = json.loads(result.read_text())
    assert errors["tied"] and errors["sharded"].startswith("FSDP")
    assert len(errors["grads"]) == len(list(build_model(TINY, kernel="torch").parameters()))
    assert max(errors["grads"].values()) < 1e-5, errors["grads"]
    assert max(errors["updates"].values()) < 1e-4, errors["updates"]
