"""Which compiled kernels a model may run, by layer shape, and compiling them before a run's first step.

A kernel's first compile costs several seconds (a child process imports torch and CuPy and runs NVRTC,
`sparse_llm.cuda.runtime`). Left to first use, a run on a fresh machine compiles the dozen or more kernels its layers
need one after another, in the middle of its first steps, or later, whenever `kernel=auto` first moves a layer
to the sparse path. `warm` compiles them at the start instead, several at a time, into the on-disk cache (a
no-op once they are there). The lists name the kernels by the template arguments the launchers derive from the
layer's width K and FFN width N; a kernel missing from them still compiles on first use, and a GPU test checks
that the launchers ask for no other.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from sparse_llm.cuda import runtime
from sparse_llm.ffn.mlp import SparseMLP
from sparse_llm.ffn.twell.cost_model import slice_width
from sparse_llm.ffn.twell.csc import KEY_CTYPES, OUT_CTYPES, csc_key_dtype
from sparse_llm.ffn.twell.decode import decode_kernel_name
from sparse_llm.ffn.twell.train_launch import row_pieces, wgrad_slices
from sparse_llm.ffn.twell.validation import shape_unsupported_reason

log = logging.getLogger(__name__)

Kernel = tuple[str, str]  # (source file, kernel name), as runtime.get_function takes them

# The rotary embedding (sparse_llm.model.rope) of eager decoder layers, whatever the FFN's kernel: bf16 q and k with
# float32 angles under autocast (training), bf16 angles in a bf16 model (inference); 16-byte pieces.
ROPE_KERNELS: tuple[Kernel, ...] = (
    ("rope.cu", "rope_rotate_half<__nv_bfloat16,float,8>"),
    ("rope.cu", "rope_rotate_half<__nv_bfloat16,__nv_bfloat16,8>"),
)

# The weight transposes and casts: w_down^T in bf16 from bf16 or float32 weights, dW_down^T into float32 masters.
TRANSPOSE_KERNELS: tuple[Kernel, ...] = tuple(
    ("transpose.cu", f"transpose_cast<{src},{dst}>")
    for src, dst in (("__nv_bfloat16", "__nv_bfloat16"), ("float", "__nv_bfloat16"), ("float", "float"))
)


def _slices_down(n: int, sums: bool) -> list[Kernel]:
    """entries_down at N's slice width (none where no slice fits shared memory); `sums`: the fp32-sums variant."""
    ks = slice_width(n)
    return [] if ks is None else [("gate_up_then_down.cu", f"entries_down<{ks},{str(sums).lower()}>")]


def inference_kernels(k: int, n: int) -> list[Kernel]:
    """The kernels of `kernel=twell` inference (the decode kernel for few tokens; the direct route: one-pass and slices
    walks, heavy tokens by dense rows or split over warps) for layers of width K and FFN width N."""
    kv = row_pieces(k)
    return [
        *[
            ("decode_ffn.cu", decode_kernel_name(kv, sums, mma, finish))
            for sums in (False, True)
            for mma in (False, True)
            for finish in (True, False)
        ],
        ("decode_ffn.cu", "decode_finish"),  # after the unfinished variants, in CUDA graphs
        *[("gate_up_down.cu", f"gate_up_down_light<{kv},{packed}>") for packed in ("false", "true")],
        ("gate_up_down.cu", f"gate_up_down_heavy<{kv}>"),
        ("dense_rows.cu", "gather_dense_rows"),
        ("dense_rows.cu", "dense_rows_h"),
        ("dense_rows.cu", "scatter_dense_rows"),
        ("twell_gate_wgmma.cu", "twell_gate_wgmma"),  # the walks' gate from TwELL words
        *[("gate_up_then_down.cu", f"gate_up_entries<{kv},{packed}>") for packed in ("false", "true")],
        ("gate_up_then_down.cu", "order_tokens"),
        ("gate_up_then_down.cu", "entries_to_slots"),
        *_slices_down(n, sums=False),
        *TRANSPOSE_KERNELS,
    ]


def training_kernels(k: int, n: int) -> list[Kernel]:
    """The kernels of the sparse training op (`twell_train_ffn`, forward and backward) at K and N, for bf16 or
    float32 weights."""
    kv, kw, key = row_pieces(k), wgrad_slices(k)[0], KEY_CTYPES[csc_key_dtype(n)]
    return [
        ("train_forward.cu", f"train_fwd_gate<{kv},true>"),
        ("train_forward.cu", f"train_fwd_gate<{kv},false>"),
        ("gate_up_down.cu", f"gate_up_down_heavy<{kv}>"),
        ("train_backward.cu", f"train_bwd_sddmm<{kv},{key}>"),
        ("train_backward.cu", f"train_bwd_dx<{kv}>"),
        ("train_backward.cu", f"train_csc_columns<{key}>"),
        ("train_backward.cu", "train_csc_chunks"),
        ("train_backward.cu", "train_backup_grads"),
        *(
            ("train_backward.cu", f"train_csc_wgrad<{kw},{values},{out}>")
            for values in (1, 2)
            for out in OUT_CTYPES.values()
        ),
        ("gate_up_then_down.cu", "order_tokens"),
        ("gate_up_then_down.cu", "ell_to_slots<true>"),
        ("gate_up_then_down.cu", "ell_to_slots<false>"),
        # y and dx by slices (walk_by_slices), which the training op takes at 16 columns a slice only
        *(_slices_down(n, sums=False) + _slices_down(n, sums=True) if slice_width(n) == 16 else []),
        *TRANSPOSE_KERNELS,
    ]


def model_kernels(model: nn.Module, training: bool) -> list[Kernel]:
    """The kernels `model` may run: the rotary embedding's, and for each FFN shape of its `SparseMLP`s that the
    kernels take and that is not held on `kernel=torch`, the inference kernels, plus the training op's when
    `training`. In order, without repeats."""
    kernels = list(ROPE_KERNELS)
    for mlp in model.modules():
        if not isinstance(mlp, SparseMLP) or mlp.dispatcher.kernel == "torch":
            continue
        k, n = mlp.hidden_size, mlp.intermediate_size
        if shape_unsupported_reason(k, n) is not None:
            continue
        kernels += inference_kernels(k, n)
        if training:
            kernels += training_kernels(k, n)
    return list(dict.fromkeys(kernels))


def warm(model: nn.Module, device: torch.device, training: bool) -> None:
    """Compile the kernels `model` may run on `device` that the cache lacks (`cuda.precompile`), logging how many
    and how long. Nothing happens off a Hopper GPU, when all are cached, or with SPARSE_LLM_COMPILE_INPROCESS=1 (each
    compiles in this process on first use). A kernel that fails to compile is logged here; its first use raises."""
    if device.type != "cuda" or runtime.unavailable_reason(device) is not None or not runtime.compiles_in_children():
        return
    missing = [kernel for kernel in model_kernels(model, training) if not runtime.is_compiled(*kernel)]
    if not missing:
        return
    log.info(
        "Compiling %d CUDA kernels this model may run, several at a time (once per machine; cached in %s)",
        len(missing),
        runtime.cache_dir(),
    )
    start = time.perf_counter()
    failures = runtime.precompile(missing)
    for (filename, name), error in failures.items():
        log.warning("CUDA kernel %s of %s failed to compile (its first use will raise): %s", name, filename, error)
    log.info("Compiled %d CUDA kernels in %.0f s", len(missing) - len(failures), time.perf_counter() - start)
