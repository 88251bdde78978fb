"""Where a training step waits: the host's time to issue each micro-batch beside the device's time to run it.

    python scripts/profile_train_step.py --size 2b --density-l0 24 --accumulate 8 --compile
    python scripts/profile_train_step.py --checkpoint outputs/<run>/final --tokens data/embedded --accumulate 8
    python scripts/profile_train_step.py --size tiny --seq-len 64 --train-batch 2 --accumulate 2   # CPU smoke run

A step is bench_model.py's training step (`sparse_llm.bench.train_step.TrainStep`: fp32 master weights, bf16 autocast
on a GPU, the L1 term,
backward, gradient clipping, AdamW), run --steps times after --warmup, back to back as the trainer issues them.
Per FFN path (--kernels, each layer forced onto it) and per micro-batch, medians over the timed steps:
- host forward / backward ms: the host's wall-clock time to issue that phase. It includes any wait: a full launch
  queue when the host is far ahead, or a read of a count the device has not produced yet;
- of which count waits: the backward's reads of heavy-token counts that had not landed (`backends.HostWaits`);
- device forward / backward ms: CUDA-event time between the same points of the stream (GPU only).
Then the optimizer step the same way, and the step's event time (the device's, its idle gaps included).
Where a phase takes the host as long as the device, the device runs at the host's pace there: a faster device
path gains nothing until the host issues it faster or keeps a lead from the phase before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
from sparse_llm.bench.model_setup import (
    CALIBRATION_TOKENS,
    free_memory,
    kernel_unavailable_reason,
    load_model,
    make_inputs,
    make_sparse,
    set_kernel,
)
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.timing import PeakMemory
from sparse_llm.bench.train_step import TrainStep
from sparse_llm.ffn.backend import HostWaits
from sparse_llm.model.llama import compile_layers
from sparse_llm.training.trainer import FrozenHeap

KERNELS = ("torch", "twell")
# The options that define a measurement, recorded with its results.
SETTINGS = (
    "checkpoint",
    "size",
    "vocab_size",
    "tokens",
    "density_l0",
    "train_batch",
    "seq_len",
    "accumulate",
    "kernels",
    "compile",
    "cuda_graphs",
    "no_step_scope",
    "no_graph_forwards",
    "warmup",
    "steps",
    "l1",
    "seed",
)


@dataclass
class Phase:
    """One phase of a step (a micro-batch's forward or backward, or the optimizer step): host ms to issue it, of
    which ms waiting for counts, and device ms between its two stream marks (None without a GPU)."""

    host_ms: float
    wait_ms: float
    device: tuple[torch.cuda.Event, torch.cuda.Event] | None

    def device_ms(self) -> float | None:
        return None if self.device is None else self.device[0].elapsed_time(self.device[1])


def timed_phase(run: Callable[[], object], cuda: bool) -> tuple[object, Phase]:
    """run()'s result and its Phase: host time around it, and CUDA events before and after on the current stream."""
    marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
    waited, start = HostWaits.seconds, time.perf_counter()
    if marks:
        marks[0].record()
    out = run()
    if marks:
        marks[1].record()
    host_s, wait_s = time.perf_counter() - start, HostWaits.seconds - waited
    return out, Phase(host_s * 1e3, wait_s * 1e3, marks)


def step_phases(step: TrainStep, cuda: bool) -> list[tuple[str, Phase]]:
    """One training step, issued as TrainStep issues it, as named phases in order."""
    phases = []
    with step.micro_batches():
        for i in range(step.accumulate):
            loss, forward = timed_phase(step.forward, cuda)
            _, backward = timed_phase(lambda loss=loss: step.backward(loss), cuda)
            phases += [(f"micro-batch {i} forward", forward), (f"micro-batch {i} backward", backward)]
    _, update = timed_phase(lambda: (step.update(loss), step.after()), cuda)
    return phases + [("optimizer", update)]


def profile_kernel(
    model: LlamaForCausalLM, master: dict[str, torch.Tensor], ids: torch.Tensor, kernel: str, args: argparse.Namespace
) -> tuple[list[str], list[dict[str, object]]]:
    """The per-phase table of `kernel`'s training step on ids [B, T] from the weights `master` and its step times, as
    (markdown lines, record rows: one per phase, then one for the whole step)."""
    cuda = ids.device.type == "cuda"
    model.load_state_dict(master)
    model.train()
    set_kernel(model, kernel, None)
    peak = PeakMemory(ids.device)
    try:
        with FrozenHeap() as heap:
            step = TrainStep(
                model,
                ids,
                args.l1,
                0.0,
                after=heap.freeze,
                cuda_graphs=args.cuda_graphs,
                accumulate=args.accumulate,
                step_scope=not args.no_step_scope,
                graph_forwards=False if args.no_graph_forwards else None,
            )
            warmup_s = []  # each warm-up step's seconds: compiling, and recording CUDA graphs
            for _ in range(args.warmup):
                start = time.perf_counter()
                step()
                if cuda:
                    torch.cuda.synchronize()
                warmup_s.append(time.perf_counter() - start)
            runs = []
            with peak:  # over the timed steps: warm-up steps compile and record, which takes memory of its own
                for _ in range(args.steps):
                    # one step's phases and its event span; the steps run back to back, as the trainer issues them
                    runs.append(timed_phase(lambda: step_phases(step, cuda), cuda))
    finally:
        model.zero_grad(set_to_none=True)
        if args.cuda_graphs:  # drop this path's graphs and their memory pools with the compiled code (as bench_model)
            torch._dynamo.reset()
        free_memory(model, ids.device)

    def median(values: list[float | None]) -> float | None:
        return None if None in values else statistics.median(values)

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        f"| {kernel}: phase | host ms | of which count waits ms | device ms |",
        "|---|---|---|---|",
    ]
    rows: list[dict[str, object]] = []
    for i, (name, _) in enumerate(runs[0][0]):
        phases = [run[0][i][1] for run in runs]
        row = {
            "kernel": kernel,
            "phase": name,
            "host_ms": median([p.host_ms for p in phases]),
            "count_wait_ms": median([p.wait_ms for p in phases]),
            "device_ms": median([p.device_ms() for p in phases]),
        }
        rows.append(row)
        lines.append(
            f"| {name} | {shown(row['host_ms'])} | {shown(row['count_wait_ms'])} | {shown(row['device_ms'])} |"
        )
    steps = [span.device_ms() if cuda else span.host_ms for _, span in runs]
    rows.append(
        {
            "kernel": kernel,
            "phase": "whole step",
            "host_ms": median([span.host_ms for _, span in runs]),
            "device_ms": median([span.device_ms() for _, span in runs]),
            "peak_gib": peak.gib,
            "reserved_gib": peak.reserved_gib,
            "step_ms": steps,
            "warmup_s": warmup_s,
        }
    )
    clock = "CUDA events" if cuda else "host"
    lines.append(f"\n{kernel}: step ms ({clock}), each timed step: {', '.join(f'{ms:.1f}' for ms in steps)}")
    work = " (compiling the layers, recording their CUDA graphs)" if args.cuda_graphs else ""
    if args.compile and not args.cuda_graphs:
        work = " (compiling the layers)"
    took = ", ".join(f"{seconds:.1f}" for seconds in warmup_s)
    lines.append(f"{kernel}: the warm-up steps took {took} s{work}" if warmup_s else f"{kernel}: no warm-up steps")
    if peak.gib is not None:
        lines.append(
            f"{kernel}: peak memory over the timed steps {peak.gib:.1f} GiB in tensors, "
            f"{peak.reserved_gib:.1f} GiB reserved (the reserve also holds CUDA graphs' pools)"
        )
    return lines, rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(parser)
    add_token_source(parser)
    parser.add_argument("--density-l0", type=float, default=None, help="random-init models: mean non-zeros per token")
    parser.add_argument("--train-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--accumulate", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument(
        "--kernels", default=",".join(KERNELS), help=f"FFN paths, each forced on every layer: {', '.join(KERNELS)}"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile every decoder layer (trainer.compile)")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --compile: replay each compiled layer part as a CUDA graph (trainer.cuda_graphs)",
    )
    parser.add_argument(
        "--no-step-scope",
        action="store_true",
        help="run the micro-batches outside step_scope.optimizer_step: the training op casts its weights per "
        "micro-batch and hands its weight gradients to autograd (for an A/B)",
    )
    parser.add_argument(
        "--no-graph-forwards",
        action="store_true",
        help="issue the training op's forward eagerly in every call instead of replaying one CUDA graph per layer "
        "(the default on a GPU, as the trainer's; for an A/B)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--l1", type=float, default=2e-5, help="L1 coefficient in the training loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_record_dir(parser)
    args = parser.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in KERNELS]
    if unknown or not args.kernels:
        parser.error(f"--kernels {','.join(args.kernels)}: choose from {','.join(KERNELS)}")
    for name in ("train_batch", "accumulate", "seq_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_model_source(parser, args)
    check_token_source(parser, args)
    check_cuda_graphs(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as bench_model: fp32 leftovers stay fp32
    model = load_model(device, checkpoint=args.checkpoint, size=args.size, vocab_size=args.vocab_size, seed=args.seed)
    vocab = model.config.vocab_size
    ids = make_inputs(args.train_batch, args.seq_len, vocab, tokens=args.tokens, seed=args.seed).to(device)
    if args.density_l0 is not None:
        make_sparse(model, args.density_l0, ids[: max(1, CALIBRATION_TOKENS // args.seq_len)])
    if args.compile:
        compile_layers(model, cuda_graphs=args.cuda_graphs)
    model.to(torch.float32)
    master = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    what = args.checkpoint or f"random-init {args.size}"
    if args.density_l0 is not None:
        what += f" made sparse at {args.density_l0} non-zeros per token"
    print(
        f"# {what}, micro-batch {args.train_batch} x {args.seq_len}, {args.accumulate} per step, "
        f"{'compiled layers, ' if args.compile else ''}{'CUDA graphs, ' if args.cuda_graphs else ''}"
        f"{'no step scope, ' if args.no_step_scope else ''}"
        f"{'eager op forwards, ' if args.no_graph_forwards else ''}{device}",
        flush=True,
    )
    results: list[dict[str, object]] = []
    for kernel in args.kernels:
        reason = kernel_unavailable_reason(kernel, model, device)
        if reason:
            lines, rows = [f"{kernel}: skipped ({reason})"], [{"kernel": kernel, "skipped": reason}]
        else:
            lines, rows = profile_kernel(model, master, ids, kernel, args)
        print("\n" + "\n".join(lines), flush=True)
        results += rows
    settings = {name: getattr(args, name) for name in SETTINGS}
    write_record(args.record_dir, make_record("profile_train_step", settings, results, device, argv))


if __name__ == "__main__":
    main()
