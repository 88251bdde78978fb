"""Evaluate a trained checkpoint: held-out perplexity, FFN sparsity and multiple-choice benchmarks (lm-eval).

    python eval.py                                            # newest outputs/*/final on the embedded tasks
    python eval.py checkpoint=outputs/<run>/final tasks=paper # the paper's seven zero-shot tasks
    python eval.py checkpoint=outputs/a/final compare=outputs/b/final   # two models side by side
    python eval.py checkpoint=outputs/a/final compare=[outputs/b/final,outputs/c/final]   # three
    python eval.py tasks=arc_easy task_data.arc_easy=arc_easy_test.jsonl # a benchmark from a local file
    python eval.py --cfg job                                  # print the resolved config

Keys and their meaning: sparse_llm/evaluation/config.py (EvalConfig). Results land in <out>/results.json.
Input errors (missing or damaged checkpoint, unknown task, unreadable data) print one message and exit with code 2;
HYDRA_FULL_ERROR=1 shows the full traceback instead (sparse_llm/checks/errors.py).
"""

import sys
from pathlib import Path

from sparse_llm.cli import env

# Offline by default (benchmarks come from local files or the cache unless the user opts in to the hub);
# set before transformers/datasets are imported, as they read it at import.
env.apply_defaults(sys.argv[1:])

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from sparse_llm.checks.errors import exit_on_input_error  # noqa: E402
from sparse_llm.cli.overrides import exit_on_unknown_key  # noqa: E402
from sparse_llm.evaluation.config import EvalConfig, register_eval_configs  # noqa: E402
from sparse_llm.ffn.kernel_choice import validate_kernel  # noqa: E402

register_eval_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    typed: EvalConfig = OmegaConf.to_object(cfg)
    with exit_on_input_error("eval.py"):
        validate_kernel(typed.kernel)  # named before torch loads (evaluate checks it again)
    # Imported once the config is valid, so that --help and config errors need no torch (docs/design.md).
    from sparse_llm.evaluation.evaluate import evaluate, overrides_data
    from sparse_llm.evaluation.tasks import TaskDataError

    hydra_cfg = HydraConfig.get()
    # Without `data` on the command line, the held-out text is the checkpoint's run's data.
    data_set_by_user = overrides_data(list(hydra_cfg.overrides.task))
    with exit_on_input_error("eval.py", also=(TaskDataError,)):
        evaluate(typed, Path(hydra_cfg.runtime.output_dir), data_set_by_user=data_set_by_user)


if __name__ == "__main__":
    exit_on_unknown_key(sys.argv[1:], EvalConfig, "eval.py")
    main()
