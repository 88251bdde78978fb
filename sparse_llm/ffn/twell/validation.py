"""Checks at the sparse ops' boundary, with errors that name the argument.

A wrong device, dtype, stride, shape or weight orientation is an exception here rather than a silently wrong
result inside a kernel; `shape_unsupported_reason` says why a block shape cannot take the kernels (the torch path
then runs it).
"""

from __future__ import annotations

import torch

from sparse_llm.formats.common import FLOAT_DTYPES
from sparse_llm.formats.constants import MAX_N, TILE

MAX_K = 4096  # the up+down kernel keeps a token's x and output row in registers (K <= 256 * 16)


def shape_unsupported_reason(k: int, n: int) -> str | None:
    """None if the kernels handle hidden width K and FFN width N, else why not."""
    if k % 64 != 0:
        return f"hidden width K={k} is not a multiple of 64"
    if k > MAX_K:
        return f"hidden width K={k} exceeds {MAX_K}"
    if n % TILE != 0:
        return f"FFN width N={n} is not a multiple of {TILE}"
    if n > MAX_N:
        return f"FFN width N={n} exceeds {MAX_N} (16-bit column indices)"
    return None


def check_tensor(
    t: object, name: str, shape: tuple[int, int], layout: str, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; the twell kernels take {allowed}, e.g. {name}.to(torch.bfloat16)")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {list(shape)} ({layout})")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")


def check_residual(residual_MK: object, x_MK: torch.Tensor) -> bool:
    """Validates a residual to add to the block's output: True where the kernels can add it as they store y (bf16,
    contiguous); the caller adds any other."""
    if not isinstance(residual_MK, torch.Tensor):
        raise TypeError(f"residual_MK must be a torch.Tensor, got {type(residual_MK).__name__}")
    if residual_MK.shape != x_MK.shape or residual_MK.device != x_MK.device:
        raise ValueError(
            f"residual_MK has shape {list(residual_MK.shape)} on {residual_MK.device}; it must match x_MK "
            f"({list(x_MK.shape)} on {x_MK.device}): the residual stream the block's output is added to"
        )
    return residual_MK.dtype == torch.bfloat16 and residual_MK.is_contiguous()


def check_2d(t: object, name: str, expected: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor {expected}, got {got}")


def check_operands(
    x_MK: torch.Tensor,
    n: int,
    operands: list[tuple[str, object, tuple[int, int], str]],
    weight_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> None:
    """x_MK (bf16) and each (name, tensor, expected shape, layout) (one of weight_dtypes) must be shaped,
    contiguous, on one CUDA device."""
    m, k = x_MK.shape
    check_tensor(x_MK, "x_MK", (m, k), "tokens x hidden")
    for name, t, shape, layout in operands:
        check_tensor(t, name, shape, layout, weight_dtypes)
    reason = shape_unsupported_reason(k, n)
    if reason is not None:
        raise ValueError(
            f"{operands[0][0]}: {reason}; the twell kernels cannot run this layer, use kernel=torch or auto"
        )
    for name, t, _, _ in operands:
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")
    if x_MK.device.type != "cuda":
        raise ValueError(f"x_MK is on {x_MK.device}; the twell kernels need CUDA tensors (use kernel=torch on CPU)")


def check_inputs(
    x_MK: torch.Tensor,
    w_gate_NK: torch.Tensor,
    w_up_NK: torch.Tensor,
    w_down_KN: torch.Tensor,
    weight_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> None:
    """Raise a ValueError/TypeError naming the bad argument unless the kernels can take these operands (x_MK
    bf16, the weights of one of `weight_dtypes`: the training op also takes float32 master weights)."""
    check_2d(x_MK, "x_MK", "[M, K]; flatten leading dims with x.reshape(-1, K)")
    check_2d(w_gate_NK, "w_gate_NK", "[N, K] (gate_proj.weight)")
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    check_operands(
        x_MK,
        n,
        [
            ("w_gate_NK", w_gate_NK, (n, k), "gate_proj.weight in nn.Linear layout [N, K]"),
            ("w_up_NK", w_up_NK, (n, k), "up_proj.weight in nn.Linear layout [N, K]"),
            ("w_down_KN", w_down_KN, (k, n), "down_proj.weight in nn.Linear layout [K, N]"),
        ],
        weight_dtypes,
    )


MAX_WIDTH = 4096  # widest ELL row the training kernels take


def check_train_inputs(
    x_MK: torch.Tensor, w_gate_NK: torch.Tensor, w_up_NK: torch.Tensor, w_down_KN: torch.Tensor, width: int
) -> tuple[int, int, int]:
    """Raise TypeError/ValueError naming the bad argument; returns (M, K, N).

    Any float dtype on CPU (the torch reference); on CUDA the kernels' rules (bf16, contiguous, K % 64,
    N % 256, K <= 4096, N <= 65536, sm_90a) apply. The weights share one dtype: x_MK's, or float32 (master
    weights under autocast: the op computes with copies in x_MK's dtype and returns float32 gradients).
    """
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width={width!r} must be an int in [1, {MAX_WIDTH}] (the ELL row width, default 128)")
    named = (("x_MK", x_MK), ("w_gate_NK", w_gate_NK), ("w_up_NK", w_up_NK), ("w_down_KN", w_down_KN))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}; flatten tokens with x.reshape(-1, K)")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; pass floating tensors (bf16 on the GPU)")
        if t.device != x_MK.device:
            raise ValueError(f"{name} is on {t.device} but x_MK is on {x_MK.device}; move them to one device")
    for name, t in named[2:]:
        if t.dtype != w_gate_NK.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but w_gate_NK has {w_gate_NK.dtype}; pass the weights in one dtype"
            )
    if w_gate_NK.dtype not in (x_MK.dtype, torch.float32):
        raise TypeError(
            f"w_gate_NK has dtype {w_gate_NK.dtype} but x_MK has {x_MK.dtype}; pass the weights in x_MK's dtype "
            "or as float32 master weights"
        )
    m, k = x_MK.shape
    n = w_gate_NK.shape[0]
    expected = {"w_gate_NK": (n, k), "w_up_NK": (n, k), "w_down_KN": (k, n)}
    for name, t in named[1:]:
        if tuple(t.shape) != expected[name]:
            hint = " (it looks transposed: pass down_proj.weight itself)" if tuple(t.shape) == (n, k) else ""
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {list(expected[name])} in nn.Linear layout "
                f"(K={k} from x_MK, N={n} from w_gate_NK){hint}"
            )
    if n > 1 << 16:
        raise ValueError(f"w_gate_NK has N={n} rows; the formats store 16-bit columns, so N must be <= 65536")
    if x_MK.is_cuda:
        check_inputs(x_MK, w_gate_NK, w_up_NK, w_down_KN, weight_dtypes=(torch.bfloat16, torch.float32))
        for name, t in named:
            if t.data_ptr() % 16:
                raise ValueError(f"{name} is not 16-byte aligned (a view at an odd offset); pass {name}.clone()")
    return m, k, n
