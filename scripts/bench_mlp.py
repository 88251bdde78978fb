"""Benchmark one gated MLP block: dense torch vs the twell backend, on one GPU.

    python scripts/bench_mlp.py --mode infer                 # the docs/benchmarks.md table (H100: ~3 min)
    python scripts/bench_mlp.py --mode infer --calibrate     # also the cost-model calibration tables
    python scripts/bench_mlp.py --mode train [--cases u28 u56]  # the training block, as scripts/bench_train_mlp.py

Per case: dense torch ms (three F.linear + relu + mul, no statistics; also compiled by inductor) and twell ms (no
statistics either: `statistics=False`; medians of CUDA-event timings after warm-up, same process; each call waited for,
so the host's latency to the first kernel counts, as in a decode step), their ratio; the same two issued back to back
(as a model's layers run them during prefill, the host ahead of the GPU) and their ratio; also the torch backend as the
model runs it (dense plus its L1/L0/fired statistics) and the twell time with each gate route; relative error vs an
fp32 reference (dense bf16 for comparison), energy per call (NVML counter over >= --energy-seconds of back-to-back
calls), the path taken (overflow rows) and what `kernel=auto` would run by price (sparse only if predicted < 0.95x
dense; in a model, close prices and decode-sized calls issued from Python are settled by a timed trial instead,
`dispatch.HOST_BOUND_MS`) with its ratio to the torch backend, both with the L1/L0/fired statistics. For decode
sizes (M <= 64) also the device time per call with no host cost between kernels: GRAPH_LAYERS blocks of distinct
weights (more than L2 holds, as a model's layers in a decode step) called in turn, replayed as one CUDA graph.
Sparsity is controlled with `synthetic_block` (a constant input feature with a negative gate weight). The twell
calls know the block's mean and max non-zeros per token and its share of heavy tokens from its first call, as a model's
layer does from its statistics (they set the direct route's walk, its dense rows, and the column parts of blocks wider
than L2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sparse_llm.bench import train_block
from sparse_llm.bench.arguments import add_record_dir
from sparse_llm.bench.records import make_record, write_record
from sparse_llm.bench.timing import energy_mj_per_call, graph_ms, relative_error, time_ms
from sparse_llm.ffn.dispatch import SWITCH_MARGIN, density_of
from sparse_llm.ffn.torch_backend import TorchFFN, dense_block
from sparse_llm.ffn.twell.backend import TwellFFN
from sparse_llm.ffn.twell.infer_launch import direct_up_down, twell_gate
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.formats import gated_mlp_ref
from sparse_llm.telemetry.energy import EnergyMeter

GRAPH_MAX_M = 64  # decode sizes: also timed as CUDA graphs
GRAPH_LAYERS = 4  # blocks of distinct weights per graph: 4 x 69 MB at the paper's shape, beyond the H100's 50 MB L2


def dense_block_infer(x, wg, wu, wd):
    """The dense baseline, three F.linear + relu + mul: the torch path's block without statistics."""
    return dense_block(x, wg, wu, wd, False)[0]


# The baseline through inductor (relu and mul fused into one pass over [M, N]), as trainer.compile=true runs layers.
compiled_dense_block_infer = torch.compile(dense_block_infer)


def bench_case(m, k, n, nnz, sigma, meter, energy_s, seed=0) -> dict:
    x, wg, wu, wd = synthetic_block(m, k, n, nnz, sigma, seed=seed)
    dense = TorchFFN()

    def run_dense():
        return dense_block_infer(x, wg, wu, wd)

    def run_dense_stats():
        return dense.forward(x, wg, wu, wd, training=False).y_MK

    with torch.inference_mode():
        ref = gated_mlp_ref(x, wg, wu, wd, upcast=True)[0]
        first = twell_gated_mlp(x, wg, wu, wd)
    l0_mean, l0_max, tail = density_of(first.l0_M)  # as a model's layer knows them after its first calls
    l0 = (l0_mean, l0_max)

    def run_twell(route="auto", statistics=False):
        return twell_gated_mlp(x, wg, wu, wd, gate_route=route, l0_hint=l0, statistics=statistics, tail=tail)

    with torch.inference_mode():
        result = run_twell()  # the call timed below: its error and path are reported
        row = {
            "M": m,
            "K": k,
            "N": n,
            "target_nnz": nnz,
            "sigma": sigma,
            "nnz_mean": l0_mean,
            "nnz_p99": first.l0_M.float().quantile(0.99).item() if m > 1 else first.l0_M.float().max().item(),
            "nnz_max": first.l0_M.max().item(),
            "err_twell": relative_error(result.y_MK, ref),
            "err_dense": relative_error(run_dense(), ref),
            "path": result.path,
            "overflow_rows": result.dense_rows(),
        }
        del ref
        reps = 30 if m >= 1024 else 200
        row["dense_ms"] = time_ms(run_dense, reps=reps)
        row["dense_stats_ms"] = time_ms(run_dense_stats, reps=reps)
        row["twell_stats_ms"] = time_ms(lambda: run_twell(statistics=True), reps=reps)
        row["dense_compiled_ms"] = time_ms(lambda: compiled_dense_block_infer(x, wg, wu, wd), reps=reps)
        row["twell_ms"] = time_ms(run_twell, reps=reps)
        row["dense_b2b_ms"] = time_ms(run_dense, reps=reps, drain=False)
        row["twell_b2b_ms"] = time_ms(run_twell, reps=reps, drain=False)
        row["dense_mJ"] = energy_mj_per_call(meter, run_dense, energy_s)
        row["twell_mJ"] = energy_mj_per_call(meter, run_twell, energy_s)
        if m <= GRAPH_MAX_M:
            more = [synthetic_block(m, k, n, nnz, sigma, seed=seed + i) for i in range(1, GRAPH_LAYERS)]
            layers = [(x, wg, wu, wd), *more]
            row["dense_graph_ms"] = graph_ms(lambda: [dense_block_infer(*block) for block in layers]) / GRAPH_LAYERS
            row["twell_graph_ms"] = (
                graph_ms(lambda: [twell_gated_mlp(*block, l0_hint=l0, statistics=False, tail=tail) for block in layers])
                / GRAPH_LAYERS
            )
    predicted = TwellFFN().estimated_ms(m, k, n, row["nnz_mean"], row["nnz_max"], False, tail=tail)
    row["twell_predicted_ms"] = predicted
    row["auto"] = "twell" if predicted < SWITCH_MARGIN * dense.estimated_ms(m, k, n, 0, 0, False) else "torch"
    # What a model gains from kernel=auto: the torch backend also computes the statistics, so compare to it.
    auto_ms = row["twell_stats_ms"] if row["auto"] == "twell" else row["dense_stats_ms"]
    row["speedup"] = row["dense_ms"] / row["twell_ms"]
    row["speedup_compiled"] = row["dense_compiled_ms"] / row["twell_ms"]
    row["speedup_b2b"] = row["dense_b2b_ms"] / row["twell_b2b_ms"]
    row["auto_speedup"] = row["dense_stats_ms"] / auto_ms
    return row


def calibrate(k: int, n: int) -> list[dict]:
    """Component timings for the cost model: the gate GEMMs vs M, and the direct up+down walk vs non-zeros."""
    rows = []
    with torch.inference_mode():
        for m in (1, 16, 64, 256, 512, 1024, 2048, 4096, 16384):
            x, wg, _, _ = synthetic_block(m, k, n, 56)
            rows.append(
                {
                    "what": "gate",
                    "M": m,
                    "torch_matmul_ms": time_ms(lambda: torch.nn.functional.linear(x, wg)),
                    "fused_ms": time_ms(lambda: twell_gate(x, wg)),
                }
            )
        for m in (1, 64, 16384):
            for nnz in (0.001, 28, 56, 112, 280):  # ~0: the fixed cost per call
                x, wg, wu, wd = synthetic_block(m, k, n, nnz)
                gate = F.linear(x, wg)
                wt = wd.t().contiguous()
                for what, call in (("direct_up_down", lambda: direct_up_down(x, gate, wu, wt)),):
                    ms = time_ms(call)
                    gbps = m * nnz * 4 * k / (ms * 1e6)
                    rows.append({"what": what, "M": m, "nnz": nnz, "ms": ms, "GBps": gbps})
    return rows


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def run_training_block(args: argparse.Namespace, train_options: list[str]) -> None:
    """--mode train: the training block of scripts/bench_train_mlp.py at this shape, with its options, recorded as
    that script's run."""
    parser = argparse.ArgumentParser(prog="bench_mlp.py --mode train")
    train_block.add_options(parser)
    train_args = parser.parse_args(train_options)
    rows = train_block.run_cases(args.m, args.k, args.n, train_args.cases, train_args.reps, train_args.out)
    settings = {"m": args.m, "k": args.k, "n": args.n, "cases": train_args.cases, "reps": train_args.reps}
    argv = ["--m", str(args.m), "--k", str(args.k), "--n", str(args.n), *train_options]
    write_record(args.record_dir, make_record("bench_train_mlp", settings, rows, "cuda", argv))


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mode",
        choices=["infer", "train"],
        default="infer",
        help="train: forward + backward with the L1 term, as scripts/bench_train_mlp.py (at --m, --k, --n, with its "
        "own options: --cases, --reps, --out)",
    )
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=5632)
    parser.add_argument("--nnz", default="28,56,112,280,560")
    parser.add_argument("--sigmas", default="0,0.3,0.5")
    parser.add_argument("--decode-m", default="1,8,16,32,64", help='decode-sized token counts ("": none)')
    parser.add_argument("--decode-nnz", default="28,56,112")
    parser.add_argument("--energy-seconds", type=float, default=1.0)
    parser.add_argument("--calibrate", action="store_true")
    add_record_dir(parser)
    args, train_options = parser.parse_known_args(argv)
    if args.mode == "train":
        run_training_block(args, train_options)
        return
    if train_options:
        parser.error(f"unrecognized arguments: {' '.join(train_options)}")

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    meter = EnergyMeter(device)
    print(
        f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
        f"energy: {'NVML' if meter.available else meter.unavailable_reason}",
        flush=True,
    )
    results: dict[str, list] = {"cases": [], "calibration": []}
    if args.calibrate:
        results["calibration"] = calibrate(args.k, args.n)
        for row in results["calibration"]:
            print(json.dumps(row), flush=True)

    cases = [
        (args.m, nnz, s)
        for s in map(float, args.sigmas.split(","))
        for nnz in map(int, filter(None, args.nnz.split(",")))
    ]
    cases += [
        (m, nnz, 0.0)
        for m in map(int, filter(None, args.decode_m.split(",")))
        for nnz in map(int, args.decode_nnz.split(","))
    ]
    for m, nnz, sigma in cases:
        row = bench_case(m, args.k, args.n, nnz, sigma, meter, args.energy_seconds)
        results["cases"].append(row)
        print(json.dumps(row), flush=True)
    settings = {
        "m": args.m,
        "k": args.k,
        "n": args.n,
        "nnz": args.nnz,
        "sigmas": args.sigmas,
        "decode_m": args.decode_m,
        "decode_nnz": args.decode_nnz,
        "energy_seconds": args.energy_seconds,
        "calibrate": args.calibrate,
    }
    record = make_record("bench_mlp", settings, results["cases"], device, argv, calibration=results["calibration"])
    write_record(args.record_dir, record)

    print(
        "\n| M | sigma | nnz mean / p99 / max | dense ms | dense+stats ms | dense compiled ms | "
        "twell ms | speedup (vs compiled) | "
        "back to back ms dense / twell (speedup) | err twell (dense) | "
        "energy mJ dense / twell | path (overflow rows) | auto | auto speedup | "
        "graph ms dense / twell (speedup) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["cases"]:
        print(
            f"| {r['M']} | {r['sigma']} | {r['nnz_mean']:.0f} / {r['nnz_p99']:.0f} / {r['nnz_max']} | "
            f"{r['dense_ms']:.3f} | {r['dense_stats_ms']:.3f} | {r['dense_compiled_ms']:.3f} | "
            f"{r['twell_ms']:.3f} | {r['speedup']:.2f}x "
            f"({r['speedup_compiled']:.2f}x) | "
            f"{r['dense_b2b_ms']:.3f} / {r['twell_b2b_ms']:.3f} ({r['speedup_b2b']:.2f}x) | "
            f"{r['err_twell']:.1e} ({r['err_dense']:.1e}) | "
            f"{fmt(r['dense_mJ'], '.0f')} / {fmt(r['twell_mJ'], '.0f')} | "
            f"{r['path']} ({r['overflow_rows']}) | {r['auto']} | {r['auto_speedup']:.2f}x | {graph_cell(r)} |"
        )


def graph_cell(row: dict) -> str:
    if "dense_graph_ms" not in row:
        return "-"
    dense, twell = row["dense_graph_ms"], row["twell_graph_ms"]
    return f"{dense:.4f} / {twell:.4f} ({dense / twell:.2f}x)"


if __name__ == "__main__":
    main()
