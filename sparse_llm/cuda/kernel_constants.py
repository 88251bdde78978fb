"""Constants that the CUDA sources and the Python code that launches them share, defined once.

`runtime.kernel_source` puts `cuda_defines()` in front of every source as #define lines, so a kernel and the
launcher that sizes its grid, shared memory or workspace read the same value. A source compiled any other way
fails on the undefined names rather than running with stale ones.
"""

from __future__ import annotations

from sparse_llm.formats.constants import SLOTS, TILE

DECODE_MAX_M = 64  # most tokens of one decode_ffn call
DECODE_GROUP_M = 16  # most tokens a decode_ffn block stages in shared memory; more tokens make groups of blocks
DECODE_WARPS = 16  # warps per decode_ffn block
DECODE_MMA_NEURONS = 8  # neurons per tensor-core gate tile of decode_ffn (the n of m16n8k16)
DIRECT_LIST_CAP = 128  # positives a light token's list holds on the direct route's walks
DENSE_ROWS_THREADS = 256  # threads per block of the dense-row kernels (one block per reserved row)
BACKUP_GRADS_THREADS = 256  # threads per block of train_backup_grads
ORDER_GROUP = 1024  # tokens ordered by count together (one block of order_tokens)
FIRST_PART, LAST_PART = 1, 2  # `part` flags of the kernels that walk a block in column parts
GATE_BLOCK_M = 128  # rows of an output tile of the fused gate GEMM (kernels/twell_gate_wgmma.cu)
GATE_STAGES = 3  # its pipeline stages: with the finished-tile buffer, four do not fit in shared memory
GATE_CLUSTER = 2  # CTAs of a cluster, sharing each w_gate tile
GATE_THREADS = 384  # a producer warpgroup and two consumer warpgroups
# Its dynamic shared memory: the stages (a BLOCK_M x 64 and a TILE x 64 bf16 operand each), the finished tile as bf16
# rows (pitch TILE / 2 + 4 words), three packer warps' segments, two barriers per stage, and alignment slack. The
# kernel sums its own layout and static_asserts that it equals this.
GATE_SMEM_BYTES = (
    GATE_STAGES * (GATE_BLOCK_M * 64 + TILE * 64) * 2
    + GATE_BLOCK_M * (TILE // 2 + 4) * 4
    + 3 * SLOTS * 4
    + GATE_STAGES * 16
    + 1024
)


def cuda_defines() -> str:
    """The shared constants as #define lines for the CUDA sources."""
    values = {
        "TWELL_TILE": TILE,
        "TWELL_SLOTS": SLOTS,
        "DECODE_MAX_M": DECODE_MAX_M,
        "DECODE_GROUP_M": DECODE_GROUP_M,
        "DECODE_WARPS": DECODE_WARPS,
        "DECODE_MMA_NEURONS": DECODE_MMA_NEURONS,
        "DIRECT_LIST_CAP": DIRECT_LIST_CAP,
        "DENSE_ROWS_THREADS": DENSE_ROWS_THREADS,
        "BACKUP_GRADS_THREADS": BACKUP_GRADS_THREADS,
        "ORDER_GROUP": ORDER_GROUP,
        "FIRST_PART": FIRST_PART,
        "LAST_PART": LAST_PART,
        "GATE_BLOCK_M": GATE_BLOCK_M,
        "GATE_STAGES": GATE_STAGES,
        "GATE_CLUSTER": GATE_CLUSTER,
        "GATE_THREADS": GATE_THREADS,
        "GATE_SMEM_BYTES": GATE_SMEM_BYTES,
    }
    return "".join(f"#define {name} {value}\n" for name, value in values.items())
