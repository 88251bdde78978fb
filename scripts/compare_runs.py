"""Compare training runs side by side from their metrics.jsonl: loss parity and throughput (and quality).

    python scripts/compare_runs.py outputs/one_gpu outputs/ddp outputs/fsdp [--title ... --note ...]
    python scripts/compare_runs.py outputs/dense outputs/sparse --eval outputs/eval/<time>/results.json

The first run is the baseline: the table shows each run's final loss, the largest loss gap to the baseline
over the steps both logged, steady-state tokens/s (median over logging windows after the first, which holds
start-up; the median also ignores windows that include a checkpoint write) and its ratio to the baseline,
peak memory and energy per token. With --eval (an eval.py results.json that scored the runs' final/
checkpoints) a second table gives each run's held-out CE and its gap to the baseline, perplexity, L0,
sparsity, the share of neurons that never fired on the held-out text, the dead-neuron fraction of the last
training window, and the task accuracies.

Repeats of one configuration are named <configuration>_r<k> (outputs/ddp_r1, outputs/ddp_r2, ...). Where any
configuration has several, a third table gives each configuration's final loss as mean, standard deviation and
range, and the gap of its mean to the first configuration's with the standard error of that gap: identical GPU runs
do not end at identical losses, so a single run's gap says little until it is read against that spread.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sparse_llm.bench.arguments import add_record_dir
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.run_comparison import quality_rows, quality_table, spread_table, summaries, table
from sparse_llm.checks.errors import exit_on_input_error


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the baseline")
    parser.add_argument("--title", default="Run comparison", help="what the runs compare, kept in the record")
    parser.add_argument("--note", default="", help="hardware and settings of the runs, kept in the record")
    parser.add_argument("--eval", type=Path, help="eval.py results.json that scored the runs' final/ checkpoints")
    add_record_dir(parser)
    args = parser.parse_args(argv)
    # A run directory without metrics, or an unreadable results.json: one line and exit code 2
    with exit_on_input_error("compare_runs.py"):
        text = table(args.runs)
        spread = spread_table(args.runs)
        if spread is not None:
            text += "\n\n" + spread
        quality = []
        if args.eval:
            text += "\n\n" + quality_table(args.runs, args.eval)
            quality = quality_rows(args.runs, args.eval)
        print(text)
        rows = summaries(args.runs)
        settings = {
            "title": args.title,
            "note": args.note,
            "runs": [str(run) for run in args.runs],
            "eval": str(args.eval) if args.eval else None,
        }
        # The runs' GPUs are in their own metrics and the note: this process only reads files.
        write_record(args.record_dir, make_record("compare_runs", settings, rows, "cpu", argv, quality=quality))


if __name__ == "__main__":
    main()
