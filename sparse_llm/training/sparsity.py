"""The L1 penalty and the sparsity statistics of the FFN activations h, across layers, micro-batches and ranks.

Penalty (docs/design.md "The math"):

    L1 term = mean over layers ( mean over tokens ( sum over the N neurons |h| ) )

This is the normalisation of the code the released checkpoints were trained with. The paper's printed
formula (eq. 2) also divides by N, so a coefficient here equals N times the printed one (N = 5632 at the
paper's shapes): l1=2e-5 here is the setting of the released 2B model.

Statistics per layer: L0 = non-zeros of h per token (mean, p99, max over a logging window), sparsity
= 1 - L0/N, and the fraction of dead neurons (no token fired them over `dead_window_steps` optimizer
steps). L0 is kept as a per-layer histogram on the device, so accumulating costs no host sync and the
window's p99/max are exact; histograms and fired masks are summed/OR-ed over ranks before use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from sparse_llm.ffn.backend import HEAVY_TOKEN_NNZ, FFNResult, Tail, landed
from sparse_llm.ffn.dispatch import LayerDispatcher
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.training.config import SparsityConfig

# all_reduce(tensor, op) with op in {"sum", "max"}; returns the reduced tensor (identity on one process).
Reducer = Callable[[torch.Tensor, str], torch.Tensor]


L1_WARMUP_SHAPES = ("linear", "sine")


def l1_coefficient(l1: float, step: int, warmup_steps: int, shape: str = "linear") -> float:
    """The L1 coefficient at optimizer step `step` (0-based) under a warm-up of `shape` (L1_WARMUP_SHAPES)."""
    if shape not in L1_WARMUP_SHAPES:
        raise ValueError(f"sparsity.l1_warmup_shape={shape!r}; use one of {', '.join(L1_WARMUP_SHAPES)}.")
    if warmup_steps <= 0:
        return l1
    progress = min(1.0, (step + 1) / warmup_steps)
    return l1 * (math.sin(math.pi / 2 * progress) if shape == "sine" else progress)


def l1_term(results: list[FFNResult], weights_L: torch.Tensor | None = None) -> torch.Tensor:
    """mean over layers of (sum over tokens and neurons |h|) / tokens, each layer's share times weights_L[layer]
    when given (LayerBalance)."""
    per_layer_L = torch.stack([r.l1_sum / max(r.l0_M.numel(), 1) for r in results])
    if weights_L is not None:
        per_layer_L = per_layer_L * weights_L
    return per_layer_L.mean()


class LayerBalance:
    """Weights of the layers' shares in the L1 term that pull every layer toward the same L0.

    Trained with one coefficient, the layers settle far apart: a 2B model's first layer kept ~17x the non-zeros per
    token of its median layer and its last three 5-7x (docs/performance.md), and such layers run the sparse
    kernels no faster than dense GEMMs. After each optimizer step, each layer's log-weight moves by `rate` times how
    far its log
    L0 over that step lies above the layers' mean log L0, then the log-weights are centred and bounded by
    +-log(bound). Their geometric mean stays 1, so the penalty's overall strength stays `l1`'s; denser layers
    get more of it and sparser ones less.
    """

    def __init__(self, layers: int, rate: float, bound: float, device: torch.device, reduce: Reducer) -> None:
        if rate < 0:
            raise ValueError(
                f"sparsity.layer_balance={rate}: give a rate >= 0 (0 turns the balance off, ~0.02 "
                "moves a weight by a few percent a step)."
            )
        if bound < 1:
            raise ValueError(f"sparsity.layer_balance_max={bound}: give a bound >= 1 on the layers' L1 weights.")
        self.rate = rate
        self.log_bound = math.log(bound)
        self.reduce = reduce
        self.log_weights_L = torch.zeros(layers, dtype=torch.float32, device=device)
        self.weights_L = torch.ones(layers, dtype=torch.float32, device=device)
        self.nonzeros_L = torch.zeros(layers, dtype=torch.float32, device=device)  # over this step's micro-batches

    @torch.no_grad()
    def accumulate(self, results: list[FFNResult]) -> None:
        self.nonzeros_L += torch.stack([r.l0_M for r in results]).sum(dim=1, dtype=torch.float32)

    @torch.no_grad()
    def end_optimizer_step(self) -> None:
        # Only the layers' L0 relative to each other matters, so summed non-zeros stand in for the mean; a layer
        # with none at all counts one, which lowers its weight at the bounded rate.
        log_l0_L = self.reduce(self.nonzeros_L, "sum").clamp_min(1.0).log()
        self.nonzeros_L.zero_()
        moved_L = self.log_weights_L + self.rate * (log_l0_L - log_l0_L.mean())
        self.load((moved_L - moved_L.mean()).clamp(-self.log_bound, self.log_bound))

    def load(self, log_weights_L: torch.Tensor) -> None:
        """Sets the layers' log-weights (fp32 [layers], on any device) and the weights the L1 term reads."""
        self.log_weights_L.copy_(log_weights_L)
        torch.exp(self.log_weights_L, out=self.weights_L)


def _quantile_from_hist(hist: torch.Tensor, q: float) -> int:
    """Smallest L0 value v such that a fraction >= q of tokens has L0 <= v."""
    cdf = hist.cumsum(0)
    target = q * cdf[-1]
    return int(torch.searchsorted(cdf, target).item())


def held_rows(w_NK: torch.nn.Parameter) -> tuple[torch.Tensor, int]:
    """(the rows of weight w_NK that this process holds, as a tensor to write in place; the first one's index in
    w_NK): all N rows, or under FSDP2 this rank's shard of dim 0 (FSDP2 splits it as torch.chunk does)."""
    data = w_NK.data
    if type(data) is torch.Tensor:
        return data, 0
    from torch.distributed.tensor import DTensor, Shard  # only sharded runs get here

    if not isinstance(data, DTensor) or tuple(data.placements) != (Shard(0),):
        raise NotImplementedError(
            f"Dead-neuron reinit handles whole weights and FSDP2's row shards (Shard(0)), not a {type(data).__name__} "
            f"placed {getattr(data, 'placements', '?')}; set sparsity.reinit_dead=false for this setup."
        )
    rows_per_rank = -(-data.shape[0] // data.device_mesh.size())
    return data.to_local(), data.device_mesh.get_local_rank() * rows_per_rank


class SparsityTracker:
    """Accumulates per-layer L0 histograms and fired-neuron masks between reads."""

    def __init__(self, mlps: list[SparseMLP], cfg: SparsityConfig, reducer: Reducer | None = None) -> None:
        if not mlps:
            raise ValueError("The model has no SparseMLP layers; build it with sparse_llm.model.llama.build_model.")
        self.mlps = mlps
        self.cfg = cfg
        self.reduce: Reducer = reducer or (lambda t, op: t)
        device = mlps[0].gate_proj.weight.device
        n = mlps[0].intermediate_size
        self.n = n
        self.l0_hist_LB = torch.zeros(len(mlps), n + 1, dtype=torch.int64, device=device)
        self._one = torch.ones((), dtype=torch.int64, device=device)
        self.fired_LN = torch.zeros(len(mlps), n, dtype=torch.bool, device=device)
        self.dead_LN: torch.Tensor | None = None  # dead mask of the last completed window (rank-reduced)
        self.steps_in_window = 0
        # Tokens each layer computed on a dense path since the last read (FFNResult.overflow_rows), and the counts
        # still on their way from the GPU (layer, pinned CPU tensor), added once a read needs them.
        self.dense_rows_L = [0] * len(mlps)
        self.pending_rows: list[tuple[int, torch.Tensor]] = []
        self.backends_L = [mlp.dispatcher.current for mlp in mlps]  # each layer's backend as `switches` last saw it
        self.balance = (
            LayerBalance(len(mlps), cfg.layer_balance, cfg.layer_balance_max, device, self.reduce)
            if cfg.layer_balance
            else None
        )

    @property
    def l1_weights_L(self) -> torch.Tensor | None:
        """The layers' weights in the L1 term (None: equal weights)."""
        return None if self.balance is None else self.balance.weights_L

    def collect(self) -> list[FFNResult]:
        """The results of each layer's latest forward; call right after the model's forward."""
        results = [m.last_result for m in self.mlps]
        if any(r is None for r in results):
            raise RuntimeError("A SparseMLP has not run yet; call the model before collecting its sparsity.")
        return results

    @torch.no_grad()
    def accumulate(self, results: list[FFNResult]) -> None:
        for layer, r in enumerate(results):
            # Counts added into the fixed N + 1 bins: torch.bincount would read the largest count back to the
            # host to size its output, a sync per layer and micro-batch.
            l0_M = r.l0_M.long()
            self.l0_hist_LB[layer].index_add_(0, l0_M, self._one.expand_as(l0_M))
            self.fired_LN[layer] |= r.fired_N
            if isinstance(r.overflow_rows, torch.Tensor):
                self.pending_rows.append((layer, r.overflow_rows))
            else:
                self.dense_rows_L[layer] += r.overflow_rows
        if self.balance is not None:
            self.balance.accumulate(results)

    def _settle_pending_rows(self) -> None:
        for layer, count in self.pending_rows:
            self.dense_rows_L[layer] += landed(count)[0]
        self.pending_rows = []

    @torch.no_grad()
    def end_optimizer_step(self, step: int, seed: int) -> int:
        """Close the dead-neuron window when due (and re-initialise dead gates if enabled).

        Returns the number of re-initialised neurons (0 when the window is still open or reinit is off).
        """
        if self.balance is not None:
            self.balance.end_optimizer_step()
        self.steps_in_window += 1
        if self.steps_in_window < self.cfg.dead_window_steps:
            return 0
        fired_LN = self.reduce(self.fired_LN.to(torch.int32), "max").bool()
        self.dead_LN = ~fired_LN
        self.fired_LN.zero_()
        self.steps_in_window = 0
        if not self.cfg.reinit_dead:
            return 0
        return self._reinit_dead(step, seed)

    def _reinit_dead(self, step: int, seed: int) -> int:
        # Same generator state on every rank: replicas receive identical updates and stay in sync, and FSDP's shards
        # together receive the one process's update.
        gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)
        mix = self.cfg.reinit_mix
        total = 0
        for layer, mlp in enumerate(self.mlps):
            w_gate_NK = mlp.gate_proj.weight
            rows_D = self.dead_LN[layer].nonzero().squeeze(1)
            if not rows_D.numel():
                continue
            # Noise for all the dead rows, drawn on the CPU so every rank draws the same numbers; each rank applies
            # the rows it holds.
            noise_DK = torch.randn(rows_D.numel(), w_gate_NK.shape[1], generator=gen) * self.cfg.reinit_std
            held_HK, first = held_rows(w_gate_NK)
            mine_D = (rows_D >= first) & (rows_D < first + held_HK.shape[0])
            rows_R = rows_D[mine_D] - first
            noise_RK = noise_DK[mine_D.cpu()].to(held_HK.device, held_HK.dtype)
            held_HK[rows_R] = (1 - mix) * held_HK[rows_R] + mix * noise_RK
            total += rows_D.numel()
        return total

    @torch.no_grad()
    def read_window(self) -> dict[str, float]:
        """Per-layer and model-mean L0 / sparsity / dead statistics and dense-rerouted rows since the last read
        (rank-reduced).

        Feeds every layer's dispatcher with the same reduced numbers, so `auto` decisions agree across ranks.
        """
        hist_LB = self.reduce(self.l0_hist_LB.clone(), "sum").cpu()
        self.l0_hist_LB.zero_()
        values_B = torch.arange(self.n + 1, dtype=torch.float64)
        stats: dict[str, float] = {}
        means = []
        for layer, mlp in enumerate(self.mlps):
            hist = hist_LB[layer]
            tokens = int(hist.sum())
            if tokens == 0:
                continue
            mean = float((hist.double() * values_B).sum() / tokens)
            l0_max = int(hist.nonzero().max())
            tag = f"layer_{layer:02d}"
            stats[f"l0/{tag}"] = mean
            stats[f"l0_p99/{tag}"] = _quantile_from_hist(hist, 0.99)
            stats[f"l0_max/{tag}"] = l0_max
            stats[f"sparsity/{tag}"] = 1 - mean / self.n
            mlp.dispatcher.observe(mean, l0_max, _tail_of(hist, values_B))
            means.append(mean)
        if means:
            stats["l0/mean"] = sum(means) / len(means)
            stats["sparsity/mean"] = 1 - stats["l0/mean"] / self.n
        # Tokens rerouted to a dense path (sparse-kernel rows that exceeded their format), summed over ranks;
        # per layer only where there were any.
        self._settle_pending_rows()
        dense_rows_L = self.reduce(torch.tensor(self.dense_rows_L, device=self.l0_hist_LB.device), "sum").tolist()
        self.dense_rows_L = [0] * len(self.mlps)
        stats["dense_rows/total"] = sum(dense_rows_L)
        for layer, rows in enumerate(dense_rows_L):
            if rows:
                stats[f"dense_rows/layer_{layer:02d}"] = rows
        if self.dead_LN is not None:
            dead_L = self.dead_LN.float().mean(dim=1).cpu()
            for layer, frac in enumerate(dead_L.tolist()):
                stats[f"dead/layer_{layer:02d}"] = frac
            stats["dead/mean"] = float(dead_L.mean())
        if self.balance is not None:
            for layer, weight in enumerate(self.balance.weights_L.tolist()):
                stats[f"l1_weight/layer_{layer:02d}"] = weight
        return stats

    def state_dict(self) -> dict[str, Any]:
        """This rank's open windows and each layer's last observed L0, for checkpoints (tensors on CPU)."""
        self._settle_pending_rows()
        return {
            "l0_hist_LB": self.l0_hist_LB.cpu(),
            "fired_LN": self.fired_LN.cpu(),
            "dead_LN": None if self.dead_LN is None else self.dead_LN.cpu(),
            "steps_in_window": self.steps_in_window,
            "dense_rows_L": list(self.dense_rows_L),
            "observed": [_observation(m.dispatcher) for m in self.mlps],
            "l1_log_weights_L": None if self.balance is None else self.balance.log_weights_L.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["fired_LN"].shape) != tuple(self.fired_LN.shape):
            raise ValueError(
                f"sparsity state for {tuple(state['fired_LN'].shape)} (layers, neurons) does not fit this model's "
                f"{tuple(self.fired_LN.shape)}"
            )
        device = self.fired_LN.device
        self.l0_hist_LB = state["l0_hist_LB"].to(device)
        self.fired_LN = state["fired_LN"].to(device)
        self.dead_LN = None if state["dead_LN"] is None else state["dead_LN"].to(device)
        self.steps_in_window = int(state["steps_in_window"])
        self.dense_rows_L = list(state.get("dense_rows_L", [0] * len(self.mlps)))  # absent in older checkpoints
        log_weights_L = state.get("l1_log_weights_L")  # absent in older checkpoints
        if self.balance is not None and log_weights_L is not None:
            self.balance.load(log_weights_L.to(device))
        for mlp, (l0_mean, l0_max, *tail) in zip(self.mlps, state["observed"], strict=True):  # older: no tail
            if l0_mean is not None:
                mlp.dispatcher.observe(l0_mean, l0_max, Tail(*tail[0]) if tail and tail[0] is not None else None)

    def backends(self) -> dict[str, str | int]:
        """Which path each layer took in its latest call, and how many layers are on a sparse backend."""
        paths = {
            f"backend/layer_{i:02d}": (m.last_result.path if m.last_result else "none") for i, m in enumerate(self.mlps)
        }
        return paths | {"backend/sparse_layers": sum(m.dispatcher.current != "torch" for m in self.mlps)}

    def switches(self) -> list[str]:
        """The layers whose backend changed since the last call, each as "layer NN: old -> new (L0 mean)": with
        `kernel=auto` a layer leaves the dense path once its observed sparsity makes a sparse backend the cheaper."""
        switched = []
        for i, mlp in enumerate(self.mlps):
            now = mlp.dispatcher.current
            if now != self.backends_L[i]:
                l0 = mlp.dispatcher.l0_mean
                switched.append(
                    f"layer {i:02d}: {self.backends_L[i]} -> {now}" + ("" if l0 is None else f" (L0 {l0:.1f})")
                )
                self.backends_L[i] = now
        return switched


class NoSparsity:
    """`SparsityTracker`'s interface for a model without SparseMLPs (a dense SiLU or GELU baseline): no statistics,
    no L1 term, nothing to checkpoint."""

    l1_weights_L = None

    def collect(self) -> list[FFNResult]:
        return []

    def accumulate(self, results: list[FFNResult]) -> None:
        pass

    def end_optimizer_step(self, step: int, seed: int) -> int:
        return 0

    def read_window(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def backends(self) -> dict[str, str | int]:
        return {}

    def switches(self) -> list[str]:
        return []


def _tail_of(hist_B: torch.Tensor, values_B: torch.Tensor) -> Tail:
    """The heavy tokens' shares of a layer's tokens and non-zeros, from its histogram of non-zeros per token."""
    heavy_B = hist_B[HEAVY_TOKEN_NNZ + 1 :].double()
    nonzeros = float((hist_B.double() * values_B).sum())
    heavy_nonzeros = float((heavy_B * values_B[HEAVY_TOKEN_NNZ + 1 :]).sum())
    return Tail(float(heavy_B.sum() / hist_B.sum()), heavy_nonzeros / nonzeros if nonzeros else 0.0)


def _observation(dispatcher: LayerDispatcher) -> tuple[float | None, float | None, tuple[float, float] | None]:
    """A dispatcher's last observation in plain types, for checkpoints: (mean, max, (tail tokens, tail non-zeros))."""
    tail = dispatcher.tail
    return dispatcher.l0_mean, dispatcher.l0_max, None if tail is None else (tail.tokens, tail.nonzeros)
