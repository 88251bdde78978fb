"""Benchmark one gated MLP block for training (forward + backward with the L1 term): dense torch autograd
(eager, and compiled with inductor as `trainer.compile=true` runs it) vs the sparse training op
(sparse_llm.ffn.twell.train_op), on one GPU.

    python scripts/bench_train_mlp.py                       # paper shapes, all density cases (H100: minutes)
    python scripts/bench_train_mlp.py --m 4096 --cases u28 h60 --out train.jsonl

Per case: one step is the forward, then the backward from a fixed upstream gradient dy (bf16 [M, K], as the
layer above hands it down) and the L1 term's coeff / M on l1_sum (the trainer's L1 term for one layer), so the
time is the block's alone (no loss computed around it). Reported: median ms of forward+backward (CUDA events
after warm-up) for dense bf16 autograd and for the op, back to back (the host issues ahead, as in a model:
the ratio is taken on these) and as isolated calls (each waited for, so the host's latency to the first kernel
is included), host wall-clock ms per step of back-to-back steps, forward-only ms, peak memory above the
inputs and weights during forward+backward and the memory held between forward and backward (the saved
activations), relative errors of y and the four gradients vs an fp32 dense reference (dense bf16 beside
them), the tokens' gate non-zeros (mean / p99 / max) and the tokens computed as dense backup rows, and what
`kernel=auto` runs with the training kernels allowed (train.py's train_kernels=true; the layer's dispatcher, eager
layers, given the block's mean and max non-zeros) with its ratio to the dense path. Sparsity
is controlled with `synthetic_block` (a constant input feature with a negative gate weight; sigma > 0 scales
tokens log-normally for heavy tails).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sparse_llm.bench import train_block
from sparse_llm.bench.arguments import add_record_dir
from sparse_llm.bench.records import make_record, write_record


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--k", type=int, default=2048, help="hidden width")
    parser.add_argument("--n", type=int, default=5632, help="FFN width")
    train_block.add_options(parser)
    add_record_dir(parser)
    args = parser.parse_args(argv)
    rows = train_block.run_cases(args.m, args.k, args.n, args.cases, args.reps, args.out)
    settings = {"m": args.m, "k": args.k, "n": args.n, "cases": args.cases, "reps": args.reps}
    write_record(args.record_dir, make_record("bench_train_mlp", settings, rows, "cuda", argv))


if __name__ == "__main__":
    main()
