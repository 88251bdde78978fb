"""Rotary position embedding for q and k in one CUDA kernel (kernels/rope.cu), with its backward.

transformers applies the rotate-half rotation as about ten elementwise kernels over q and k: on the 2B
shape at 16384 tokens about 1 ms per layer, 38 ms of a 155 ms forward. `rotate_half_qk` does the same
rotation in one pass (fp32 arithmetic, one rounding) and its backward is the inverse rotation, another
pass. `kernel_applies` says when it can run; `FusedRopeAttention` (sparse_llm.model.llama) falls back to
transformers' `apply_rotary_pos_emb` otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from sparse_llm.cuda import runtime

_THREADS = 256
_BLOCKS_PER_SM = 32  # the grid-stride loop takes over past this many blocks per SM
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_CUDA_TYPE = {torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


def kernel_applies(q_BSHD: torch.Tensor, cos_BSD: torch.Tensor) -> bool:
    """Whether `rotate_half_qk` can stand in for transformers' rotation of `q_BSHD` by `cos_BSD`.

    Needs the CUDA kernels, a bf16 or fp32 q, an even head width, and angles either in q's dtype or in
    fp32 under autocast (transformers' training case: its result is fp32 there, which autocast rounds to
    bf16 before attention, the rounding the kernel does itself).
    """
    if torch.compiler.is_compiling():  # inductor fuses transformers' rotation itself; a CuPy launch cannot be traced
        return False
    if not q_BSHD.is_cuda or runtime.unavailable_reason(q_BSHD.device) is not None:
        return False
    if q_BSHD.dtype not in _KERNEL_DTYPES or cos_BSD.dtype not in _KERNEL_DTYPES:
        return False
    if cos_BSD.dtype != q_BSHD.dtype and not (cos_BSD.dtype == torch.float32 and torch.is_autocast_enabled("cuda")):
        return False
    return q_BSHD.shape[-1] % 2 == 0 and cos_BSD.shape[-1] == q_BSHD.shape[-1]


def _rotate(
    q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, sign: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """New tensors: q and k turned by the angles (sign 1) or back (sign -1)."""
    batch, seq_len, q_heads, width = q_BSHD.shape
    k_heads = k_BSHD.shape[2]
    q_BSHD, k_BSHD = q_BSHD.contiguous(), k_BSHD.contiguous()
    cos_BSD, sin_BSD = (a.expand(batch, seq_len, width) for a in (cos_BSD, sin_BSD))
    if cos_BSD.stride() != sin_BSD.stride() or cos_BSD.stride(2) != 1:
        cos_BSD, sin_BSD = cos_BSD.contiguous(), sin_BSD.contiguous()
    q_out, k_out = torch.empty_like(q_BSHD), torch.empty_like(k_BSHD)
    tokens = batch * seq_len
    pairs = tokens * (q_heads + k_heads) * (width // 2)
    if pairs == 0:
        return q_out, k_out
    vector = _vector_width(q_BSHD, k_BSHD, q_out, k_out, cos_BSD, sin_BSD)
    name = f"rope_rotate_half<{_CUDA_TYPE[q_BSHD.dtype]},{_CUDA_TYPE[cos_BSD.dtype]},{vector}>"
    kernel = runtime.get_function("rope.cu", name, q_BSHD.device)
    sms = runtime.sm_count(q_BSHD.device)
    blocks = min(-(-pairs // (vector * _THREADS)), sms * _BLOCKS_PER_SM)
    args = (
        runtime.ptr(q_BSHD),
        runtime.ptr(k_BSHD),
        runtime.ptr(q_out),
        runtime.ptr(k_out),
        runtime.ptr(cos_BSD),
        runtime.ptr(sin_BSD),
        np.int64(tokens),
        np.int32(seq_len),
        np.int32(q_heads),
        np.int32(k_heads),
        np.int32(width // 2),
        np.int64(cos_BSD.stride(0)),
        np.int64(cos_BSD.stride(1)),
        np.float32(sign),
    )
    runtime.launch(kernel, (blocks,), (_THREADS,), args, q_BSHD.device)
    return q_out, k_out


def _vector_width(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos_BSD: torch.Tensor,
    sin_BSD: torch.Tensor,
) -> int:
    """Elements per access of the kernel: 16-byte loads of q and k (8 bf16 or 4 fp32 values) where the head
    half-width, the angle strides and every address allow it, else 1."""
    vector = 16 // q_BSHD.element_size()
    half = q_BSHD.shape[-1] // 2
    fits = half % vector == 0 and cos_BSD.stride(0) % vector == 0 and cos_BSD.stride(1) % vector == 0
    aligned = all(
        t.data_ptr() % (t.element_size() * vector) == 0 for t in (q_BSHD, k_BSHD, q_out, k_out, cos_BSD, sin_BSD)
    )
    return vector if fits and aligned else 1


class _RotateHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BSHD, k_BSHD, cos_BSD, sin_BSD):
        ctx.save_for_backward(cos_BSD, sin_BSD)
        return _rotate(q_BSHD, k_BSHD, cos_BSD, sin_BSD, 1.0)

    @staticmethod
    def backward(ctx, dq_BSHD, dk_BSHD):
        cos_BSD, sin_BSD = ctx.saved_tensors
        dq_BSHD, dk_BSHD = _rotate(dq_BSHD, dk_BSHD, cos_BSD, sin_BSD, -1.0)
        return dq_BSHD, dk_BSHD, None, None


def rotate_half_qk(
    q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, S, Hq, D] and k [B, S, Hk, D] rotated by the angles cos/sin [B or 1, S, D] (no gradient to the
    angles, which are buffers). Call only where `kernel_applies(q_BSHD, cos_BSD)`."""
    if q_BSHD.dtype != k_BSHD.dtype or q_BSHD.shape[:2] != k_BSHD.shape[:2] or q_BSHD.shape[3] != k_BSHD.shape[3]:
        raise ValueError(
            f"q {tuple(q_BSHD.shape)} {q_BSHD.dtype} and k {tuple(k_BSHD.shape)} {k_BSHD.dtype} "
            "must share dtype, batch, sequence length and head width."
        )
    if cos_BSD.shape != sin_BSD.shape or cos_BSD.dtype != sin_BSD.dtype:
        raise ValueError(
            f"cos {tuple(cos_BSD.shape)} {cos_BSD.dtype} and sin {tuple(sin_BSD.shape)} {sin_BSD.dtype} must match."
        )
    batch, seq_len, _, width = q_BSHD.shape
    if cos_BSD.dim() != 3 or cos_BSD.shape[0] not in (1, batch) or cos_BSD.shape[1:] != (seq_len, width):
        raise ValueError(
            f"cos/sin {tuple(cos_BSD.shape)} must be [1 or {batch}, {seq_len}, {width}] for q "
            f"{tuple(q_BSHD.shape)} ([batch, positions, head width])."
        )
    return _RotateHalf.apply(q_BSHD, k_BSHD, cos_BSD.detach(), sin_BSD.detach())
