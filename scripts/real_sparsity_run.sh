#!/usr/bin/env bash
# A model at one of the paper's shapes with real activation sparsity, then the model-level benchmark on its
# checkpoint (the recipe of scripts/bench_model.py's docstring, in one command). Re-running resumes the
# training where it stopped, so it can be spread over several shorter GPU sessions.
#   [SIZE=2b] [L1=1e-4] [STEPS=300] [RUN=real_<size>] [BENCH_ARGS="--batch 8 --train-batch 2"] \
#     bash scripts/real_sparsity_run.sh [train.py overrides...]
# Watch l0/mean in outputs/$RUN/metrics.jsonl: raise L1 if it stays above ~40, lower it if it falls under ~24.
set -euo pipefail
SIZE=${SIZE:-2b}
L1=${L1:-1e-4}
STEPS=${STEPS:-300}
RUN=${RUN:-real_${SIZE}}
BENCH_ARGS=${BENCH_ARGS:-"--batch 8 --train-batch 2"}
[ -f data/embedded.bin ] || python scripts/tokenize_corpus.py --out data/embedded
if [ ! -d "outputs/$RUN/final" ]; then
  python train.py model="$SIZE" l1="$L1" data=tokens 'data.paths=[data/embedded.bin]' trainer.max_steps="$STEPS" \
    trainer.global_batch=16 trainer.micro_batch=4 trainer.warmup_steps=50 seed=0 run_name="$RUN" \
    checkpoint.every=50 checkpoint.resume=auto logging.wandb=false logging.progress_bar=false "$@"
fi
# shellcheck disable=SC2086  # BENCH_ARGS holds several options
python scripts/bench_model.py --checkpoint "outputs/$RUN/final" --tokens data/embedded $BENCH_ARGS --markdown BENCHMARKS.md
