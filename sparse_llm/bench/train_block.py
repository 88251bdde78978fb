"""One gated MLP block for training (forward + backward with the L1 term), measured: dense torch autograd (eager,
and compiled with inductor as `trainer.compile=true` runs it) vs the sparse training op
(sparse_llm.ffn.twell.train_op), on one GPU. scripts/bench_train_mlp.py (and bench_mlp.py --mode train) run it.

Per case: one step is the forward, then the backward from a fixed upstream gradient dy (bf16 [M, K], as the
layer above hands it down) and the L1 term's coeff / M on l1_sum (the trainer's L1 term for one layer), so the
time is the block's alone (no loss computed around it). Reported: median ms of forward+backward (CUDA events
after warm-up) for dense bf16 autograd and for the op, back to back (the host issues ahead, as in a model:
the ratio is taken on these) and as isolated calls (each waited for, so the host's latency to the first kernel
is included), host wall-clock ms per step of back-to-back steps, forward-only ms, peak memory above the
inputs and weights during forward+backward and the memory held between forward and backward (the saved
activations), relative errors of y and the four gradients vs an fp32 dense reference (dense bf16 beside
them), the tokens' gate non-zeros (mean / p99 / max) and the tokens computed as dense backup rows, and what a
training layer of `kernel=auto` runs (the layer's dispatcher, eager layers, given the block's mean and max non-zeros)
with its ratio to the dense path. Sparsity is controlled with `synthetic_block` (a constant input feature with a
negative gate weight; sigma > 0 scales tokens log-normally for heavy tails).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from sparse_llm.bench.timing import relative_error, time_ms, wall_ms
from sparse_llm.ffn.dispatch import LayerDispatcher
from sparse_llm.ffn.torch_backend import dense_block
from sparse_llm.ffn.twell.cost_model import DEFAULT_WIDTH, dx_by_slices
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn

# name: (mean gate non-zeros per token, sigma of the log-normal token scale)
CASES = {
    "u28": (28, 0.0),
    "u56": (56, 0.0),
    "u112": (112, 0.0),
    "u279": (279, 0.0),
    "h60": (60, 0.3),
    "h79": (79, 0.3),
    "h154": (154, 0.5),
}
L1_COEFF = 2e-5
DEVICE = "cuda"
MB = 1 << 20


def dense_forward(x, wg, wu, wd) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path as training runs it (with its L0 and fired statistics): (y, l1_sum)."""
    y, l1_sum, _, _ = dense_block(x, wg, wu, wd, True)
    return y, l1_sum


# The same through inductor, as the trainer runs it with trainer.compile=true: ReLU, product and statistics fused.
compiled_dense_forward = torch.compile(dense_forward)


def sparse_forward(x, wg, wu, wd, l0_hint=None) -> tuple[torch.Tensor, torch.Tensor]:
    """l0_hint: the block's (mean, max) non-zeros per token, as a model layer passes its last observed ones."""
    result = twell_train_ffn(x, wg, wu, wd, l0_hint=l0_hint)
    return result.y_MK, result.l1_sum


def backward(y, l1, leaves, dy, coeff) -> list[torch.Tensor]:
    """The gradients of <y, dy> + coeff * l1 w.r.t. the leaves: dy and coeff go to autograd as the outputs'
    gradients (the block's backward without a loss pass around it)."""
    return list(torch.autograd.grad((y, l1), leaves, (dy.to(y.dtype), coeff.to(l1.dtype))))


def step(forward, leaves, dy, coeff) -> list[torch.Tensor]:
    return backward(*forward(*leaves), leaves, dy, coeff)


def memory_mb(forward, leaves, dy, coeff) -> tuple[float, float]:
    """(peak MB above the live inputs during forward+backward, MB held between forward and backward)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y, l1 = forward(*leaves)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base
    grads = backward(y, l1, leaves, dy, coeff)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads, y, l1
    return peak / MB, saved / MB


def auto_choice(x: torch.Tensor, wg: torch.Tensor, l0_hint: tuple[float, float]) -> str:
    """The backend a training layer with `kernel=auto` takes at this block's sparsity."""
    dispatcher = LayerDispatcher("auto")
    dispatcher.observe(*l0_hint)
    return dispatcher.choose(x, wg, training=True).name


def bench_case(name: str, m: int, k: int, n: int, reps: int) -> dict:
    nnz, sigma = CASES[name]
    x, wg, wu, wd = synthetic_block(m, k, n, nnz, sigma, seed=list(CASES).index(name), device=DEVICE)
    leaves = [t.requires_grad_() for t in (x, wg, wu, wd)]
    dy = (torch.randn(m, k, device=DEVICE) / m**0.5).bfloat16()
    coeff = torch.tensor(L1_COEFF / m, device=DEVICE)

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_y, _ = dense_forward(*ref_leaves)
    ref_grads = step(dense_forward, ref_leaves, dy, coeff)
    ref_y = ref_y.detach()
    del ref_leaves

    result = twell_train_ffn(*leaves)
    l0 = result.l0_M.float()
    row = {
        "case": name,
        "M": m,
        "K": k,
        "N": n,
        "sigma": sigma,
        "nnz_mean": l0.mean().item(),
        "nnz_p99": l0.quantile(0.99).item(),
        "nnz_max": l0.max().item(),
        "backup_rows": result.dense_rows(),
        "path": result.path,
    }
    l0_hint = (row["nnz_mean"], row["nnz_max"])
    row["dx_walk"] = "slices" if dx_by_slices(m, k, n, DEFAULT_WIDTH, l0_hint) else "rows"
    row["auto"] = auto_choice(x, wg, l0_hint)
    names = ("y", "dx", "dw_gate", "dw_up", "dw_down")
    twell_forward = functools.partial(sparse_forward, l0_hint=l0_hint)
    for label, forward in (("dense", dense_forward), ("compiled", compiled_dense_forward), ("twell", twell_forward)):
        with torch.no_grad():
            y = forward(*leaves)[0]
        grads = step(forward, leaves, dy, coeff)
        for what, got, ref in zip(names, [y, *grads], [ref_y, *ref_grads]):
            row[f"err_{what}_{label}"] = relative_error(got, ref)
        del y, grads
        run = functools.partial(step, forward, leaves, dy, coeff)
        row[f"{label}_ms"] = time_ms(run, warmup=3, reps=reps, drain=False)
        row[f"{label}_isolated_ms"] = time_ms(run, warmup=3, reps=reps)
        row[f"{label}_wall_ms"] = wall_ms(run, reps=reps)
        row[f"{label}_fwd_ms"] = time_ms(lambda f=forward: f(*leaves), warmup=3, reps=reps)
        row[f"{label}_peak_MB"], row[f"{label}_saved_MB"] = memory_mb(forward, leaves, dy, coeff)
    row["speedup"] = row["dense_ms"] / row["twell_ms"]
    row["speedup_compiled"] = row["compiled_ms"] / row["twell_ms"]
    row["speedup_isolated"] = row["dense_isolated_ms"] / row["twell_isolated_ms"]
    row["peak_ratio"] = row["twell_peak_MB"] / row["dense_peak_MB"]
    row["auto_speedup"] = row["dense_ms"] / (row["twell_ms"] if row["auto"] == "twell" else row["dense_ms"])
    return row


def markdown(rows: list[dict]) -> str:
    head = (
        "| case | nnz mean / p99 / max | backup rows | dx walk | dense ms | twell ms | speedup | dense compiled ms "
        "| speedup vs compiled | isolated ms dense / twell (speedup) | wall ms dense / twell "
        "| fwd ms dense / twell | peak MB dense / twell (ratio) | grad rel. err twell (dense bf16) | auto "
        "| auto speedup |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        errs = ", ".join(
            f"{w} {r[f'err_{w}_twell']:.1e} ({r[f'err_{w}_dense']:.1e})" for w in ("dx", "dw_gate", "dw_up", "dw_down")
        )
        lines.append(
            f"| {r['case']} | {r['nnz_mean']:.0f} / {r['nnz_p99']:.0f} / {r['nnz_max']:.0f} | {r['backup_rows']} "
            f"| {r['dx_walk']} "
            f"| {r['dense_ms']:.2f} | {r['twell_ms']:.2f} | {r['speedup']:.2f}x "
            f"| {r['compiled_ms']:.2f} | {r['speedup_compiled']:.2f}x "
            f"| {r['dense_isolated_ms']:.2f} / {r['twell_isolated_ms']:.2f} ({r['speedup_isolated']:.2f}x) "
            f"| {r['dense_wall_ms']:.2f} / {r['twell_wall_ms']:.2f} "
            f"| {r['dense_fwd_ms']:.2f} / {r['twell_fwd_ms']:.2f} "
            f"| {r['dense_peak_MB']:.0f} / {r['twell_peak_MB']:.0f} ({r['peak_ratio']:.2f}) | {errs} "
            f"| {r['auto']} | {r['auto_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The training block's own options (the shape, --m --k --n, is the caller's)."""
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", help="append one JSON line per case to this file")


def run_cases(m: int, k: int, n: int, cases: list[str], reps: int, out: str | None) -> list[dict]:
    """bench_case for each of `cases` at [m, k] x [k, n], each row printed (and appended to `out`) as it comes, then
    the markdown table."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_mlp.py needs a CUDA GPU (the sparse kernels are sm_90a).")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, M={m} K={k} N={n}, bf16")
    rows = []
    for name in cases:
        row = bench_case(name, m, k, n, reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()
    print(markdown(rows))
    return rows
