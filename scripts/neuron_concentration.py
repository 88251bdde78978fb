"""How unevenly a model's FFN neurons fire, layer by layer (sparse_llm/bench/concentration.py).

    python scripts/neuron_concentration.py --checkpoint outputs/emb_2b/final --tokens data/embedded --batch 4
    python scripts/neuron_concentration.py --size tiny --density-l0 8 --batch 2 --seq-len 64 --device cpu  # smoke

One forward pass over --batch x --seq-len tokens (the token file's validation blocks with --tokens, else random ids).
Per layer: mean non-zeros per token (L0), the share of neurons that never fired, the share of the layer's non-zeros
carried by its top 1%, 5% and 10% of neurons (--top), and the neurons that fire for more than --dense-rate of the
tokens with their share; a last row counts all layers' neurons together. Random weights made sparse (--density-l0)
fire evenly; a trained model's hot neurons show here, which is what a dense side path for them would be sized by.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from sparse_llm.bench.arguments import add_forward_pass_options, check_forward_pass_options, forward_pass_settings
from sparse_llm.bench.concentration import concentration_row, neuron_fire_counts
from sparse_llm.bench.model_setup import model_and_batch
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.report import results_table


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_forward_pass_options(parser)
    parser.add_argument("--top", type=float, nargs="+", default=[0.01, 0.05, 0.1], help="fractions of the neurons")
    parser.add_argument(
        "--dense-rate",
        type=float,
        default=0.02,
        help="count the neurons that fire for more than this share of the tokens (a neuron's break-even between "
        "the sparse kernels and a dense side path is a few percent)",
    )
    args = parser.parse_args(argv)
    args.argv = list(argv)
    check_forward_pass_options(parser, args)
    if not all(0 < share <= 1 for share in args.top) or not 0 < args.dense_rate < 1:
        parser.error("--top takes fractions in (0, 1] and --dense-rate a fraction in (0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    model, input_ids = model_and_batch(
        device, **forward_pass_settings(args), vocab_size=args.vocab_size, seed=args.seed
    )
    if device.type == "cuda":
        model.to(torch.bfloat16)  # the kernels' gate GEMM is bf16: a pre-activation's sign as they see it
    counts_LN = neuron_fire_counts(model, input_ids)
    tokens = input_ids.numel()
    rows = [
        {"layer": layer, **concentration_row(counts_N, tokens, args.top, args.dense_rate)}
        for layer, counts_N in enumerate(counts_LN.cpu())
    ]
    rows.append(
        {"layer": "all", **concentration_row(counts_LN.cpu().flatten(), tokens, args.top, args.dense_rate, len(rows))}
    )
    print(f"{args.checkpoint or args.size}: {tokens} tokens, FFN width {counts_LN.shape[1]}")
    print("\n".join(results_table(rows)[0]))
    settings = forward_pass_settings(args)
    settings.update(top=args.top, dense_rate=args.dense_rate, seed=args.seed)
    write_record(args.record_dir, make_record("neuron_concentration", settings, rows, device, args.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
