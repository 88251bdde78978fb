"""Benchmark one gated MLP block for training (forward + backward with the L1 term): dense torch autograd
(eager, and compiled with inductor as `trainer.compile=true` runs it) vs the sparse training op
(sparse_llm.ffn.twell.train_op), on one GPU.

    python scripts/bench_train_mlp.py                       # paper shapes, all density cases (H100: minutes)
    python scripts/bench_train_mlp.py --m 4096 --cases u28 h60 --out train.jsonl

What a case measures and reports: sparse_llm/bench/train_block.py.
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
