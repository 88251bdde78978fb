"""Sample text from a trained checkpoint.

    python generate.py                                        # newest outputs/*/final, prompt "The"
    python generate.py checkpoint=outputs/<run>/final prompts="def main(" max_new_tokens=100
    python generate.py prompts="[The kernel,A list is]" temperature=0   # two prompts, greedy
    python generate.py --cfg job                              # print the resolved config

Keys and their meaning: sparse_llm/generation/config.py (GenerateConfig). Prints each prompt with its continuation,
then the decoding speed and the FFN path each layer took. Input errors (missing checkpoint, bad option, a
prompt longer than the context) print one message and exit with code 2; HYDRA_FULL_ERROR=1 shows the full traceback
instead (sparse_llm/checks/errors.py).
"""

import sys

from sparse_llm.cli import env

env.apply_defaults(sys.argv[1:])  # before transformers is imported: it reads the offline setting at import

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from sparse_llm.checks.errors import exit_on_input_error  # noqa: E402
from sparse_llm.cli.overrides import exit_on_unknown_key  # noqa: E402
from sparse_llm.ffn.kernel_choice import validate_kernel  # noqa: E402
from sparse_llm.generation.config import GenerateConfig, register_generate_configs  # noqa: E402

register_generate_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    typed: GenerateConfig = OmegaConf.to_object(cfg)
    with exit_on_input_error("generate.py"):
        validate_kernel(typed.kernel)  # named before torch loads (generate checks it again)
        # Imported once the config is valid, so that --help and config errors need no torch (docs/design.md).
        from sparse_llm.generation.generate import generate, report

        result = generate(typed)
    print(report(result), flush=True)


if __name__ == "__main__":
    exit_on_unknown_key(sys.argv[1:], GenerateConfig, "generate.py")
    main()
