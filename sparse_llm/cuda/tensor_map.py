"""Tensor maps for Hopper's bulk tensor copy engine: the 128-byte descriptors the driver's cuTensorMapEncodeTiled
writes, which a kernel takes by value as a `__grid_constant__` parameter (kernels/twell_gate_wgmma.cu).

A map holds only a tensor's address, shape, row pitch and box, so maps are cached on those: the same key always
encodes the same bytes, whatever tensor lives at the address now.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

MAP_BYTES = 128
# Enumerators of cuda.h (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill).
_BFLOAT16 = 9
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3  # rows of 128 bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8): wgmma's layout
_L2_PROMOTION_256B = 3
_OUT_OF_BOUNDS_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: boxes past the tensor's edge read as zeros


@functools.cache
def _encode_tiled() -> ctypes._CFuncPtr:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as caught:
        raise RuntimeError(f"the CUDA driver library (libcuda.so.1) could not be loaded: {caught}") from caught
    encode = driver.cuTensorMapEncodeTiled
    u32_p, u64_p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64_p, u64_p, u32_p, u32_p]
    encode.argtypes += [ctypes.c_int] * 4
    encode.restype = ctypes.c_int
    return encode


def mappable(t_RC: torch.Tensor) -> bool:
    """Whether the copy engine can read the matrix [R, C] through `bf16_box_map`: contiguous bf16, 16-byte aligned,
    rows a multiple of 16 bytes."""
    aligned = t_RC.data_ptr() % 16 == 0 and t_RC.shape[1] % 8 == 0
    return t_RC.dtype == torch.bfloat16 and t_RC.is_contiguous() and aligned


def bf16_box_map(t_RC: torch.Tensor, box_rows: int, box_cols: int = 64) -> np.ndarray:
    """The tensor map of a contiguous bf16 matrix [R, C] read in boxes of box_rows x box_cols (128-byte swizzle, so
    box_cols * 2 must be 128), as a kernel argument: a read-only numpy array of one 128-byte element, which CuPy
    passes by value."""
    rows, cols = t_RC.shape
    if not mappable(t_RC):
        raise ValueError(
            f"a tensor map needs a contiguous bf16 matrix, 16-byte aligned, with a multiple of 8 columns; got "
            f"{t_RC.dtype} {tuple(t_RC.shape)} at address {t_RC.data_ptr():#x}"
        )
    return _encoded(t_RC.data_ptr(), rows, cols, box_rows, box_cols)


@functools.lru_cache(maxsize=256)
def _encoded(address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> np.ndarray:
    storage = np.zeros(MAP_BYTES + 64, dtype=np.uint8)
    offset = -storage.ctypes.data % 64  # the driver's CUtensorMap is 64-byte aligned
    words = storage[offset : offset + MAP_BYTES]
    status = _encode_tiled()(
        words.ctypes.data,
        _BFLOAT16,
        2,
        address,
        (ctypes.c_uint64 * 2)(cols, rows),
        (ctypes.c_uint64 * 1)(cols * 2),  # the row pitch in bytes (the innermost dimension's is implied)
        (ctypes.c_uint32 * 2)(box_cols, box_rows),
        (ctypes.c_uint32 * 2)(1, 1),
        _INTERLEAVE_NONE,
        _SWIZZLE_128B,
        _L2_PROMOTION_256B,
        _OUT_OF_BOUNDS_ZEROS,
    )
    if status != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed (CUresult {status}) for a bf16 [{rows}, {cols}] tensor at {address:#x} "
            f"in boxes of [{box_rows}, {box_cols}]"
        )
    param = words.view(np.dtype((np.void, MAP_BYTES)))
    param.flags.writeable = False
    return param
