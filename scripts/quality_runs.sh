#!/usr/bin/env bash
# Dense vs sparse quality at one model shape, same seed and data: train.py with l1=0, with each l1 of $L1S, and
# with l1=$REINIT_L1 plus dead-neuron re-initialisation (paper eq. 6, every $WINDOW steps); eval.py scores the
# final checkpoints side by side; scripts/compare_runs.py prints the training and quality tables and records them
# in docs/records/ (title from $TITLE; python scripts/bench_report.py adds them to docs/benchmarks.md). A SIGTERM stops every run at a checkpoint; re-running resumes unfinished
# runs from their last checkpoint and skips finished ones. PARALLEL=1 trains all runs at once (small models leave
# most of a large GPU idle). TASKS is eval.py's tasks= (none: held-out perplexity and sparsity only, for machines
# without lm-eval).
#   [STEPS=2000] [L1S="2e-5"] [REINIT_L1=<last of L1S>] [WINDOW=100] [PREFIX=quality] [PARALLEL=0] [TASKS=embedded] \
#     bash scripts/quality_runs.sh [train.py overrides...]
# The 91M-parameter runs of docs/benchmarks.md (five runs sharing one H100: about 10 minutes of training; data/docs
# from scripts/build_doc_corpus.py and scripts/tokenize_corpus.py):
#   STEPS=600 L1S="2e-5 2e-4 1e-3" PARALLEL=1 bash scripts/quality_runs.sh data=tokens 'data.paths=[data/docs.bin]' \
#     model.hidden_size=768 model.intermediate_size=2048 model.num_layers=12 model.num_heads=12 \
#     model.max_position_embeddings=512 trainer.global_batch=64 trainer.micro_batch=32 trainer.lr=1e-3 \
#     trainer.warmup_steps=100 checkpoint.every=0
# and at 99.6-99.7% sparsity with the L1 coefficient ramped in over the first 20% of the steps:
#   STEPS=600 L1S="2.5e-3 3e-3 4e-3" REINIT_L1=3e-3 PARALLEL=1 PREFIX=q91w bash scripts/quality_runs.sh <the same \
#     overrides> sparsity.l1_warmup_steps=120
set -euo pipefail
STEPS=${STEPS:-2000}
L1S=${L1S:-2e-5}
REINIT_L1=${REINIT_L1:-${L1S##* }}
WINDOW=${WINDOW:-100}
PREFIX=${PREFIX:-quality}
PARALLEL=${PARALLEL:-0}
TASKS=${TASKS:-embedded}
TITLE=${TITLE:-"Dense vs sparse training: quality at equal steps"}
COMMON=(trainer.max_steps=$STEPS logging.progress_bar=false logging.wandb=false checkpoint.resume=auto "$@")

# name and the train.py overrides of every run, in table order
RUNS=("${PREFIX}_dense|l1=0")
for l1 in $L1S; do RUNS+=("${PREFIX}_l1_${l1}|l1=${l1}"); done
RUNS+=("${PREFIX}_reinit_${REINIT_L1}|l1=${REINIT_L1} sparsity.reinit_dead=true sparsity.dead_window_steps=${WINDOW}")

train() {  # name, overrides (space-separated); output goes to outputs/<name>.log. Called with & only: exec
  local name=$1  # makes the background job's pid python's, so that the trap below signals train.py itself.
  # shellcheck disable=SC2086  # the overrides are several words
  exec python train.py "${COMMON[@]}" $2 run_name="$name" > "outputs/$name.log" 2>&1
}

mkdir -p outputs
if [ "$PARALLEL" = 1 ] && [ -z "${OMP_NUM_THREADS:-}" ]; then
  # Runs sharing the machine split its cores: each torch otherwise starts a thread per core, and on a CPU the
  # oversubscribed runs ran about ten times slower.
  threads=$(( $(nproc) / ${#RUNS[@]} ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi
# A SIGTERM to this script (timeout, a scheduler) reaches the runs, which save a checkpoint and stop; running
# the script again resumes them. Runs go to the background even one at a time: bash defers its traps until a
# foreground child exits.
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
failed=0
for run in "${RUNS[@]}"; do
  name=${run%%|*}
  [ -d "outputs/$name/final" ] && continue
  train "$name" "${run#*|}" & pids+=($!)
  if [ "$PARALLEL" != 1 ]; then
    wait "$!" || { tail -20 "outputs/$name.log"; exit 1; }
  fi
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ "$failed" = 0 ] || { echo "a run failed or was stopped: see outputs/${PREFIX}_*.log" >&2; exit 1; }

dirs=() finals=()
for run in "${RUNS[@]}"; do dirs+=("outputs/${run%%|*}") finals+=("outputs/${run%%|*}/final"); done
python eval.py checkpoint="${finals[0]}" "compare=[$(IFS=,; echo "${finals[*]:1}")]" tasks="$TASKS" \
  out="outputs/${PREFIX}_eval" logging.wandb=false
DEVICE=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
python scripts/compare_runs.py "${dirs[@]}" --eval "outputs/${PREFIX}_eval/results.json" \
  --title "$TITLE" \
  --note "$DEVICE. \`STEPS=$STEPS L1S=\"$L1S\" REINIT_L1=$REINIT_L1 WINDOW=$WINDOW bash scripts/quality_runs.sh $*\`; the reinit run also has sparsity.reinit_dead=true sparsity.dead_window_steps=$WINDOW. Held-out = the validation documents of the training data; never fired = share of FFN neurons with no non-zero on the held-out tokens."
