#!/usr/bin/env bash
# Loss parity of the sparse training path: one model trained from each seed of SEEDS with kernel=torch and with
# KERNEL (auto, the default: each layer moves to the sparse op once it is the cheaper path; twell: every layer on it
# from the first step). Then scripts/compare_runs.py per seed (KERNEL's loss against the dense run's, step by step)
# and over all runs (each configuration's spread across seeds, and the gap of the means with its standard error).
#   [STEPS=300] [SEEDS="0 1 2"] [KERNEL=auto] [L1=5e-4] [DATA="data=..."] \
#     bash scripts/kernel_parity_run.sh [train.py overrides for every run...]          (needs a Hopper GPU + CuPy)
# The model has 4 layers of the 1B/2B layer shape (hidden 2048, FFN 5632; about 240M parameters with the shipped
# 8192-token vocabulary) and trains on 8 x 2048 tokens a step: at that shape and micro-batch the sparse op is the
# cheaper path for a sparse layer, so auto's layers start dense and switch during the run (train.py logs each switch
# with its step, in outputs/<run>.log). DATA defaults to the documentation corpus (data/docs.bin) where present, else
# the shipped corpus.
set -euo pipefail
STEPS=${STEPS:-300}
SEEDS=${SEEDS:-"0 1 2"}
KERNEL=${KERNEL:-auto}
L1=${L1:-5e-4}
if [ -z "${DATA+set}" ]; then
  if [ -f data/docs.bin ]; then DATA="data=tokens data.paths=[data/docs.bin]"; else DATA="data=embedded"; fi
fi
# shellcheck disable=SC2206  # DATA is several words
COMMON=(model.hidden_size=2048 model.intermediate_size=5632 model.num_layers=4 model.num_heads=16
        model.max_position_embeddings=2048 $DATA l1="$L1" sparsity.l1_warmup_steps=50 trainer.max_steps="$STEPS"
        trainer.global_batch=8 trainer.micro_batch=8 trainer.seq_len=2048 trainer.warmup_steps=20 trainer.lr=1e-3
        trainer.val_every=0 logging.every=10 logging.progress_bar=false logging.wandb=false checkpoint.every=0 "$@")
mkdir -p outputs
runs=()
for seed in $SEEDS; do
  for kernel in torch "$KERNEL"; do
    name=parity_${kernel}_r$seed
    [ -d "outputs/$name/final" ] || python train.py "${COMMON[@]}" kernel="$kernel" seed="$seed" run_name="$name" \
      > "outputs/$name.log" 2>&1 || { tail -20 "outputs/$name.log" >&2; exit 1; }
  done
  grep -h "changed backend" "outputs/parity_${KERNEL}_r$seed.log" || echo "seed $seed: no layer changed backend"
  runs+=("outputs/parity_torch_r$seed" "outputs/parity_${KERNEL}_r$seed")
done
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
NOTE="$GPU, bf16 autocast, same seed and data per pair, ${COMMON[*]}"
for seed in $SEEDS; do
  python scripts/compare_runs.py "outputs/parity_torch_r$seed" "outputs/parity_${KERNEL}_r$seed" \
    --title "Loss parity, kernel=$KERNEL against kernel=torch, seed $seed" --note "$NOTE."
done
python scripts/compare_runs.py "${runs[@]}" --title "Loss parity, kernel=$KERNEL against kernel=torch, seeds $SEEDS" \
  --note "$NOTE."
