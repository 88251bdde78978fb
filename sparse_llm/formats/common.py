"""Validation, sparse gather/scatter loops and the dense reference shared by both formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparse_llm.formats.constants import MAX_N, TILE

SUPPORTED_COMPRESSION = (2, 4, 8)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CHUNK_ELEMS = 1 << 22  # bound on the gathered [chunk, K] temporaries of the SDDMM

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_matrix(t: object, name: str) -> Tensor:
    """Raise unless ``t`` is a 2-D floating-point tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; pass a floating tensor (bf16, fp16, fp32 or fp64), "
            f"e.g. {name}.to(torch.bfloat16)"
        )
    if t.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D, got shape {tuple(t.shape)}; flatten leading dims first, "
            f"e.g. {name}.reshape(-1, {name}.shape[-1])"
        )
    return t


def _check_same(ref: Tensor, ref_name: str, t: Tensor, name: str) -> None:
    """Raise unless ``t`` has the dtype and device of ``ref``."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; cast them to one dtype")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device")


def _check_n_cols(n: int, name: str, twell: bool) -> None:
    """Raise unless N fits 16-bit column indices (and the TwELL tiling when ``twell``)."""
    if n > MAX_N:
        raise ValueError(f"{name} has N={n} columns; the formats store 16-bit column indices, so N must be <= {MAX_N}")
    if twell and n % TILE != 0:
        raise ValueError(
            f"{name} has N={n} columns; TwELL needs N to be a multiple of {TILE} "
            f"(pad the feedforward width or use the dense/hybrid path)"
        )


def _check_compression(compression: object) -> int:
    if isinstance(compression, bool) or compression not in SUPPORTED_COMPRESSION:
        raise ValueError(f"compression={compression!r} is not supported; use one of {SUPPORTED_COMPRESSION}")
    return int(compression)  # type: ignore[call-overload]


def _check_mlp_args(x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor) -> tuple[int, int, int]:
    """Validate the four block operands; returns (M, K, N)."""
    _check_matrix(x_MK, "x_MK")
    for name, w in (("w_gate_NK", w_gate_NK), ("w_up_NK", w_up_NK), ("w_down_KN", w_down_KN)):
        _check_matrix(w, name)
        _check_same(x_MK, "x_MK", w, name)
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    if w_gate_NK.shape[1] != k:
        raise ValueError(
            f"w_gate_NK has shape {tuple(w_gate_NK.shape)} but x_MK has K={k} columns; "
            f"w_gate_NK must be gate_proj.weight in nn.Linear layout [N, K]"
        )
    if tuple(w_up_NK.shape) != (n, k):
        raise ValueError(
            f"w_up_NK has shape {tuple(w_up_NK.shape)}, expected [N, K] = [{n}, {k}] "
            f"(up_proj.weight in nn.Linear layout, same shape as w_gate_NK)"
        )
    if tuple(w_down_KN.shape) != (k, n):
        hint = " (it looks transposed: pass down_proj.weight itself)" if tuple(w_down_KN.shape) == (n, k) else ""
        raise ValueError(
            f"w_down_KN has shape {tuple(w_down_KN.shape)}, expected [K, N] = [{k}, {n}]: "
            f"down_proj.weight in nn.Linear layout{hint}"
        )
    return m, k, n


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the references: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Sparse loops shared by both formats
# --------------------------------------------------------------------------------------------


def _gather_dot(a_AK: Tensor, ia_E: Tensor, b_BK: Tensor, ib_E: Tensor) -> Tensor:
    """out_E[e] = a_AK[ia_E[e]] . b_BK[ib_E[e]] (an SDDMM over an entry list).

    Chunked so the gathered [chunk, K] operands stay bounded.
    """
    out_E = a_AK.new_empty(ia_E.numel())
    step = max(1, _CHUNK_ELEMS // max(a_AK.shape[1], 1))
    for start in range(0, ia_E.numel(), step):
        s = slice(start, start + step)
        out_E[s] = (a_AK[ia_E[s]] * b_BK[ib_E[s]]).sum(-1)
    return out_E


def _spmm(n_out: int, dst_E: Tensor, src_E: Tensor, value_E: Tensor, src_SK: Tensor) -> Tensor:
    """[n_out, K] with out[dst_E[e]] += value_E[e] * src_SK[src_E[e]] (an SpMM over an entry list).

    Runs as a COO [n_out, S] @ dense [S, K] product: the same sum as a scatter-add loop, many
    times faster on CPU than index_add_ over gathered rows.
    """
    coo = torch.sparse_coo_tensor(torch.stack([dst_E, src_E]), value_E, (n_out, src_SK.shape[0]), check_invariants=True)
    return torch.sparse.mm(coo, src_SK)


# --------------------------------------------------------------------------------------------
# Dense reference
# --------------------------------------------------------------------------------------------


def gated_mlp_ref(
    x_MK: Tensor, w_gate_NK: Tensor, w_up_NK: Tensor, w_down_KN: Tensor, upcast: bool = False
) -> tuple[Tensor, Tensor]:
    """Dense gated feedforward block; autograd friendly.

    Args:
        x_MK: tokens [M, K].
        w_gate_NK, w_up_NK: gate_proj / up_proj weights [N, K].
        w_down_KN: down_proj weight [K, N].
        upcast: compute (and return) in fp32 (fp64 inputs stay fp64) instead of the input dtype.

    Returns:
        (y_MK [M, K], h_MN [M, N]) with h = relu(x w_gate^T) * (x w_up^T).
    """
    _check_mlp_args(x_MK, w_gate_NK, w_up_NK, w_down_KN)
    if upcast:
        dtype = accumulation_dtype(x_MK.dtype)
        x_MK, w_gate_NK, w_up_NK, w_down_KN = (t.to(dtype) for t in (x_MK, w_gate_NK, w_up_NK, w_down_KN))
    h_MN = F.relu(F.linear(x_MK, w_gate_NK)) * F.linear(x_MK, w_up_NK)
    return F.linear(h_MN, w_down_KN), h_MN
