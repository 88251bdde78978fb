#!/usr/bin/env bash
# Sparsifying a dense model against training a sparse one from scratch, at one shape, on the same data and seed:
#   dense       the paper's SiLU baseline (model.hidden_act=silu, no L1 term), N steps
#   sparsified  the dense model's final weights, gate swapped to ReLU, M more steps with the L1 term ramped in along a
#               sine over the first half (init=<dense final> recipe=sparsify)
#   scratch     a sparse ReLU model trained from random weights for N + M steps (the same number of steps as
#               dense + sparsified), with its L1 term ramped in over the first 20% (what README's 91M runs found best)
# The scratch run trains beside the dense -> sparsified pair (two runs share the GPU). Then eval.py scores the two
# sparse final models (held-out CE, per-layer sparsity, the TASKS benchmarks), and scripts/sparsify_table.py prints
# the three side by side and writes them as a record into docs/records/ (docs/benchmarks.md).
#   [N=500] [M=700] [MODEL=91m] [L1=1e-3] [TASKS=embedded] [PREFIX=spx] [DATA="data=... ..."] \
#     bash scripts/sparsify_experiment.sh [train.py overrides for all three runs...]
# The defaults took 5.5 minutes on one H100, evaluation included (docs/training.md, "Sparsifying a dense model").
# DATA defaults to the documentation corpus (data/docs.bin, scripts/build_doc_corpus.py) where present, else the
# shipped corpus (data=embedded, about 0.4 M tokens: N + M steps of 32 k tokens repeat it many times, so held-out CE
# then also measures memorisation). TASKS=none skips the benchmarks (for machines without lm-eval). Re-running skips
# finished runs and resumes unfinished ones from their checkpoints.
set -euo pipefail
N=${N:-500}
M=${M:-700}
MODEL=${MODEL:-91m}
L1=${L1:-1e-3}
TASKS=${TASKS:-embedded}
PREFIX=${PREFIX:-spx}
if [ -z "${DATA+set}" ]; then
  if [ -f data/docs.bin ]; then DATA="data=tokens data.paths=[data/docs.bin]"; else DATA="data=embedded"; fi
fi
TOTAL=$((N + M))
# shellcheck disable=SC2206  # DATA is several words
COMMON=(model="$MODEL" $DATA logging.progress_bar=false logging.wandb=false checkpoint.resume=auto "$@")
DENSE=${PREFIX}_dense SPARSIFIED=${PREFIX}_sparsified SCRATCH=${PREFIX}_scratch

train() {  # run name, then its own overrides; output goes to outputs/<name>.log
  local name=$1
  shift
  [ -d "outputs/$name/final" ] && return 0
  python train.py "${COMMON[@]}" "$@" run_name="$name" > "outputs/$name.log" 2>&1 \
    || { tail -20 "outputs/$name.log" >&2; return 1; }
}

mkdir -p outputs
train "$SCRATCH" l1="$L1" trainer.max_steps=$TOTAL sparsity.l1_warmup_steps=$((TOTAL / 5)) & scratch_pid=$!
train "$DENSE" model.hidden_act=silu trainer.max_steps="$N"
train "$SPARSIFIED" init="outputs/$DENSE/final" recipe=sparsify l1="$L1" trainer.max_steps="$M" \
  sparsity.l1_warmup_steps=$((M / 2))
wait "$scratch_pid"

python eval.py checkpoint="outputs/$SPARSIFIED/final" "compare=[outputs/$SCRATCH/final]" tasks="$TASKS" \
  out="outputs/${PREFIX}_eval" logging.wandb=false

python scripts/sparsify_table.py --prefix "$PREFIX" --n "$N" --m "$M" --l1 "$L1" --model "$MODEL" --data "$DATA"
