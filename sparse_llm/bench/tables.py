"""Markdown tables of a model-level benchmark's results (the console report of scripts/bench_model.py)."""

from __future__ import annotations

import math

from sparse_llm.bench.measure import MODES, VariantResult, speed_ratios
from sparse_llm.bench.model_setup import STOCK
from sparse_llm.bench.timing import KERNEL_FAMILIES


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """value in `spec`, or "-" where it was not measured (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) + suffix


def summary_table(results: list[VariantResult]) -> list[str]:
    lines = [
        "| mode | kernel | micro-batch | ms/iter (min-max) | tokens/ms | vs stock | vs torch | peak GiB | mJ/token | "
        "L0 mean (layer avg) | L0 p99 (worst layer) | L0 max | layer paths |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, (vs_stock, vs_torch) in zip(results, speed_ratios(results), strict=True):
        if r.skipped:
            lines.append(f"| {r.mode} | {r.kernel} | {r.batch} | skipped: {r.skipped} |" + " |" * 9)
            continue
        ratios = [fmt(vs_stock, ".3f", "x"), fmt(vs_torch, ".3f", "x")]
        lo, hi = r.ms_spread
        if r.layers:
            l0 = (
                f"{sum(layer.l0_mean for layer in r.layers) / len(r.layers):.1f} | "
                f"{max(layer.l0_p99 for layer in r.layers):.0f} | {max(layer.l0_max for layer in r.layers):.0f}"
            )
        else:
            l0 = "- | - | -"
        lines.append(
            f"| {r.mode} | {r.kernel} | {r.batch} | {r.ms:.2f} ({lo:.2f}-{hi:.2f}) | {r.tokens_per_ms:.2f} | "
            f"{ratios[0]} | {ratios[1]} | {fmt(r.peak_gib, '.2f')} | {fmt(r.mj_per_token, '.4f')} | {l0} | "
            f"{r.path_summary()} |"
        )
    return lines


def breakdown_table(results: list[VariantResult]) -> list[str]:
    rows = [r for r in results if r.breakdown_ms]
    if not rows:
        return []
    keys = ["attention", "ffn gate GEMM", "ffn rest", "other fwd", "backward", "optimizer", "total"]
    lines = [
        "| mode | kernel | " + " | ".join(f"{k} ms" for k in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for r in rows:
        lines.append(f"| {r.mode} | {r.kernel} | " + " | ".join(fmt(r.breakdown_ms.get(k), ".2f") for k in keys) + " |")
    # The ceiling of our dense path: it shares the sparse rows' attention and norms (the stock row does not).
    dense = next((r for k in ("torch", STOCK) for r in rows if r.mode == "forward" and r.kernel == k), None)
    if dense is not None:
        lines += ["", forward_ceiling(dense.kernel, dense.breakdown_ms)]
    return lines


def device_table(results: list[VariantResult]) -> list[str]:
    """Device time of one step per kernel family, and the step's time the device sat idle waiting for the host."""
    rows = [r for r in results if r.device_ms]
    if not rows:
        return []
    families = [family for family, _ in KERNEL_FAMILIES] + ["other"]
    columns = ["mode", "kernel", "ms/iter", "device busy ms", "device idle ms", *(f"{f} ms" for f in families)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        busy = r.device_ms["busy"]
        cells = [fmt(r.ms, ".2f"), fmt(busy, ".2f"), fmt(max(0.0, r.ms - busy), ".2f")]
        cells += [fmt(r.device_ms.get(f, 0.0), ".2f") for f in families]
        lines.append(f"| {r.mode} | {r.kernel} | " + " | ".join(cells) + " |")
    return lines


def forward_ceiling(kernel: str, dense_ms: dict[str, float]) -> str:
    """The speed-up of a dense forward if its FFN past the gate GEMM cost nothing: the most any sparse FFN
    that keeps the dense gate GEMM can give; attention and the other layers bound it."""
    total, rest = dense_ms["total"], dense_ms["ffn rest"]
    return (
        f"Forward ceiling: with the FFN past its gate GEMM free, the `{kernel}` forward would take "
        f"{total - rest:.2f} of {total:.2f} ms ({total / (total - rest):.3f}x); attention "
        f"{dense_ms['attention']:.2f} ms, gate GEMM {dense_ms['ffn gate GEMM']:.2f} ms and the other layers "
        f"{dense_ms['other fwd']:.2f} ms remain."
    )


def layer_table(results: list[VariantResult]) -> list[str]:
    """Per-layer L0 of each mode's dense pass, and the path every sparse variant took in that layer."""
    ran = [r for r in results if not r.skipped and r.mode in MODES and r.layers]
    dense = [r for r in ran if r.kernel == "torch"]
    sparse = [r for r in ran if r.kernel != "torch"]
    if not dense:
        return []
    head = "| layer | " + " | ".join(f"{r.mode} L0 mean / p99 / max" for r in dense)
    head += "".join(f" | {r.mode} {r.kernel} path (dense rows)" for r in sparse) + " |"
    lines = [head, "|---|" + "---|" * (len(dense) + len(sparse))]
    for i in range(len(dense[0].layers)):
        cells = [f"{r.layers[i].l0_mean:.1f} / {r.layers[i].l0_p99:.0f} / {r.layers[i].l0_max:.0f}" for r in dense]
        cells += [f"{r.layers[i].path} ({r.layers[i].overflow_rows})" for r in sparse]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines


def render_report(results: list[VariantResult], header: list[str]) -> str:
    blocks = [header, summary_table(results), breakdown_table(results), device_table(results), layer_table(results)]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"
