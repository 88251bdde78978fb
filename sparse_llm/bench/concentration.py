"""How unevenly the FFN neurons of a model fire: per layer, how many tokens each neuron fires for, and the share of
the layer's non-zeros that its most often firing neurons carry.

The sparse kernels pay per non-zero (seven K-wide weight or activation rows each, sparse_llm/ffn/twell/train_op.py),
while a neuron taken through the tensor cores costs the same whatever share of tokens it fires for. So a neuron that
fires for more than a few percent of the tokens would be cheaper dense; `concentration_row` says how many such
neurons a layer has and what share of its non-zeros they carry. scripts/neuron_concentration.py prints and records it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM

from sparse_llm.bench.model_setup import decoder_layers, forward_with_mlp_hooks

TOKEN_CHUNK = 4096  # gate pre-activations are computed this many tokens at a time ([chunk, N] at most in memory)


@torch.no_grad()
def gate_positives(x_MK: torch.Tensor, w_gate_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(l0_M, counts_N), int64: for each of the M tokens how many gates are positive, and for each of the N neurons
    for how many tokens its gate is (a non-zero of h = relu(gate) * up wherever up is non-zero)."""
    w_gate_NK = w_gate_NK.to(x_MK.dtype)
    l0_M = torch.empty(x_MK.shape[0], dtype=torch.int64, device=x_MK.device)
    counts_N = torch.zeros(w_gate_NK.shape[0], dtype=torch.int64, device=x_MK.device)
    for start in range(0, x_MK.shape[0], TOKEN_CHUNK):
        positive_CN = x_MK[start : start + TOKEN_CHUNK] @ w_gate_NK.T > 0
        l0_M[start : start + TOKEN_CHUNK] = positive_CN.sum(dim=1)
        counts_N += positive_CN.sum(dim=0)
    return l0_M, counts_N


@torch.no_grad()
def neuron_fire_counts(model: LlamaForCausalLM, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """int64 [layers, N]: for each FFN layer, how many of the batch's tokens each neuron's gate is positive for
    (`gate_positives`), in one forward pass of `input_ids_BT` [B, T]."""
    layers = decoder_layers(model)
    n = layers[0].mlp.gate_proj.weight.shape[0]
    counts_LN = torch.zeros(len(layers), n, dtype=torch.int64, device=input_ids_BT.device)

    def count(index: int):
        def hook(mlp: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            counts_LN[index] += gate_positives(args[0].reshape(-1, args[0].shape[-1]), mlp.gate_proj.weight)[1]

        return hook

    forward_with_mlp_hooks(model, input_ids_BT, count)
    return counts_LN


def concentration_row(
    counts_N: torch.Tensor, tokens: int, top_shares: Sequence[float], dense_rate: float, layers: int = 1
) -> dict[str, float | int]:
    """The row of fire counts [N] over `tokens` tokens (of one layer, or of `layers` layers' neurons flattened):
    mean non-zeros per token and layer (L0), the share of neurons that never fired, the share of all non-zeros
    carried by the top `top_shares` fractions of neurons (most often firing first), and how many neurons fire for
    more than `dense_rate` of the tokens and the share of non-zeros they carry."""
    n = counts_N.numel()
    sorted_N = counts_N.double().sort(descending=True).values
    total = float(sorted_N.sum())
    row: dict[str, float | int] = {
        "l0_mean": round(total / max(tokens * layers, 1), 2),
        "never_fired": round(float((counts_N == 0).double().mean()), 4),
    }
    for share in top_shares:
        top = max(1, round(share * n))
        row[f"top_{share:g}_share"] = round(float(sorted_N[:top].sum()) / total, 4) if total else 0.0
    above_N = sorted_N > dense_rate * tokens
    row["above_rate_neurons"] = int(above_N.sum())
    row["above_rate_share"] = round(float(sorted_N[above_N].sum()) / total, 4) if total else 0.0
    return row
