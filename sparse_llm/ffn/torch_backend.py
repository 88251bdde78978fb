"""The torch backend: the gated block as dense GEMMs, the reference path that runs anywhere.

`dense_block` is also what the sparse backends fall back to for a call they cannot take, and what the training
op's benchmarks compare against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparse_llm.ffn.backend import FFNBackend, FFNResult


def _sparsity_of(h_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token non-zero counts [M] (int32) and per-neuron fired mask [N] of a dense activation."""
    nonzero_MN = h_MN.detach() != 0
    return nonzero_MN.sum(dim=1, dtype=torch.int32), nonzero_MN.any(dim=0)  # one compare, two reads of the mask


def dense_block(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    statistics: bool,
    residual_MK: torch.Tensor | None = None,
    residual_writable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(y_MK, l1_sum, l0_M, fired_N) of the gated block in torch ops (y_MK plus residual_MK when given, written into
    residual_MK's memory when `residual_writable`); the last three None without statistics."""
    g_MN = F.relu(F.linear(x_MK, w_gate_NK))
    h_MN = g_MN * F.linear(x_MK, w_up_NK)
    if residual_MK is None:
        y_MK = F.linear(h_MN, w_down_KN)
    elif residual_writable:
        y_MK = add_linear_(residual_MK, h_MN, w_down_KN)
    else:
        y_MK = residual_MK + F.linear(h_MN, w_down_KN)
    if not statistics:
        return y_MK, None, None, None
    # Accumulated in fp32 (bf16 sums over 10^5+ terms lose most of their digits) without an fp32 copy
    # of h: at M=16384, N=5632 a copy costs more than a GEMM.
    l1_sum = torch.linalg.vector_norm(h_MN, ord=1, dtype=torch.float32)
    l0_M, fired_N = _sparsity_of(h_MN)
    return y_MK, l1_sum, l0_M, fired_N


@functools.cache
def _compiled_dense_block(backend: str) -> Callable[..., tuple]:
    """dense_block through torch.compile: the ReLU, the product and the statistics fuse into the GEMMs' neighbours
    (one pass over h instead of five, forward and backward)."""
    return torch.compile(dense_block, backend=backend)


# The eager statistics pass over h (L1, L0, fired) per element of [M, N]: memory-bound, fitted on the H100 block
# (docs/kernels.md, tuned constants).
STATS_MS_PER_ELEMENT = 0.85 / (16384 * 5632)

# A few tokens cannot keep the tensor cores busy: the dense block then streams its three weights from HBM. Priced as a
# fixed cost plus the weights at a rate that puts it at or under its fastest calls measured in CUDA graphs, so that a
# sparse path must beat the dense block's best (docs/kernels.md, tuned constants).
DENSE_WEIGHT_FIXED_MS = 0.010

DENSE_WEIGHT_GBPS = 2800.0


def add_linear_(
    acc_MK: torch.Tensor, a_MJ: torch.Tensor, w_KJ: torch.Tensor, bias_K: torch.Tensor | None = None
) -> torch.Tensor:
    """acc_MK += F.linear(a_MJ, w_KJ, bias_K), in acc_MK's memory; returns acc_MK.

    On a GPU, without a bias and where the three dtypes agree, this is one GEMM that reads acc_MK in its epilogue
    (cuBLAS's beta = 1), which saves the add's own pass over [M, K] (docs/kernels.md, measured choices). Otherwise (a
    bias, a bf16 product into an fp32 stream under autocast, or the CPU) the GEMM and then an in-place add. On the CPU
    the fused form buys nothing, and MKL's sgemm with beta = 1 rounds apart from the product plus the add on some CPUs
    (AVX-512: a third of the values at 32 x 256 x 64), so the CPU keeps the stock model's bits."""
    if acc_MK.is_cuda and bias_K is None and acc_MK.dtype == a_MJ.dtype == w_KJ.dtype:
        return acc_MK.addmm_(a_MJ, w_KJ.t())
    return acc_MK.add_(F.linear(a_MJ, w_KJ, bias_K))


def with_residual(result: FFNResult, residual_MK: torch.Tensor | None) -> FFNResult:
    """result with residual_MK added to its y_MK (for backends that cannot add it as they write y)."""
    if residual_MK is not None:
        result.y_MK = residual_MK + result.y_MK
    return result


class TorchFFN(FFNBackend):
    """The reference path: three dense GEMMs through torch (cuBLAS on GPU). Runs everywhere."""

    name = "torch"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def forward(
        self,
        x_MK,
        w_gate_NK,
        w_up_NK,
        w_down_KN,
        *,
        training,
        statistics=True,
        compile_backend=None,
        residual_MK=None,
        residual_writable=False,
        l0=None,
        tail=None,
        output_norm=None,
    ):
        block = dense_block if compile_backend is None else _compiled_dense_block(compile_backend)
        # a compiled block writes nothing in place: inductor would copy the result back into the input
        writable = residual_writable and compile_backend is None
        # four passes over h saved without statistics: about 0.6 ms per layer at 16384 x 5632
        y_MK, l1_sum, l0_M, fired_N = block(
            x_MK, w_gate_NK, w_up_NK, w_down_KN, training or statistics, residual_MK, writable
        )
        return FFNResult(y_MK=y_MK, l1_sum=l1_sum, l0_M=l0_M, fired_N=fired_N, path=self.name)

    def estimated_ms(self, m, k, n, l0_mean, l0_max, training, compiled=False, tail=None):
        # Dense cost does not depend on sparsity. Three GEMMs forward (2mkn flops each), six more backward,
        # at 600 TFLOP/s, a sustained bf16 rate of an H100 on GEMMs of these sizes; plus, in eager training, the
        # statistics pass over h (L1, L0, fired), memory-bound elementwise work (STATS_MS_PER_ELEMENT). Compiled,
        # that work fuses into the GEMMs' neighbours and the GEMMs alone price the block (docs/kernels.md, tuned
        # constants). Inference calls skip the statistics unless recorded, so a sparse backend is weighed against the
        # bare GEMMs there: the stricter comparison. Few tokens' inference streams the weights instead
        # (DENSE_WEIGHT_GBPS).
        flops = 2.0 * m * k * n * (9 if training else 3)
        statistics_ms = m * n * STATS_MS_PER_ELEMENT if training and not compiled else 0.0
        weights_ms = 0.0 if training else DENSE_WEIGHT_FIXED_MS + 3 * k * n * 2 / (DENSE_WEIGHT_GBPS * 1e6)
        return max(flops / 600e12 * 1e3, weights_ms) + statistics_ms
