#!/usr/bin/env bash
# Dense vs sparse quality at one model shape, same seed and data: train.py with l1=0, with l1=$L1, and with
# l1=$L1 plus dead-neuron re-initialisation (paper eq. 6, every $WINDOW steps); eval.py scores the three
# final checkpoints side by side; scripts/compare_runs.py appends the training and quality tables to
# BENCHMARKS.md (title from $TITLE).
#   [STEPS=2000] [L1=2e-5] [WINDOW=100] [PREFIX=quality] bash scripts/quality_runs.sh [train.py overrides...]
# A 91M-parameter model on one GPU (not yet run; three runs of 3000 steps: size STEPS to the device time):
#   STEPS=3000 bash scripts/quality_runs.sh model.hidden_size=768 model.intermediate_size=2048 \
#     model.num_layers=12 model.num_heads=12 model.max_position_embeddings=512 trainer.global_batch=64 \
#     trainer.micro_batch=64 trainer.lr=1e-3 trainer.warmup_steps=200
set -euo pipefail
STEPS=${STEPS:-2000}
L1=${L1:-2e-5}
WINDOW=${WINDOW:-100}
PREFIX=${PREFIX:-quality}
TITLE=${TITLE:-"Dense vs sparse training: quality at equal steps"}
COMMON=(trainer.max_steps=$STEPS logging.progress_bar=false logging.wandb=false "$@")
python train.py "${COMMON[@]}" l1=0 run_name="${PREFIX}_dense"
python train.py "${COMMON[@]}" l1="$L1" run_name="${PREFIX}_sparse"
python train.py "${COMMON[@]}" l1="$L1" sparsity.reinit_dead=true sparsity.dead_window_steps="$WINDOW" \
  run_name="${PREFIX}_reinit"
python eval.py checkpoint="outputs/${PREFIX}_dense/final" \
  "compare=[outputs/${PREFIX}_sparse/final,outputs/${PREFIX}_reinit/final]" out="outputs/${PREFIX}_eval" \
  logging.wandb=false
DEVICE=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
python scripts/compare_runs.py "outputs/${PREFIX}_dense" "outputs/${PREFIX}_sparse" "outputs/${PREFIX}_reinit" \
  --eval "outputs/${PREFIX}_eval/results.json" --markdown BENCHMARKS.md --title "$TITLE" \
  --note "$DEVICE. \`STEPS=$STEPS L1=$L1 WINDOW=$WINDOW bash scripts/quality_runs.sh $*\`; the sparse runs use l1=$L1, the reinit run also sparsity.reinit_dead=true sparsity.dead_window_steps=$WINDOW. Held-out = the validation documents of the training data; never fired = share of FFN neurons with no non-zero on the held-out tokens."
