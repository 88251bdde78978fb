"""Sparse activation formats of the gated feedforward block, in plain torch.

This module is the specification of the two formats, the CPU execution path and the test oracle
that every CUDA kernel is compared against. Everything here is exact up to the documented rounding
points; nothing is ever dropped (rows that do not fit a format are routed to a dense path).

The block (nn.Linear layouts)::

    g_MN = relu(x_MK @ w_gate_NK^T)     u_MN = x_MK @ w_up_NK^T
    h_MN = g_MN * u_MN                  y_MK = h_MN @ w_down_KN^T

Shape-suffix legend
-------------------
    M  tokens (rows of the activations)
    K  model width (hidden size)
    N  feedforward width (intermediate size), at most 65536 (16-bit column indices)
    T  TwELL tiles per token, N / TILE
    P  TwELL slots (32-bit words) per (token, tile) segment, TILE / compression
    S  TwELL words per token, T * P
    W  ELL width of the hybrid format
    R  backup (dense) rows of the hybrid format
    E  flattened non-zero entries (an internal list of (row, column, value) triples)

The TwELL format is specified in :mod:`sparse_llm.formats.twell`, the hybrid format in
:mod:`sparse_llm.formats.hybrid`; validation and the dense reference live in :mod:`sparse_llm.formats.common`.
"""

from sparse_llm.formats.common import MAX_N, SUPPORTED_COMPRESSION, TILE, gated_mlp_ref
from sparse_llm.formats.hybrid import (
    HybridForward,
    HybridGrads,
    HybridPacked,
    HybridSaved,
    hybrid_abs_sum,
    hybrid_gated_mlp_backward_ref,
    hybrid_gated_mlp_forward_ref,
    hybrid_matmul,
    hybrid_mul,
    hybrid_sddmm,
    hybrid_t_matmul,
    pack_hybrid,
    unpack_hybrid,
)
from sparse_llm.formats.twell import (
    TwellPacked,
    TwellStats,
    canonicalize_twell,
    pack_twell,
    twell_gated_mlp_ref,
    unpack_twell,
    validate_twell,
)

__all__ = [
    "MAX_N",
    "SUPPORTED_COMPRESSION",
    "TILE",
    "gated_mlp_ref",
    "HybridForward",
    "HybridGrads",
    "HybridPacked",
    "HybridSaved",
    "hybrid_abs_sum",
    "hybrid_gated_mlp_backward_ref",
    "hybrid_gated_mlp_forward_ref",
    "hybrid_matmul",
    "hybrid_mul",
    "hybrid_sddmm",
    "hybrid_t_matmul",
    "pack_hybrid",
    "unpack_hybrid",
    "TwellPacked",
    "TwellStats",
    "canonicalize_twell",
    "pack_twell",
    "twell_gated_mlp_ref",
    "unpack_twell",
    "validate_twell",
]
