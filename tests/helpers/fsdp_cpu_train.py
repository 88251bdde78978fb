"""train.py as an FSDP run on CPU ranks, for tests/test_fsdp.py:
`torchrun --nproc_per_node 2 tests/helpers/fsdp_cpu_train.py <train.py overrides>`.

accelerate runs no FSDP without a GPU (a CPU launch of the FSDP config runs as plain data parallel), so this
launcher has each rank's accelerator take the FSDP2 settings of configs/accelerate/fsdp.yaml before the trainer
prepares anything; the rest is train.py unchanged (accelerate's sharding, the optimizer on the sharded parameters,
clipping, sharded checkpoints and resume).
"""

import runpy
import sys
from pathlib import Path

import yaml
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from sparse_llm.training import trainer

ROOT = Path(__file__).resolve().parents[2]
make_accelerator = trainer.make_accelerator


def fsdp_accelerator(cfg):
    acc = make_accelerator(cfg)
    settings = yaml.safe_load((ROOT / "configs/accelerate/fsdp.yaml").read_text())["fsdp_config"]
    # accelerate keeps the type in two shared states, and a later AcceleratorState() copies PartialState's over its
    # own: set both.
    acc.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=settings["fsdp_version"],
        auto_wrap_policy=settings["fsdp_auto_wrap_policy"],
        transformer_cls_names_to_wrap=settings["fsdp_transformer_layer_cls_to_wrap"],
        reshard_after_forward=settings["fsdp_reshard_after_forward"],
        state_dict_type=settings["fsdp_state_dict_type"],
    )
    return acc


if __name__ == "__main__":
    trainer.make_accelerator = fsdp_accelerator
    sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
