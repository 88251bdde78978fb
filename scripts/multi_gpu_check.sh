#!/usr/bin/env bash
# Loss parity and throughput scaling of one GPU vs DDP vs FSDP at the same global batch, each run several times, then
# an FSDP resume.
#   [STEPS=300] [REPEATS=3] [LOG_EVERY=25] [RESUME=1] bash scripts/multi_gpu_check.sh [extra overrides...]  (>= 2 GPUs)
# Run directories: outputs/mgpu_{one,ddp,fsdp}_r<k> and outputs/mgpu_fsdp_resumed; the tables are printed and
# recorded in docs/records/ (python scripts/bench_report.py adds them to docs/benchmarks.md).
# Duration on 2x H100: each launch spends 40-70 s starting and saving checkpoints beyond its steps (one GPU ~114k
# tokens/s, DDP ~213k, FSDP ~235k at 32k tokens a step), so the defaults take about 20 minutes; with STEPS=40
# REPEATS=2 the six runs and the resume to its last steps took 9.3 minutes.
#
# Why repeats: identical runs do not end at identical losses on the GPU, and this short high-learning-rate run on a
# small corpus amplifies the differences (seven identical 1-GPU runs of 200 steps ended at 1.03-1.15 on an H100). A single run's gap says little; compare_runs.py gives each configuration's mean final loss, its
# standard deviation, and the gap of its mean to one GPU's with the standard error of that gap.
set -euo pipefail
STEPS=${STEPS:-300}
REPEATS=${REPEATS:-3}
COMMON=(model=0.5b l1=2e-5 trainer.max_steps=$STEPS trainer.global_batch=16 trainer.micro_batch=8
        trainer.warmup_steps=30 trainer.val_every=0 logging.every=${LOG_EVERY:-25} logging.progress_bar=false
        logging.wandb=false checkpoint.every=$((STEPS / 2)) "$@")
LAUNCH=(accelerate launch --num_processes 2 --num_machines 1)
# Start from empty run directories: a leftover run would be resumed or mixed into the comparison.
rm -rf outputs/mgpu_one_r* outputs/mgpu_ddp_r* outputs/mgpu_fsdp_r* outputs/mgpu_fsdp_resumed

ONE=() DDP=() FSDP=()
for k in $(seq "$REPEATS"); do  # interleaved, so that a change in the machine's state over time reaches all three
  CUDA_VISIBLE_DEVICES=0 python train.py "${COMMON[@]}" run_name=mgpu_one_r$k
  "${LAUNCH[@]}" --config_file configs/accelerate/ddp.yaml train.py "${COMMON[@]}" run_name=mgpu_ddp_r$k
  "${LAUNCH[@]}" --config_file configs/accelerate/fsdp.yaml train.py "${COMMON[@]}" run_name=mgpu_fsdp_r$k
  ONE+=(outputs/mgpu_one_r$k) DDP+=(outputs/mgpu_ddp_r$k) FSDP+=(outputs/mgpu_fsdp_r$k)
done
RUNS=("${ONE[@]}" "${DDP[@]}" "${FSDP[@]}")
if [ "${RESUME:-1}" = 1 ]; then
  # Resume the first FSDP run from its mid-run checkpoint into a copy and check it reproduces the last steps.
  mkdir -p outputs/mgpu_fsdp_resumed/checkpoints
  cp -r "outputs/mgpu_fsdp_r1/checkpoints/step_$((STEPS / 2))" outputs/mgpu_fsdp_resumed/checkpoints/
  "${LAUNCH[@]}" --config_file configs/accelerate/fsdp.yaml train.py "${COMMON[@]}" run_name=mgpu_fsdp_resumed \
    checkpoint.resume=auto
  RUNS+=(outputs/mgpu_fsdp_resumed)
fi

GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0))")
python scripts/compare_runs.py "${RUNS[@]}" --title "Multi-GPU training: 1 GPU vs DDP vs FSDP" \
  --note "2x $GPU, bf16, ${COMMON[*]}; $REPEATS runs of each configuration; mgpu_fsdp_resumed (if run): mgpu_fsdp_r1 restarted from step $((STEPS / 2))."
