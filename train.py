"""Train a ReLU-gated Llama with L1-sparse feedforward activations.

    python train.py                                   # tiny model, embedded corpus, CPU or GPU, minutes
    python train.py model=1b l1=1e-5 data=fineweb_edu kernel=auto
    accelerate launch --config_file configs/accelerate/ddp.yaml train.py model=1b l1=1e-5
    python train.py model=1b --cfg job                # print the resolved config

Keys and their meaning: sparse_llm/training/config.py. Runs land in outputs/<run_name>/.
"""

import logging
import os
import sys
from pathlib import Path

from sparse_llm.cli import env

env.apply_defaults(sys.argv[1:])  # before transformers/datasets are imported: they read it at import

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from sparse_llm.checks.errors import exit_on_input_error  # noqa: E402
from sparse_llm.cli.overrides import exit_on_unknown_key  # noqa: E402
from sparse_llm.ffn.kernel_choice import validate_kernel  # noqa: E402
from sparse_llm.training.config import TrainConfig, check_ranges, register_configs  # noqa: E402
from sparse_llm.training.preemption import TrainingStopped  # noqa: E402

register_configs()
log = logging.getLogger("train")
RESUME_HINT = (
    "Nothing was saved since the run's last checkpoint; the same command plus checkpoint.resume=auto continues from it."
)


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    typed: TrainConfig = OmegaConf.to_object(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # Bad input (a damaged file, a bad setting, a full disk) ends the run with one message, also in train.log,
        # and exit code 2 (sparse_llm/checks/errors.py); so does a second Ctrl-C (the first stops with a checkpoint).
        with exit_on_input_error("train.py", report=log.error, after_interrupt=RESUME_HINT):
            # The trainer checks again; here a bad value is named before torch loads
            validate_kernel(typed.kernel)
            check_ranges(typed)
            # Imported once the config is valid, so that --help and config errors need no torch (docs/design.md).
            from sparse_llm.training.trainer import train

            final = train(typed, run_dir)
    except TrainingStopped as stopped:
        log.warning("%s", stopped)
        sys.exit(stopped.exit_code)
    log.info("Final model: %s", final)


if __name__ == "__main__":
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        # One console and one log file per run: other ranks stay quiet.
        sys.argv += ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    exit_on_unknown_key(sys.argv[1:], TrainConfig, "train.py")
    main()
