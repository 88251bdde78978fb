#!/usr/bin/env bash
# Loss parity and throughput scaling of one GPU vs DDP vs FSDP at the same global batch, on the dense path and on the
# sparse training kernels, each run several times, then a resume under each.
#   [STEPS=200] [REPEATS=3] [KERNELS="torch twell"] [WARM_STEPS=200] [WARM_L1=5e-4] [LOG_EVERY=25] [RESUME=1] \
#     bash scripts/multi_gpu_check.sh [extra overrides...]                                          (>= 2 GPUs)
# The sparse kernels pay only on sparse layers, so every compared run starts from one warm start: the 0.5B shape
# trained on one GPU to the paper's sparsity (outputs/mgpu_warm, kept between invocations), passed as init=.
# Run directories: outputs/mgpu_<kernel>_{one,ddp,fsdp}_r<k> and outputs/mgpu_<kernel>_{ddp,fsdp}_resumed; the tables
# are printed and recorded in docs/records/ (python scripts/bench_report.py adds them to docs/benchmarks.md).
# Dense-path launches on 2x H100 spent 40-70 s starting and saving checkpoints beyond their steps (one GPU ~114k
# tokens/s, DDP ~213k, FSDP ~235k at 32k tokens a step).
#
# Why repeats: identical runs do not end at identical losses on the GPU, and a short high-learning-rate run on a
# small corpus amplifies the differences (seven identical 1-GPU runs of 200 steps ended at 1.03-1.15 on an H100).
# compare_runs.py gives each configuration's mean final loss, its standard deviation, and the gap of its mean to one
# GPU's with the standard error of that gap.
set -euo pipefail
STEPS=${STEPS:-200}
REPEATS=${REPEATS:-3}
KERNELS=${KERNELS:-"torch twell"}
WARM=outputs/mgpu_warm
LAUNCH=(accelerate launch --num_processes 2 --num_machines 1)
SHAPE=(model=0.5b trainer.global_batch=16 trainer.micro_batch=8 trainer.val_every=0 logging.progress_bar=false
       logging.wandb=false)

if [ ! -d "$WARM/final" ]; then
  CUDA_VISIBLE_DEVICES=0 python train.py "${SHAPE[@]}" l1="${WARM_L1:-5e-4}" trainer.max_steps="${WARM_STEPS:-200}" \
    trainer.warmup_steps=20 sparsity.l1_warmup_steps=40 checkpoint.every=0 run_name=mgpu_warm
fi
COMMON=("${SHAPE[@]}" init="$WARM/final" l1=2e-5 trainer.max_steps="$STEPS" trainer.warmup_steps=20
        logging.every="${LOG_EVERY:-25}" checkpoint.every=$((STEPS / 2)) "$@")
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0))")

for kernel in $KERNELS; do
  prefix=outputs/mgpu_${kernel}
  # Start from empty run directories: a leftover run would be resumed or mixed into the comparison.
  rm -rf "${prefix}"_one_r* "${prefix}"_ddp_r* "${prefix}"_fsdp_r* "${prefix}"_*_resumed
  ONE=() DDP=() FSDP=()
  for k in $(seq "$REPEATS"); do  # interleaved, so that a change in the machine's state over time reaches all three
    CUDA_VISIBLE_DEVICES=0 python train.py "${COMMON[@]}" kernel="$kernel" run_name="mgpu_${kernel}_one_r$k"
    "${LAUNCH[@]}" --config_file configs/accelerate/ddp.yaml train.py "${COMMON[@]}" kernel="$kernel" \
      run_name="mgpu_${kernel}_ddp_r$k"
    "${LAUNCH[@]}" --config_file configs/accelerate/fsdp.yaml train.py "${COMMON[@]}" kernel="$kernel" \
      run_name="mgpu_${kernel}_fsdp_r$k"
    ONE+=("${prefix}_one_r$k") DDP+=("${prefix}_ddp_r$k") FSDP+=("${prefix}_fsdp_r$k")
  done
  RUNS=("${ONE[@]}" "${DDP[@]}" "${FSDP[@]}")
  if [ "${RESUME:-1}" = 1 ]; then
    # Resume the first DDP and FSDP runs from their mid-run checkpoints into copies: the last steps must reproduce.
    for mode in ddp fsdp; do
      mkdir -p "${prefix}_${mode}_resumed/checkpoints"
      cp -r "${prefix}_${mode}_r1/checkpoints/step_$((STEPS / 2))" "${prefix}_${mode}_resumed/checkpoints/"
      "${LAUNCH[@]}" --config_file "configs/accelerate/${mode}.yaml" train.py "${COMMON[@]}" kernel="$kernel" \
        run_name="mgpu_${kernel}_${mode}_resumed" checkpoint.resume=auto
      RUNS+=("${prefix}_${mode}_resumed")
    done
  fi
  python scripts/compare_runs.py "${RUNS[@]}" --title "Multi-GPU training, kernel=$kernel: 1 GPU vs DDP vs FSDP" \
    --note "2x $GPU, bf16, kernel=$kernel, ${COMMON[*]}; $REPEATS runs of each configuration; the *_resumed runs \
restarted r1 from step $((STEPS / 2))."
done
