"""Regenerate docs/benchmarks.md from the benchmark records in docs/records/ (sparse_llm/bench/report.py).

    python scripts/bench_report.py            # rewrite docs/benchmarks.md
    python scripts/bench_report.py --check    # exit 1 if docs/benchmarks.md is not what the records give

Each benchmark script writes one record per run (`--record-dir`); commit the records you want to keep, then run
this. For each benchmark, GPU and set of settings the newest record is shown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sparse_llm.bench.records import DEFAULT_RECORD_DIR, read_records
from sparse_llm.bench.report import render_benchmarks

DEFAULT_OUT = "docs/benchmarks.md"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record-dir", default=DEFAULT_RECORD_DIR, help=f"the records (default {DEFAULT_RECORD_DIR})")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the markdown file (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if --out differs")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    record_dir, out = Path(args.record_dir), Path(args.out)
    if not record_dir.is_dir():
        parser.error(f"--record-dir {record_dir}: no such directory; run from the repository root or pass it")
    try:
        text = render_benchmarks(read_records(record_dir))
    except (ValueError, KeyError) as exc:
        parser.error(f"--record-dir {record_dir}: unreadable record ({type(exc).__name__}: {exc}); fix or remove it")
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is out of date: run python scripts/bench_report.py", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} from {record_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
