"""Small edge-case calls of every CUDA kernel, to run under compute-sanitizer (needs an sm_90 GPU).

    export SPARSE_LLM_COMPILE_INPROCESS=1     # compile in this process, so the tool sees every launch
    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/sanitize_kernels.py

Shapes are tiny (the tools slow kernels down 10-100x) but reach every branch: M = 1 and 7 (split paths),
130, and 2100 (the direct route's one-warp path starts at 2048 tokens); K = 128 and 320 (a partial 256-column
piece); a third of the tokens nearly fully dense (TwELL overflow, direct-route heavy tokens, training backup
rows); a neuron that fires for every token (a transposed-view column cut into chunks, summed in a scratch
slot); the direct inference route with the dense-row threshold low and off, the direct one also adding a
residual, in column parts, and with its heavy tokens through fewer dense rows than they need and through enough;
the fused gate GEMM writing its overflowed segments' gate values;
the decode kernel at 1, 7 and 16 tokens and at 40 (groups of tokens), its blocks summing in shared memory and not,
its gates on the tensor cores and not;
the training op forward and backward with a narrow and the default ELL width, its heavy tokens split over warps and
partly through dense rows, in column parts, and its y and dx through the slices walk; both transposes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from unittest import mock

import torch
import torch.nn.functional as F

from sparse_llm.ffn.twell import cost_model
from sparse_llm.ffn.twell.cost_model import column_parts
from sparse_llm.ffn.twell.infer_launch import OutputNorm, direct_up_down, transposed_copy, twell_gate
from sparse_llm.ffn.twell.infer_op import twell_gated_mlp
from sparse_llm.ffn.twell.synthetic import synthetic_block
from sparse_llm.ffn.twell.train_op import twell_train_ffn

SHAPES = ((1, 128, 512), (7, 320, 768), (130, 128, 512), (2100, 128, 256))


def training_walks_by_slices() -> AbstractContextManager:
    """The training op's y and dx through the slices walk at any token count."""
    return mock.patch.multiple(cost_model, FWD_WALK="slices", DX_WALK="slices", SLICES_MIN_M=1)


def main() -> None:
    for m, k, n in SHAPES:
        x, wg, wu, wd = synthetic_block(m, k, n, nnz_mean=0.02 * n, sigma=0.5, seed=m)
        x[::3, 0] = -1.0  # flips the gate shift: nearly every gate of these tokens is positive
        wg[5, 0] = 10.0  # neuron 5 fires for every other token
        with torch.no_grad():
            for route in ("direct",):
                for dense_row_nnz in (8, 1 << 30):
                    twell_gated_mlp(x, wg, wu, wd, gate_route=route, dense_row_nnz=dense_row_nnz)
            twell_gated_mlp(x, wg, wu, wd, gate_route="direct", residual_MK=torch.randn_like(x))
            # the fused gate GEMM writing its overflowed segments' values (the block op passes it a buffer from
            # WORDS_GATE_MIN_M tokens only, past these shapes)
            twell_gate(x, wg, overflow_gate_MN=torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
            for tokens in (1, 7, 16, 40):  # the decode kernel (40: groups), with and without a residual and block sums
                few = x[:tokens].contiguous()
                twell_gated_mlp(few, wg, wu, wd)
                gates = 1 if tokens < 4 else 1 << 30  # the gate path the default does not take here
                with mock.patch.multiple(cost_model, DECODE_BLOCK_SUM_PIECES=0, DECODE_MMA_MIN_M=gates):
                    twell_gated_mlp(few, wg, wu, wd, residual_MK=torch.randn_like(few))
            if n >= 512:  # the walks of blocks wider than L2, in column parts
                direct_up_down(x, F.linear(x, wg), wu, wd.t().contiguous(), parts=2, residual_MK=torch.randn_like(x))
            for residual in (None, torch.randn_like(x)):  # the slices walk (16-column slices at these widths)
                direct_up_down(x, F.linear(x, wg), wu, wd.t().contiguous(), residual_MK=residual, walk="slices")
            for dense_rows, walk in ((16, "rows"), (m, "slices")):  # heavy tokens through the dense rows, then warps
                direct_up_down(
                    x,
                    F.linear(x, wg),
                    wu,
                    wd.t().contiguous(),
                    residual_MK=torch.randn_like(x),
                    walk=walk,
                    dense_rows=dense_rows,
                )
            for parts in (1, 2) if n >= 512 else (1,):  # the next norm beside the rows: light, dense-row, split tokens
                norm = OutputNorm(torch.randn(k, device="cuda").bfloat16(), 1e-5, torch.empty_like(x))
                direct_up_down(
                    x,
                    F.linear(x, wg),
                    wu,
                    wd.t().contiguous(),
                    residual_MK=torch.randn_like(x),
                    parts=parts,
                    dense_rows=16 if parts == 1 else 0,
                    norm=norm,
                )
        leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
        for width, dense_rows in ((4, 0), (4, 8), (128, 0)):  # 8: some heavy tokens through dense rows, some split
            result = twell_train_ffn(*leaves, width=width, dense_rows=dense_rows)
            (result.y_MK.float().sum() + result.l1_sum).backward()
        with training_walks_by_slices():
            result = twell_train_ffn(*leaves, width=128)
            (result.y_MK.float().sum() + result.l1_sum).backward()
        if n >= 512:  # the training walks in column parts, as a block wider than L2 takes them
            one_pass = cost_model.walk_column_parts
            cost_model.walk_column_parts = lambda k, n: tuple(column_parts(k, n, parts=p) for p in (2, 2, 2))
            try:
                result = twell_train_ffn(*leaves, width=128)
                (result.y_MK.float().sum() + result.l1_sum).backward()
            finally:
                cost_model.walk_column_parts = one_pass
        masters = [x.clone().requires_grad_(), *(w.float().requires_grad_() for w in (wg, wu, wd))]
        with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 master weights: casts and fp32 gradients
            result = twell_train_ffn(*masters, width=4)
        (result.y_MK.float().sum() + result.l1_sum).backward()
        for dtype in (torch.bfloat16, torch.float32):
            transposed_copy(torch.randn(k, n, device="cuda"), dtype)
    x, wg, wu, wd = synthetic_block(40, 64, 7424, nnz_mean=60, sigma=0.5, seed=3)  # 8-column slices
    direct_up_down(x, F.linear(x, wg), wu, wd.t().contiguous(), walk="slices")
    torch.cuda.synchronize()
    print(f"sanitize_kernels: {len(SHAPES)} shapes done")


if __name__ == "__main__":
    main()
