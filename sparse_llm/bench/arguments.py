"""Command-line options that several benchmark scripts share, and their usage checks (exit code 2 via
`parser.error`, before any model is loaded)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sparse_llm.bench.model_setup import SIZES
from sparse_llm.bench.records import DEFAULT_RECORD_DIR
from sparse_llm.checks.errors import UserInputError
from sparse_llm.data.pipeline import read_token_file

GRAPH_WARMUP_STEPS = 2  # calls before torch.compile's CUDA graphs replay: one eager, one recording


def add_record_dir(parser: argparse.ArgumentParser) -> None:
    """--record-dir: where the run's JSON record goes (`records.write_record`)."""
    parser.add_argument(
        "--record-dir",
        default=DEFAULT_RECORD_DIR,
        help=f"write the run's JSON record here (default {DEFAULT_RECORD_DIR}; scripts/bench_report.py turns the "
        "records into docs/benchmarks.md)",
    )


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """--checkpoint or --size (with --vocab-size): the model `model_setup.load_model` builds."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a model directory in HF layout (a run's final/)")
    source.add_argument("--size", choices=SIZES, help="a random-init model of configs/model/<size>.yaml")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the size's vocabulary")


def check_model_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before any model is loaded: a --checkpoint that is not a model directory, or one given with
    --density-l0 (which only random-init models take)."""
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        parser.error(
            f"--checkpoint {args.checkpoint}: not a model directory (no config.json); pass a run's final/ or "
            "checkpoints/step_N/model directory"
        )
    if args.density_l0 is not None and args.checkpoint:
        parser.error("--density-l0 makes random-init models sparse; a checkpoint has its own sparsity (drop it)")


def add_token_source(parser: argparse.ArgumentParser) -> None:
    """--tokens: a token file whose validation blocks are the inputs (`model_setup.make_inputs`)."""
    parser.add_argument(
        "--tokens",
        default=None,
        help="token-file prefix (scripts/tokenize_corpus.py) for the inputs (default: uniform random ids)",
    )


def check_token_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage error for a --tokens file that is missing or damaged (read_token_file's own checks), before any model
    is loaded."""
    if not args.tokens:
        return
    try:
        read_token_file(args.tokens)
    except FileNotFoundError:
        parser.error(
            f"--tokens {args.tokens}: no token file there (.bin and .json); write one with scripts/tokenize_corpus.py"
        )
    except UserInputError as error:
        parser.error(f"--tokens {args.tokens}: {error}")


def check_cuda_graphs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of --cuda-graphs: it replays the compiled layers (not with --grad-ckpt, as trainer.cuda_graphs)
    on a CUDA GPU, and the untimed steps must cover what precedes the replays: each compiled part runs eagerly on its
    first call and is recorded on its second (the second micro-batch; with one micro-batch a step, the second step),
    which a timed step would measure."""
    if not args.cuda_graphs:
        return
    if not args.compile:
        parser.error("--cuda-graphs replays the compiled layers: add --compile")
    if getattr(args, "grad_ckpt", False):
        parser.error("--cuda-graphs is not supported with --grad-ckpt (as trainer.cuda_graphs)")
    if args.warmup < GRAPH_WARMUP_STEPS:
        parser.error(
            f"--cuda-graphs needs --warmup {GRAPH_WARMUP_STEPS} or more: the first step runs the compiled layers "
            "eagerly and the second call records their graphs, which a timed step would measure"
        )
    if torch.device(args.device).type != "cuda":
        parser.error(f"--cuda-graphs needs a CUDA GPU (--device {args.device})")


def add_forward_pass_options(parser: argparse.ArgumentParser) -> None:
    """The options of a script that studies one forward pass of a model (`model_setup.model_and_batch`): the model
    (--checkpoint, or --size made sparse by --density-l0), its inputs (--tokens, --batch, --seq-len), --seed and
    --device, and --record-dir."""
    add_model_source(parser)
    parser.add_argument("--density-l0", type=float, default=None, help="random-init models: mean non-zeros per token")
    add_token_source(parser)
    parser.add_argument("--batch", type=int, default=4, help="sequences in the forward pass")
    parser.add_argument("--seq-len", type=int, default=2048)
    add_record_dir(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def check_forward_pass_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of `add_forward_pass_options`' options; fills in the default device."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_model_source(parser, args)
    check_token_source(parser, args)
    if args.batch < 1 or args.seq_len < 1:
        parser.error("--batch and --seq-len must be positive")


FORWARD_PASS_SETTINGS = ("checkpoint", "size", "density_l0", "tokens", "batch", "seq_len")


def forward_pass_settings(args: argparse.Namespace) -> dict[str, object]:
    """The model and inputs of `add_forward_pass_options`, by name: a record's first settings, and (with vocab_size
    and seed) `model_setup.model_and_batch`'s arguments."""
    return {name: getattr(args, name) for name in FORWARD_PASS_SETTINGS}
