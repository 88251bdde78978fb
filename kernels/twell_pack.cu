// Pack a dense pre-activation gate [M, N] bf16 into TwELL (ReLU applied by keeping only values > 0).
// Used after a cuBLAS gate GEMM where that is faster than the fused GEMM (small M), and as a test oracle
// for the fused kernel's packing. One warp per (token, tile): each lane owns 8 consecutive columns.
// Entries are written in column order, so the output is deterministic.
#include "twell_common.cuh"

extern "C" __global__ void __launch_bounds__(256) twell_pack_dense(
    const __nv_bfloat16 *__restrict__ gate_MN,  // [M, N] pre-activation gate
    uint32_t *__restrict__ packed,              // [M, (N/256) * 32]
    int M, int N) {
    const int lane = threadIdx.x & 31;
    const int tiles = N / TWELL_TILE;
    const long long segment = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (segment >= static_cast<long long>(M) * tiles) return;
    const long long m = segment / tiles;
    const int t = static_cast<int>(segment - m * tiles);
    const int col0 = t * TWELL_TILE + lane * 8;

    const uint4 raw = *reinterpret_cast<const uint4 *>(gate_MN + m * N + col0);
    uint32_t *out = packed + segment * TWELL_SLOTS;
    const int total = list_positives(raw, col0, out + 1, 0, TWELL_CAPACITY, lane);  // payload words 1..31
    if (lane == 0) out[0] = static_cast<uint32_t>(total);
}
