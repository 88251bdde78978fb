"""Per-kernel time breakdown of one gated MLP block on the GPU: where the milliseconds go.

    python scripts/profile_mlp.py                           # inference and training, 28 and 56 non-zeros
    python scripts/profile_mlp.py --mode train --nnz 28 --sigma 0.5
    python scripts/profile_mlp.py --mode train --nnz 21 --sigma 1 --dense-rows 0,256   # heavy tokens split / GEMMs
    python scripts/profile_mlp.py --mode train --m 4096 --nnz 28 --host   # also the host's time, by function

For each case the block runs `--iters` times under torch.profiler (after warm-up); every device kernel,
including the CuPy ones, is listed with its calls and device ms per iteration, largest first, beside the
dense torch block profiled the same way. The title also gives the wall-clock ms per iteration of
back-to-back calls without the profiler: where it exceeds the kernel time, the GPU waited for the host
(launch overhead, host reads). Shapes and the synthetic sparsity are those of bench_mlp.py.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pathlib
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from sparse_llm.bench.arguments import add_record_dir
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.timing import wall_ms
from sparse_llm.ffn.torch_backend import dense_block
from sparse_llm.ffn.twell.cost_model import DEFAULT_WIDTH
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_backward_op, twell_train_ffn, twell_train_forward_op

L1_COEFF = 2e-5


def kernel_table(fn: Callable[[], object], iters: int) -> list[tuple[str, float, float]]:
    """[(kernel name, calls per iteration, device ms per iteration)], largest time first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    calls: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            calls[event.name] += 1
            micros[event.name] += event.device_time
    rows = [(name, calls[name] / iters, micros[name] / iters / 1e3) for name in calls]
    return sorted(rows, key=lambda row: -row[2])


def print_table(title: str, rows: list[tuple[str, float, float]], wall: float) -> None:
    total = sum(ms for _, _, ms in rows)
    print(f"\n### {title}: {total:.3f} ms of kernels, {wall:.3f} ms wall-clock per iteration\n")
    print("| kernel | calls | ms | share |")
    print("|---|---|---|---|")
    for name, count, ms in rows:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short}` | {count:g} | {ms:.3f} | {ms / total:.0%} |")


HOST_ITERS = 8  # calls queued behind the GPU's sleep: few enough that the launch queue never fills


def issue_ms(
    forward: Callable[[], object],
    backward: Callable[[object], object] | None,
    around: Callable[[str], contextlib.AbstractContextManager] = lambda phase: contextlib.nullcontext(),
) -> list[float]:
    """Host ms to issue one forward (and one backward), each while the GPU is still busy with earlier work so
    that no call waits for it: the launch cost that bounds a block whose kernels take less. Training issues
    HOST_ITERS forwards, then, once the GPU has run them, their backwards, as a model does (a layer's backward
    comes long after its forward, whose asynchronous heavy-token count has landed by then). `around(phase)`
    wraps each timed phase ("forward", "backward"), e.g. in a profiler."""
    # Warm-up with as many calls as are timed, so the caching allocators (device and pinned host memory) hold
    # enough blocks for the calls in flight and the timed phase measures issuing, not first allocations.
    outs = [forward() for _ in range(HOST_ITERS)]
    if backward is not None:
        for out in outs:
            backward(out)
    per_phase = []
    for phase in ("forward", "backward") if backward is not None else ("forward",):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spinning
        with around(phase):
            start = time.perf_counter()
            if phase == "forward":
                outs = [forward() for _ in range(HOST_ITERS)]
            else:
                for out in outs:
                    backward(out)
            per_phase.append((time.perf_counter() - start) * 1e3 / HOST_ITERS)
    torch.cuda.synchronize()
    return per_phase


def print_host_profile(title: str, forward: Callable[[], object], backward, top: int = 25) -> None:
    """Host ms to issue one call; the Python functions (torch ops included) taking that time; and, per phase,
    the torch ops and autograd nodes by their own host time (torch.profiler, which also sees the autograd
    engine's C++ work that cProfile attributes to whichever Python frame is below it)."""
    phases = issue_ms(forward, backward)
    profiler = cProfile.Profile()
    issue_ms(forward, backward, lambda phase: profiler)
    split = f" (forward {phases[0]:.3f} + backward {phases[1]:.3f})" if len(phases) == 2 else ""
    print(f"\n### host, {title}: {sum(phases):.3f} ms to issue one call{split} (GPU kept busy)\n")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # (file, line, name) -> (.., tottime, ..)
    print("| function (profiled: times inflated by the profiler) | calls | own us per call of the block |")
    print("|---|---|---|")
    for (file, line, name), (_, calls, own, *_rest) in rows:
        where = f"{pathlib.Path(file).name}:{line}" if line else file
        print(f"| `{name}` ({where}) | {calls / HOST_ITERS:g} | {own * 1e6 / HOST_ITERS:.1f} |")
    traces = {}

    def traced(phase: str) -> profile:
        traces[phase] = profile(activities=[ProfilerActivity.CPU])
        return traces[phase]

    issue_ms(forward, backward, traced)
    for phase, trace in traces.items():
        events = sorted(trace.key_averages(), key=lambda e: -e.self_cpu_time_total)[: top // 2]
        print(f"\n{phase}: torch ops and autograd nodes by own host time (torch.profiler)\n")
        print("| op | calls | own us per call of the block |")
        print("|---|---|---|")
        for event in events:
            name = event.key if len(event.key) <= 90 else event.key[:87] + "..."
            print(f"| `{name}` | {event.count / HOST_ITERS:g} | {event.self_cpu_time_total / HOST_ITERS:.1f} |")


def print_op_issue(x, wg, wu, wd, dy) -> None:
    """Host ms to issue the training op's forward and backward themselves, without autograd or a loss around
    them: what the op's own launches and torch calls cost, against the whole step above."""
    dl1 = torch.tensor(L1_COEFF / x.shape[0], device=x.device)
    with torch.no_grad():
        fwd, bwd = issue_ms(
            lambda: twell_train_forward_op(x, wg, wu, wd, DEFAULT_WIDTH),
            lambda outs: twell_train_backward_op(x, wg, wu, wd, *outs[4:], dy, dl1),
        )
    print(f"\nthe op alone: forward {fwd:.3f} ms, backward {bwd:.3f} ms to issue (no autograd, no loss)")


def dense_infer(x, wg, wu, wd):
    return dense_block(x, wg, wu, wd, False)[0]


def dense_train_outputs(leaves):
    """(y, l1_sum) of the trainer's torch path (with its statistics), as bench_train_mlp times it."""
    y, l1_sum, _, _ = dense_block(*leaves, True)
    return y, l1_sum


def sparse_train_outputs(leaves, dense_rows: int):
    result = twell_train_ffn(*leaves, dense_rows=dense_rows)
    return result.y_MK, result.l1_sum


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("infer", "train", "both"), default="both")
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=5632)
    parser.add_argument("--nnz", type=str, default="28,56", help="comma-separated mean gate non-zeros per token")
    parser.add_argument("--sigma", type=float, default=0.0, help="log-normal token scale (heavy tails if > 0)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--host", action="store_true", help="also the host's time per call, by Python function")
    parser.add_argument(
        "--dense-rows",
        type=str,
        default="0",
        help="comma-separated: training's heavy tokens through dense GEMM rows, this many (a case each)",
    )
    add_record_dir(parser)
    args = parser.parse_args(argv)
    modes = ("infer", "train") if args.mode == "both" else (args.mode,)
    print(f"# {torch.cuda.get_device_name()}, M={args.m} K={args.k} N={args.n} bf16, sigma={args.sigma}")
    results = []  # per case: its kernels' device time and the wall-clock time, each kernel in the record
    for nnz in (float(v) for v in args.nnz.split(",")):
        x, wg, wu, wd = synthetic_block(args.m, args.k, args.n, nnz, args.sigma)
        cases = []  # (title, forward, backward of the forward's output or None)
        if "infer" in modes:
            cases.append(("infer dense", lambda: dense_infer(x, wg, wu, wd), None))
            cases.append(("infer twell", lambda: twell_gated_mlp(x, wg, wu, wd), None))
        if "train" in modes:
            leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
            dy = (torch.randn(args.m, args.k, device=x.device) / args.m**0.5).bfloat16()
            # The upstream gradient and the L1 term's weight, fed to autograd as bench_train_mlp does.
            grad_outputs = (dy, torch.tensor(L1_COEFF / args.m, device=x.device))
            backward = functools.partial(torch.autograd.grad, inputs=leaves, grad_outputs=grad_outputs)
            cases.append(("train dense", lambda: dense_train_outputs(leaves), backward))
            for rows in (int(v) for v in args.dense_rows.split(",")):
                title = "train twell" + (f" ({rows} dense rows)" if rows else "")
                cases.append((title, lambda r=rows: sparse_train_outputs(leaves, r), backward))
        for title, forward, backward in cases:
            step = forward if backward is None else lambda f=forward, b=backward: b(f())
            with torch.no_grad() if title.startswith("infer") else contextlib.nullcontext():
                kernels, wall = kernel_table(step, args.iters), wall_ms(step, args.iters)
                print_table(f"{title}, nnz {nnz:g}", kernels, wall)
                results.append(
                    {
                        "case": title,
                        "nnz": nnz,
                        "kernel_ms": sum(ms for _, _, ms in kernels),
                        "wall_ms": wall,
                        "kernels": [{"name": name, "calls": calls, "ms": ms} for name, calls, ms in kernels],
                    }
                )
                if args.host:
                    print_host_profile(f"{title}, nnz {nnz:g}", forward, backward)
                    if title.startswith("train twell"):
                        print_op_issue(x, wg, wu, wd, dy)
    settings = {
        "mode": args.mode,
        "m": args.m,
        "k": args.k,
        "n": args.n,
        "nnz": args.nnz,
        "sigma": args.sigma,
        "iters": args.iters,
        "dense_rows": args.dense_rows,
    }
    write_record(args.record_dir, make_record("profile_mlp", settings, results, "cuda", argv))


if __name__ == "__main__":
    main()
