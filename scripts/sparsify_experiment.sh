#!/usr/bin/env bash
# Sparsifying a dense model against training a sparse one from scratch, at one shape, on the same data and seed:
#   dense       the paper's SiLU baseline (model.hidden_act=silu, no L1 term), N steps
#   sparsified  the dense model's final weights, gate swapped to ReLU, M more steps with the L1 term ramped in along a
#               sine over the first half (init=<dense final> recipe=sparsify)
#   scratch     a sparse ReLU model trained from random weights for N + M steps (the same number of steps as
#               dense + sparsified), with its L1 term ramped in over the first 20% (what README's 91M runs found best)
# The scratch run trains beside the dense -> sparsified pair (two runs share the GPU). Then eval.py scores the two
# sparse final models (held-out CE, per-layer sparsity, the TASKS benchmarks) and a table compares the three:
# train.py's last validation CE (the same validation batches in every run), eval.py's held-out CE, sparsity, mean and
# largest L0 per token, the last training window's dead fraction, never-fired neurons and the task score. eval.py
# scores ReLU models only, so the dense row has train.py's numbers alone.
#   [N=400] [M=200] [MODEL=91m] [L1=1e-3] [TASKS=embedded] [PREFIX=spx] [DATA="data=... ..."] \
#     bash scripts/sparsify_experiment.sh [train.py overrides for all three runs...]
# The defaults are sized for about 8 minutes on one H100 (from the pace of the 91M runs in BENCHMARKS.md: 600 steps of
# 64 x 512 tokens, five runs sharing an H100, in about 10 minutes). DATA defaults to the documentation corpus
# (data/docs.bin, scripts/build_doc_corpus.py) where present, else the shipped corpus (data=embedded, about 0.4 M
# tokens: N + M steps of 32 k tokens repeat it many times, so held-out CE then also measures memorisation).
# TASKS=none skips the benchmarks (for machines without lm-eval). On the GPU machine, carry hydra-core and omegaconf
# (../shared/gpu/README.md). Re-running skips finished runs and resumes unfinished ones from their checkpoints.
set -euo pipefail
N=${N:-400}
M=${M:-200}
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

python - "$PREFIX" "$N" "$M" <<'EOF'
import json
import sys
from pathlib import Path

from sparse_llm.telemetry.metrics import read_metrics

prefix, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
scored = {Path(r["checkpoint"]).parent.name: r for r in json.loads(Path(f"outputs/{prefix}_eval/results.json")
                                                                   .read_text())["models"]}


def last(records, key):
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def cell(value, spec):
    return "-" if value is None else format(value, spec)


print(f"\n| run | steps | val CE (train.py) | held-out CE (eval.py) | sparsity | L0 mean / max | dead (last window) "
      "| never fired | mean acc |")
print("|---|---|---|---|---|---|---|---|---|")
for run, steps in ((f"{prefix}_dense", n), (f"{prefix}_sparsified", f"{n} + {m}"), (f"{prefix}_scratch", n + m)):
    records = read_metrics(Path("outputs") / run / "metrics.jsonl")
    record = scored.get(run)
    held_out = sparsity = l0 = never = acc = None
    if record is not None:
        layers = record["sparsity"]["layers"]
        held_out = record["perplexity"]["ce"]
        sparsity = record["sparsity"]["sparsity_mean"]
        l0 = f"{record['sparsity']['l0_mean']:.1f} / {max(x['l0_max'] for x in layers)}"
        never = sum(x["never_fired"] for x in layers) / len(layers)
        acc = record.get("mean_acc")
    print(f"| {run} | {steps} | {cell(last(records, 'val/ce'), '.4f')} | {cell(held_out, '.4f')} | "
          f"{cell(sparsity, '.2%')} | {l0 or '-'} | {cell(last(records, 'dead/mean'), '.1%')} | {cell(never, '.1%')} "
          f"| {cell(acc, '.3f')} |")
start = read_metrics(Path("outputs") / f"{prefix}_sparsified" / "metrics.jsonl")[0]
print(f"\nSparsified run, step 0: dense source val CE {cell(start.get('val/ce_dense_source'), '.4f')}, after the "
      f"ReLU swap {cell(start.get('val/ce'), '.4f')}")
EOF
