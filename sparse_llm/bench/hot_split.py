"""What taking a layer's most often firing neurons through the tensor cores would save, measured on real FFN inputs.

The FFN output is a sum over neurons, so a block splits exactly into its cold neurons (through the sparse training
op) and its H hottest ones (a dense block of width H, tensor-core GEMMs): y = y_cold + y_hot, l1 = l1_cold + l1_hot.
The sparse op pays per non-zero (seven K-wide rows each, sparse_llm/ffn/twell/train_op.py) while a dense neuron
costs the same whatever share of the tokens it fires for, so a neuron that fires for more than about 1% of the tokens
is cheaper dense. `measure_layer` times, forward + backward with the L1 term, the whole block dense, through the
sparse op, and split at each H: the time a hot-neuron side path could reach, before the cost of building it into the
op (the split here works on copies of the weight rows, made once). scripts/bench_hot_split.py runs it on a model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from transformers import LlamaForCausalLM

from sparse_llm.bench.concentration import gate_positives
from sparse_llm.bench.model_setup import decoder_layers, forward_with_mlp_hooks
from sparse_llm.bench.timing import time_ms
from sparse_llm.bench.train_block import backward, compiled_dense_forward, dense_forward, sparse_forward

L1_COEFF = 2e-5  # the paper's L1 coefficient: the L1 term's gradient scale in the backward (its cost does not vary)

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w_gate [N, K], w_up [N, K], w_down [K, N]


@torch.no_grad()
def layer_inputs(
    model: LlamaForCausalLM, input_ids_BT: torch.Tensor, layers: Sequence[int], dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """Layer index -> its FFN input [B * T, K] in `dtype`, from one forward pass of input_ids_BT [B, T]."""
    inputs: dict[int, torch.Tensor] = {}
    wanted = set(layers)

    def keep(index: int):
        def hook(mlp: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if index in wanted:
                inputs[index] = args[0].reshape(-1, args[0].shape[-1]).to(dtype)

        return hook

    forward_with_mlp_hooks(model, input_ids_BT, keep)
    return inputs


def layer_weights(model: LlamaForCausalLM, index: int, dtype: torch.dtype) -> Weights:
    mlp = decoder_layers(model)[index].mlp
    return tuple(p.detach().to(dtype) for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))


def split_weights(weights: Weights, hot_N: torch.Tensor) -> tuple[Weights, Weights]:
    """(cold, hot): copies of the weights of the neurons where hot_N (bool [N]) is False, and where it is True."""
    w_gate_NK, w_up_NK, w_down_KN = weights
    parts = []
    for rows in (~hot_N, hot_N):
        index = rows.nonzero().squeeze(1)
        parts.append((w_gate_NK[index].clone(), w_up_NK[index].clone(), w_down_KN[:, index].clone()))
    return parts[0], parts[1]


def split_forward(
    x_MK: torch.Tensor, cold: Weights, hot: Weights, l0_hint: tuple[float, float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, l1_sum) of the whole block: the cold neurons through the sparse op, the hot ones through the dense path."""
    y_cold, l1_cold = sparse_forward(x_MK, *cold, l0_hint=l0_hint)
    if hot[0].shape[0] == 0:
        return y_cold, l1_cold
    y_hot, l1_hot = dense_forward(x_MK, *hot)
    return y_cold + y_hot.to(y_cold.dtype), l1_cold + l1_hot.to(l1_cold.dtype)


def _l0_hint(l0_M: torch.Tensor) -> tuple[float, float]:
    """The sparse op's hint from per-token gate positives: (mean, max)."""
    return l0_M.double().mean().item(), float(l0_M.max())


def measure_layer(
    x_MK: torch.Tensor, weights: Weights, hot_sizes: Sequence[int], reps: int, compiled: bool
) -> dict[str, float | int]:
    """One layer's row: its L0; ms of forward + backward (back to back, after 3 warm-up calls) dense, compiled dense
    (if `compiled`), through the sparse op, and for each H in hot_sizes: the H most often firing neurons' share of the
    non-zeros and the lowest fire rate among them, the cold neurons' L0, the split block's ms and its hot part's."""
    m = x_MK.shape[0]
    x_MK = x_MK.detach().requires_grad_()
    full = tuple(w.detach().clone().requires_grad_() for w in weights)
    dy_MK = (torch.randn(m, x_MK.shape[1], device=x_MK.device) / m**0.5).to(x_MK.dtype)
    coeff = torch.tensor(L1_COEFF / m, device=x_MK.device)
    l0_M, counts_N = gate_positives(x_MK, full[0])
    hint = _l0_hint(l0_M)
    row: dict[str, float | int] = {"l0": round(hint[0], 2), "l0_max": int(hint[1])}

    def timed(forward, leaves) -> float:
        def step():
            return backward(*forward(), leaves, dy_MK, coeff)

        return round(time_ms(step, warmup=3, reps=reps, drain=False), 3)

    row["dense_ms"] = timed(lambda: dense_forward(x_MK, *full), [x_MK, *full])
    if compiled:
        row["compiled_ms"] = timed(lambda: compiled_dense_forward(x_MK, *full), [x_MK, *full])
    row["sparse_ms"] = timed(lambda: sparse_forward(x_MK, *full, l0_hint=hint), [x_MK, *full])
    order_N = counts_N.argsort(descending=True, stable=True)
    total = max(int(counts_N.sum()), 1)
    for h in hot_sizes:
        hot_N = torch.zeros_like(counts_N, dtype=torch.bool)
        hot_N[order_N[:h]] = True
        cold, hot = (tuple(w.requires_grad_() for w in part) for part in split_weights(weights, hot_N))
        cold_hint = _l0_hint(gate_positives(x_MK, cold[0])[0])
        row[f"h{h}_share"] = round(int(counts_N[hot_N].sum()) / total, 4)
        row[f"h{h}_min_rate"] = round(int(counts_N[order_N[h - 1]]) / m, 4) if h else 0.0
        row[f"h{h}_cold_l0"] = round(cold_hint[0], 2)
        row[f"h{h}_split_ms"] = timed(functools.partial(split_forward, x_MK, cold, hot, cold_hint), [x_MK, *cold, *hot])
        row[f"h{h}_hot_ms"] = timed(lambda hot=hot: dense_forward(x_MK, *hot), [x_MK, *hot]) if h else 0.0
    return row


def total_row(rows: Sequence[dict[str, float | int]]) -> dict[str, float | str]:
    """The layers' ms summed (one micro-batch through those layers), and two sums of each layer's fastest path:
    `today_ms` of the dense path (compiled where measured, as `trainer.compile` runs it) and the sparse op, as a
    layer's backend choice has them; `best_ms` with the splits as well (a hot-neuron side path that picks H per layer,
    or none). What the side path could save is today_ms - best_ms."""
    keys = [k for k in rows[0] if k.endswith("_ms")]
    total: dict[str, float | str] = {"layer": "sum"}
    total.update({k: round(sum(float(r[k]) for r in rows), 3) for k in keys})

    def fastest(row: dict[str, float | int], splits: bool) -> float:
        dense = row.get("compiled_ms", row["dense_ms"])
        splits_ms = [v for k, v in row.items() if k.endswith("_split_ms")] if splits else []
        return float(min(dense, row["sparse_ms"], *splits_ms))

    total["today_ms"] = round(sum(fastest(r, False) for r in rows), 3)
    total["best_ms"] = round(sum(fastest(r, True) for r in rows), 3)
    return total
