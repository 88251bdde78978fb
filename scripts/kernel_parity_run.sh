#!/usr/bin/env bash
# Train the same small model from the same seed with kernel=torch and kernel=twell and compare the losses.
#   [STEPS=300] bash scripts/kernel_parity_run.sh [extra overrides...]       (needs a Hopper GPU + CuPy)
set -euo pipefail
STEPS=${STEPS:-300}
COMMON=(model.hidden_size=1024 model.intermediate_size=2816 model.num_layers=4 model.num_heads=16
        model.max_position_embeddings=1024 l1=1e-4 trainer.max_steps=$STEPS trainer.global_batch=16
        trainer.micro_batch=16 trainer.warmup_steps=20 trainer.lr=1e-3 trainer.val_every=0
        logging.every=25 logging.progress_bar=false logging.wandb=false checkpoint.every=0 "$@")
python train.py "${COMMON[@]}" kernel=torch run_name=parity_torch
python train.py "${COMMON[@]}" kernel=twell run_name=parity_twell
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0))")
python scripts/compare_runs.py outputs/parity_torch outputs/parity_twell \
  --title "Training with the sparse kernels vs the dense path: loss parity" \
  --note "$GPU, bf16 autocast, same seed and data, ${COMMON[*]}."
