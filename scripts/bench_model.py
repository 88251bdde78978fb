"""Whole-model benchmark: dense FFNs vs the sparse kernels, same process, same weights, same inputs.

    python scripts/bench_model.py --size 2b --density-l0 24                   # random 2b model, ~24 nnz/token
    python scripts/bench_model.py --checkpoint outputs/<run>/final --tokens data/fineweb   # a trained model
    python scripts/bench_model.py --size tiny --seq-len 64 --batch 2 --reps 2   # CPU smoke run

One model, mode and micro-batch at a time; `auto` against dense training over sizes, checkpoints, compile and CUDA
graphs on and off and micro-batches 1-8, as one table: scripts/bench_train_grid.py.

Options: --batch 8 --seq-len 2048 (forward and training micro-batch), --train-batch (default --batch),
--modes forward,train, --record-dir (where the run's JSON record goes, default docs/records/),
--kernels (which variants, default all four), --max-train-batch (also find the largest training
micro-batch each path fits, growing by half up to this), --accumulate (training micro-batches per optimizer step),
--tokens (inputs from a token file), --profile-dir (a torch.profiler trace and top-kernel table per variant, to see
inside the breakdown), --grad-ckpt, --energy-seconds, --warmup, --reps, --l1, --lr, --seed, --device; `--help`
describes each.

What is measured, per mode and per FFN path: `stock` (transformers' own LlamaMLP, LlamaRMSNorm and
LlamaAttention on the same weights: the plain dense model, no sparsity statistics and no L1 term, i.e.
the paper's non-sparse baseline), `torch` (our model on the dense torch backend: SparseMLP, which also
computes L0/L1 statistics, FusedRMSNorm and FusedRopeAttention), `auto` (each layer picks by the cost
model from the L0 it showed on the `torch` pass) and `twell` (forced; inference only, where the TwELL
kernels can run). Speeds are given as ratios to both dense paths:
- forward: the core model (embeddings + decoder layers + final norm, no lm_head, no KV cache) on
  batch x seq_len tokens in bf16 under inference_mode, as the paper's throughput numbers are taken.
- train: one full step at the same micro-batch, as train.py runs it on a GPU: fp32 master weights,
  bf16 autocast, loss = CE + l1 * L1 term, backward, gradient clipping, AdamW step (skipped on the
  device if the loss or norm is not finite), then the previous step's loss and gradient norm read on the
  host (the trainer's one wait per step); steps issued back to back, as the trainer does, so the host can
  run up to a step ahead of the device. With --accumulate A, a step is A forward + backward passes over the
  micro-batch (each loss divided by A, as train.py divides it by global_batch / micro_batch) and one optimizer
  step: the optimizer's fixed cost is shared by A micro-batches' tokens, as in a run whose global batch holds A
  micro-batches per GPU (the paper's 512 sequences on 8 GPUs at 8 each: A = 8).
- tokens/ms from the median of CUDA-event timings after warm-up; the ratio to the dense path of the
  same run; peak allocated memory (resident weights included; in train mode also gradients and AdamW
  state); energy per token from the NVML counter over >= --energy-seconds of back-to-back calls
  (omitted on CPU or without pynvml); per-layer L0 (mean / p99 / max non-zeros of h per token on the
  benchmark inputs) and the path each layer took in its last call (with rows rerouted to the dense path).
- a time breakdown from CUDA events around the attention and FFN modules (a separate pass, so the
  events cost the throughput numbers nothing): attention, FFN gate GEMM (the [M, K] x [K, N] cuBLAS
  GEMM timed alone, times the layer count; both paths run it), the rest of the FFN (dense: up and
  down GEMMs; sparse: packing, sparse up/down, rerouted rows, statistics; in train mode also autocast's
  weight casts), other forward work (norms, embeddings, residuals, loss), and in train mode backward
  (with any gradient-checkpointing recomputation) and optimizer (gradient clipping + AdamW). Eager layers
  only: hooks around modules would split compiled graphs.
- on a GPU, the device time of one profiled call per kernel family (GEMMs, attention, the sparse FFN
  kernels, the optimizer, CUDA graphs' input copies, kernels fused by torch.compile, sorts, other;
  `benchmark.kernel_family`), the
  time any device work ran ("busy") and the rest of the timed call's median ("idle": the device waited
  for the host, so a faster host or fewer host calls would gain it). Compiled layers included.
In train mode `twell` runs once the twell backend takes training=True (until then the row says why it
was skipped), and `auto` takes a sparse path only where the backend's cost model offers one for
training; the per-layer paths in the report show what each layer ran.

Random-init models (--size) are dense-ish (half the gate pre-activations are positive). --density-l0 T
makes them sparse without changing any cost of the dense path: a constant input feature with a negative weight in
every gate row, solved per layer for a mean of T non-zeros per token (sparse_llm/bench/model_setup.py says how).
L0 is always measured, never assumed.

Real sparsity at the paper's shapes (24-40 non-zeros per token per layer), reproducibly, in minutes of
GPU time: train from scratch with a larger L1 coefficient than the paper's 2e-5 so that L0 falls within
a few hundred steps, watch the per-layer L0 in the run's metrics.jsonl (keys `l0/layer_NN`, `l0/mean`,
`l0_p99/...`, `l0_max/...`), then benchmark the checkpoint on held-out text:

    python scripts/tokenize_corpus.py --out data/embedded      # the shipped corpus (or a fineweb_edu file)
    python train.py model=2b l1=5e-4 data=tokens 'data.paths=[data/embedded.bin]' \\
        trainer.max_steps=200 trainer.global_batch=8 trainer.micro_batch=4 trainer.warmup_steps=50 seed=0
    python scripts/bench_model.py --checkpoint outputs/<run>/final --tokens data/embedded --batch 8

(`bash scripts/real_sparsity_run.sh` runs these three steps, resuming the training when re-run.)
On an H100 the training takes 4 minutes (34.5k tokens/s with the sparse training kernels, their compilation
included) and ends at L0 17-25 per token in four runs of the same seed (code changes between them, enough for the
trajectories to part; 24.4-30.3 on this script's inputs), 30 with l1=4e-4 and seed=1.
On the 1B shape l1=5e-4 gave 22 on data/embedded, and l1=2e-4 gave 25-30 on data/docs but 127 on data/embedded.
Raise L1 if `l0/mean` is still above ~40 when it stops falling, lower it if it drops under ~24; record the value,
steps and seed used next to the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM

from sparse_llm.bench.arguments import (
    add_model_source,
    add_record_dir,
    add_token_source,
    check_cuda_graphs,
    check_model_source,
    check_token_source,
)
from sparse_llm.bench.measure import (
    BREAKDOWN_REPS,
    MODES,
    MeasureOptions,
    VariantResult,
    bench_forward,
    bench_train,
    gate_gemm_ms,
    largest_batches,
    result_row,
    run_variants,
    speed_ratios,
)
from sparse_llm.bench.model_setup import CALIBRATION_TOKENS, STOCK, load_model, make_inputs, make_sparse
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.tables import render_report, summary_table
from sparse_llm.bench.timing import hardware_summary
from sparse_llm.model.llama import compile_layers
from sparse_llm.telemetry.energy import EnergyMeter

# `stock` first (it needs no statistics), then `torch`, whose L0 feeds the `auto` decisions.
# A forced kernel that cannot run (no GPU, or no training path yet) is reported as skipped, with the reason.
KERNELS = (STOCK, "torch", "auto", "twell")  # both modes
GRAPHS_NOTE = "compiled parts replayed as CUDA graphs, peak memory = peak reserve (graph pools included); "
# The options that define a measurement, recorded with its results (output paths are left out).
SETTINGS = (
    "checkpoint",
    "size",
    "vocab_size",
    "density_l0",
    "tokens",
    "modes",
    "kernels",
    "batch",
    "train_batch",
    "max_train_batch",
    "accumulate",
    "seq_len",
    "l1",
    "lr",
    "grad_ckpt",
    "compile",
    "cuda_graphs",
    "warmup",
    "reps",
    "energy_seconds",
    "seed",
)


def report_header(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    device: torch.device,
    energy_note: str,
    shifts: list[float] | None,
) -> list[str]:
    cfg = model.config
    what = f"checkpoint {args.checkpoint}" if args.checkpoint else f"random-init {args.size}"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    inputs = f"token file {args.tokens}" if args.tokens else f"uniform random token ids (seed {args.seed})"
    if shifts is not None:
        sparsity = f"made sparse with --density-l0 {args.density_l0} (gate shifts {min(shifts):.2f}-{max(shifts):.2f})"
    else:
        sparsity = "sparsity as trained" if args.checkpoint else "no sparsity imposed"
    command = f"python scripts/bench_model.py {' '.join(args.argv)}".rstrip()
    forward_dtype = "bf16" if device.type == "cuda" else "fp32"
    train_precision = "fp32 weights + bf16 autocast" if device.type == "cuda" else "fp32"
    accumulation = "one per optimizer step" if args.accumulate == 1 else f"{args.accumulate} per optimizer step"
    return [
        f"## Model-level benchmark: {what} ({date})",
        "",
        f"Hardware: {hardware_summary(device)}; attention {cfg._attn_implementation}; energy: {energy_note}.",
        f"Model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, FFN {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}; {sparsity}.",
        f"Settings: `{command}`; inputs: {inputs}; "
        f"forward: micro-batch {args.batch} x {args.seq_len} tokens, {forward_dtype}, core model (no lm_head), "
        "L0 statistics from one extra pass (timed calls skip them, as generation does); "
        f"train: micro-batch {args.train_batch} x {args.seq_len} ({accumulation}), {train_precision}, l1 {args.l1}, "
        f"AdamW (lr {args.lr}), "
        f"grad clip 1{', gradient checkpointing' if args.grad_ckpt else ''}; "
        f"{'decoder layers torch.compiled (every variant); ' if args.compile else ''}"
        f"{GRAPHS_NOTE if args.cuda_graphs else ''}"
        f"times: median of {args.reps} "
        f"after {args.warmup} warm-up; energy over >= {args.energy_seconds} s windows; breakdown: "
        f"{'device time only (compiled layers)' if args.compile else f'median of {BREAKDOWN_REPS} passes'}. "
        "`auto` layers decide from the dense pass's L0.",
    ]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward call")
    parser.add_argument("--train-batch", type=int, default=None, help="training micro-batch (default --batch)")
    parser.add_argument(
        "--max-train-batch",
        type=int,
        default=0,
        help="also find the largest training micro-batch that fits, growing by half up to this",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="training micro-batches per optimizer step (train.py's global_batch / micro_batch); tokens/ms counts "
        "all of them",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--density-l0",
        type=float,
        default=None,
        help="random-init models only: target mean non-zeros per token in every FFN layer",
    )
    add_token_source(parser)
    parser.add_argument("--modes", default="forward,train")
    parser.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help="comma-separated FFN variants to run, in this order; `auto` decides from the L0 that `torch` measured",
    )
    add_record_dir(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--energy-seconds", type=float, default=2.0)
    parser.add_argument("--l1", type=float, default=2e-5, help="L1 coefficient in the training loss")
    parser.add_argument(
        "--lr",
        type=float,
        default=0.0,
        help="AdamW lr of the timed steps: AdamW does the same work at any lr; 0 keeps the weights (so L0) fixed",
    )
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in train mode")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every decoder layer (model.compile_layers, as trainer.compile=true) for every variant; "
        "the per-section breakdown is skipped (its module hooks would split the compiled graphs)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile: replay each compiled layer part as a CUDA graph (torch.compile mode reduce-overhead)",
    )
    parser.add_argument(
        "--profile-dir", default=None, help="also profile one call per variant: Chrome trace + top-ops table here"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.train_batch = args.train_batch or args.batch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        parser.error(f"--modes {','.join(args.modes)}: choose from {','.join(MODES)}")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in KERNELS]
    if unknown or not args.kernels:
        parser.error(f"--kernels {','.join(args.kernels)}: choose from {','.join(KERNELS)}")
    if "auto" in args.kernels and "torch" not in args.kernels[: args.kernels.index("auto")]:
        parser.error("--kernels: `auto` decides from the L0 measured by `torch`: list torch before auto")
    for name in ("batch", "train_batch", "accumulate", "seq_len", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    check_model_source(parser, args)
    check_token_source(parser, args)
    check_cuda_graphs(parser, args)
    if args.max_train_batch and args.max_train_batch <= args.train_batch:
        parser.error(f"--max-train-batch must be 0 (off) or above --train-batch ({args.train_batch})")
    if args.energy_seconds < 1.0:
        parser.error("--energy-seconds must be >= 1 (the NVML counter updates every 20-100 ms)")
    return args


def model_shape(model: LlamaForCausalLM) -> dict[str, object]:
    """The model's shape, for the record (a checkpoint's path alone does not say it)."""
    cfg = model.config
    return {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "ffn": cfg.intermediate_size,
        "heads": cfg.num_attention_heads,
        "vocab": cfg.vocab_size,
        "attention": cfg._attn_implementation,
    }


def run(args: argparse.Namespace) -> tuple[list[VariantResult], str, dict[str, object]]:
    """(every variant's result, the console report, the model's shape)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 leftovers stay fp32, as in the dense reference
    model = load_model(device, checkpoint=args.checkpoint, size=args.size, vocab_size=args.vocab_size, seed=args.seed)
    if args.seq_len > model.config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's context "
            f"({model.config.max_position_embeddings}); pass --seq-len <= that."
        )
    rows = max(args.batch, args.train_batch, args.max_train_batch)
    ids = make_inputs(rows, args.seq_len, model.config.vocab_size, tokens=args.tokens, seed=args.seed).to(device)
    shifts = None
    if args.density_l0 is not None:
        shifts = make_sparse(model, args.density_l0, ids[: max(1, CALIBRATION_TOKENS // args.seq_len)])
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        compile_layers(model, cuda_graphs=args.cuda_graphs)
    # Training variants start from these weights; kept on the host so they cost no GPU memory.
    master = (
        {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if "train" in args.modes else {}
    )
    options = MeasureOptions.from_namespace(args)
    meter = EnergyMeter(device)
    energy_note = "NVML" if meter.available else f"not measured ({meter.unavailable_reason})"
    header = report_header(args, model, device, energy_note, shifts)
    print("\n".join(header), flush=True)

    def progress(row: VariantResult) -> None:
        print("\n".join(summary_table([row])[2:]), flush=True)

    results: list[VariantResult] = []
    if "forward" in args.modes:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model.to(dtype).eval()
        fwd_ids = ids[: args.batch]
        gate_ms = gate_gemm_ms(model, fwd_ids.numel(), dtype, options)
        results += run_variants(
            "forward",
            args.kernels,
            model,
            fwd_ids,
            lambda kernel, seen: bench_forward(model, fwd_ids, kernel, seen, meter, gate_ms, options),
            progress,
        )
    if "train" in args.modes:
        model.to(torch.float32)
        train_ids = ids[: args.train_batch]
        gate_ms = gate_gemm_ms(
            model, train_ids.numel(), torch.bfloat16 if device.type == "cuda" else torch.float32, options
        )
        rows = run_variants(
            "train",
            args.kernels,
            model,
            train_ids,
            lambda kernel, seen: bench_train(model, master, train_ids, kernel, seen, meter, gate_ms, options),
            progress,
        )
        results += rows
        if args.max_train_batch:
            ran = [r for r in rows if not r.skipped]
            observed = next((r.layers for r in rows if r.layers), None)
            results += largest_batches(model, master, ids, ran, observed, meter, options)
    meter.close()
    return results, render_report(results, header), model_shape(model)


def main(argv: Sequence[str] | None = None) -> list[VariantResult]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results, report, shape = run(args)
    print("\n" + report, flush=True)
    rows = [result_row(r, *ratios) for r, ratios in zip(results, speed_ratios(results), strict=True)]
    settings = {**{name: getattr(args, name) for name in SETTINGS}, "model": shape}
    write_record(args.record_dir, make_record("bench_model", settings, rows, args.device, args.argv))
    return results


if __name__ == "__main__":
    main()
