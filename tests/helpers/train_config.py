"""`python tests/helpers/train_config.py RUN_DIR OVERRIDES...`: the trainer on train.yaml with OVERRIDES, called as a
test calls it (`train(small_config(...), run_dir)`, no Hydra run around it), for a run made in a process of its own
(tests/conftest.py's trained_run, made while other tests run)."""

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparse_llm.training.config import register_configs
from sparse_llm.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=sys.argv[2:])
    train(OmegaConf.to_object(cfg), Path(sys.argv[1]))
