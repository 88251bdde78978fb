"""Whether a dense side path for each layer's hot neurons would speed up the sparse training op
(sparse_llm/bench/hot_split.py): per layer, on the layer's real FFN inputs, forward + backward with the L1 term of the
block dense, through the sparse op, and split into the sparse op on the cold neurons plus a dense block of the H most
often firing ones.

    python scripts/bench_hot_split.py --checkpoint outputs/emb_2b/final --tokens data/embedded --batch 4
    python scripts/bench_hot_split.py --size tiny --density-l0 8 --batch 2 --seq-len 64 --hot 16 64 --device cpu

The inputs are one forward pass over --batch x --seq-len tokens (--tokens: the token file's validation blocks, else
random ids). A last row sums the layers (one micro-batch): today_ms takes each layer's fastest of the dense path and
the sparse op, best_ms the splits as well. The split works on copies of the weight rows, made once: what a side path
built into the op could reach, not what one costs. bf16 on a GPU (the op's kernels), float32 on the CPU (the op's
torch reference).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from sparse_llm.bench.arguments import add_forward_pass_options, check_forward_pass_options, forward_pass_settings
from sparse_llm.bench.hot_split import layer_inputs, layer_weights, measure_layer, total_row
from sparse_llm.bench.model_setup import decoder_layers, model_and_batch
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.report import results_table


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_forward_pass_options(parser)
    parser.add_argument(
        "--hot",
        type=int,
        nargs="+",
        default=[256, 512, 1024],
        help="sizes H of the hot set (a few fixed sizes: each is one more shape for the kernels to compile)",
    )
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices (default: all)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    args.argv = list(argv)
    check_forward_pass_options(parser, args)
    if args.reps < 1 or any(h < 1 for h in args.hot):
        parser.error("--reps and --hot take counts >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    model, input_ids = model_and_batch(
        device, **forward_pass_settings(args), vocab_size=args.vocab_size, seed=args.seed
    )
    n_layers, n = len(decoder_layers(model)), model.config.intermediate_size
    layers = args.layers if args.layers is not None else list(range(n_layers))
    # on a GPU the kernels run the cold neurons' block: N - H a multiple of 256 (sparse_llm/ffn/twell/validation.py)
    step = 256 if device.type == "cuda" else 1
    bad = [i for i in layers if not 0 <= i < n_layers] + [h for h in args.hot if h >= n or (n - h) % step]
    if bad:
        print(
            f"bench_hot_split.py: --layers must lie in [0, {n_layers}) and --hot below N = {n}, with N - H a multiple "
            f"of {step}: {bad}",
            file=sys.stderr,
        )
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = layer_inputs(model, input_ids, layers, dtype)
    rows = []
    for index in layers:
        row = {
            "layer": index,
            **measure_layer(
                inputs.pop(index),
                layer_weights(model, index, dtype),
                args.hot,
                args.reps,
                compiled=device.type == "cuda",
            ),
        }
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    rows.append(total_row(rows))
    print(f"{args.checkpoint or args.size}: {input_ids.numel()} tokens per layer call, FFN width {n}")
    print("\n".join(results_table(rows)[0]))
    settings = forward_pass_settings(args)
    settings.update(hot=args.hot, layers=args.layers, reps=args.reps, dtype=str(dtype).removeprefix("torch."))
    write_record(args.record_dir, make_record("bench_hot_split", settings, rows, device, args.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
