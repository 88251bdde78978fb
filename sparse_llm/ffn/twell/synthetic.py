"""Synthetic gated blocks at a chosen sparsity: inputs for the kernels' tests and benchmarks.

The gate weights are drawn so that each token fires a chosen number of neurons on average, evenly or with a
log-normal tail of heavy tokens, which is what the kernels' routes and prices depend on.
"""

from __future__ import annotations

import math

import torch


def synthetic_block(
    m: int,
    k: int,
    n: int,
    nnz_mean: float,
    sigma: float = 0.0,
    *,
    device: torch.device | str = "cuda",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 block operands (x_MK, w_gate_NK, w_up_NK, w_down_KN) whose gate has ~nnz_mean positives per token.

    Input feature 0 is the constant 1 and every gate row's weight on it is -t: that shifts all gate
    pre-activations by -t, and t is solved for the target mean density. Token m's other features are
    N(0, 1) scaled by exp(sigma * xi_m), xi_m ~ N(0, 1), so sigma > 0 gives heavy-tailed non-zeros per
    token (a token's density grows with its scale).
    """
    gen = torch.Generator().manual_seed(seed)
    scale_M = torch.exp(sigma * torch.randn(m, generator=gen, dtype=torch.float64))
    rho = math.sqrt((k - 1) / k)  # std of z . w over the K-1 random features
    target = min(max(nnz_mean / n, 1e-9), 0.5)
    lo, hi = 0.0, 50.0
    for _ in range(100):  # bisection on the shift t for the mean density over the sampled scales
        t = (lo + hi) / 2
        density = 0.5 * torch.special.erfc(t / (scale_M * rho * math.sqrt(2))).mean().item()
        lo, hi = (t, hi) if density > target else (lo, t)
    x_MK = torch.randn(m, k, generator=gen) * scale_M[:, None].float()
    x_MK[:, 0] = 1.0
    w_gate_NK = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_gate_NK[:, 0] = -t
    w_up_NK = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w_down_KN = torch.randn(k, n, generator=gen) / math.sqrt(n)
    return tuple(t.to(device=device, dtype=torch.bfloat16).contiguous() for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN))
