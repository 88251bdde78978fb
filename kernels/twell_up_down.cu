// Fused up + down projection from a TwELL-packed gate (inference):
//   for every token m and every packed non-zero (n, g):  u = x[m, :] . w_up[n, :],  h = g * u,
//   y[m, :] += h * w_down_t[n, :]
// so the dense hidden h [M, N] never exists. One warp per token (4 tokens per 128-thread block); the warp
// keeps x[m, :] in shared memory and the fp32 output row in registers. Lane l owns columns v*256 + 8l .. +8
// for v < KV, so K may be any multiple of 8 up to 256*KV (columns >= K are masked). The per-entry step is
// up_down_entry (up_down_common.cuh).
//
// Split mode (grid.y = splits > 1, for small M): split s handles tiles s, s+splits, ... and writes an fp32
// partial row to y_partial[s, m, :]; twell_reduce_splits then sums the splits in a fixed order. With
// splits == 1 the bf16 row goes straight to y.
//
// Dense rows are not computed here: their y row is written as zeros and row_dense[m] is set, so the
// caller recomputes them with dense GEMMs: 1 = an overflowed tile (count > 31, the entries are
// incomplete), 2 = more than dense_row_nnz non-zeros in the row (a heavy token: one warp would walk its
// non-zeros serially and finish long after the others; a dense GEMM row is cheaper).
//
// Cache policy: weight rows are re-read by many tokens and should stay in L2 (evict_last); the
// activations, packed words and outputs are touched once (streaming loads/stores, evict_first).
//
// Statistics go to zero-initialised buffers: l0[m] += #(h != 0), l1[m] += sum |h| (fp32 atomics, so with
// splits > 1 the summation order of l1 varies run to run), fired[n] = 1 where h != 0.
#include "up_down_common.cuh"

constexpr int WORD_BATCH = 8;  // TwELL tiles whose packed words one warp fetches at once

// Up to K = 2048 the register cap of 4 blocks per SM (128 registers) costs one 4-byte spill and gives 16
// warps per SM instead of 12: more weight rows in flight. Wider rows need the whole register file.
template <int KV>
__global__ void __launch_bounds__(128, KV <= 8 ? 4 : 1) twell_up_down(
    const uint32_t *__restrict__ packed,         // [M, T * 32]
    const __nv_bfloat16 *__restrict__ x,         // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of nn.Linear's [K, N])
    __nv_bfloat16 *__restrict__ y,               // [M, K], used when splits == 1
    float *__restrict__ y_partial,               // [splits, M, K], used when splits > 1
    float *__restrict__ l1,                      // [M], zero-initialised
    int *__restrict__ l0,                        // [M], zero-initialised
    int *__restrict__ fired,                     // [N], zero-initialised, only ever set to 1
    int *__restrict__ row_dense,                 // [M]
    int M, int K, int T, int dense_row_nnz) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (m >= M) return;  // whole warp leaves together; no block-wide barrier below
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const uint32_t *row = packed + m * T * TWELL_SLOTS;
    const uint64_t keep = l2_keep_policy();

    // x stays in shared memory as bf16 (registers go to the accumulators and the in-flight weight rows);
    // piece v of lane l at x_smem[v * 32 + l]: consecutive lanes, consecutive 16 bytes, no bank conflicts.
    extern __shared__ uint4 smem_x[];
    uint4 *x_smem = smem_x + (threadIdx.x / 32) * KV * 32;
    stage_row<KV>(x_smem, x + m * K, lane, K);
    float acc[KV][8];
    zero_acc<KV>(acc);
    // Issued after the x loads so both are in flight together.
    bool overflow = false;
    int total = 0;
    for (int t = lane; t < T; t += 32) {
        const int count = static_cast<int>(__ldcs(row + t * TWELL_SLOTS));
        overflow |= count > TWELL_CAPACITY;
        total += count;
    }
    overflow = __any_sync(FULL_MASK, overflow);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) total += __shfl_xor_sync(FULL_MASK, total, d);
    const int dense_kind = overflow ? 1 : (total > dense_row_nnz ? 2 : 0);

    float l1_sum = 0.0f;
    int l0_sum = 0;
    if (dense_kind == 0) {
        // The packed words of WORD_BATCH tiles are fetched together into this warp's shared words, so a
        // token pays one memory latency per batch rather than one per tile (most tiles hold 0-2 entries).
        uint32_t *words = reinterpret_cast<uint32_t *>(smem_x + (blockDim.x / 32) * KV * 32) +
                          (threadIdx.x / 32) * WORD_BATCH * TWELL_SLOTS;
        for (int t0 = split; t0 < T; t0 += WORD_BATCH * splits) {
            __syncwarp();  // the previous batch has been read by every lane
#pragma unroll
            for (int b = 0; b < WORD_BATCH; ++b) {
                const int t = t0 + b * splits;
                words[b * TWELL_SLOTS + lane] = t < T ? __ldcs(row + t * TWELL_SLOTS + lane) : 0u;
            }
            __syncwarp();
            for (int b = 0; b < WORD_BATCH; ++b) {
                const uint32_t word = words[b * TWELL_SLOTS + lane];
                const int count = __shfl_sync(FULL_MASK, word, 0);
                for (int i = 1; i <= count; ++i) {
                    const uint32_t entry = __shfl_sync(FULL_MASK, word, i);
                    up_down_entry<KV>(twell_col(entry), twell_value(entry), x_smem, acc, l1_sum, l0_sum, w_up,
                                      w_down_t, fired, lane, K, keep);
                }
            }
        }
    }

    if (splits == 1) {
        store_row_bf16<KV>(y + m * K, acc, lane, K);
    } else {
#pragma unroll
        for (int v = 0; v < KV; ++v) {
            const int col = v * 256 + lane * 8;
            if (col >= K) continue;
            float4 *dst = reinterpret_cast<float4 *>(y_partial + (static_cast<long long>(split) * M + m) * K + col);
            dst[0] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
            dst[1] = make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7]);
        }
    }
    if (lane == 0) {
        if (l0_sum) {
            atomicAdd(&l1[m], l1_sum);
            atomicAdd(&l0[m], l0_sum);
        }
        if (split == 0) row_dense[m] = dense_kind;
    }
}

// y[m, k] = bf16(sum over s of y_partial[s, m, k]), summed in split order. 4 elements per thread.
extern "C" __global__ void __launch_bounds__(256) twell_reduce_splits(
    const float *__restrict__ y_partial,  // [splits, M * K]
    __nv_bfloat16 *__restrict__ y,        // [M * K]
    int splits, long long mk) {
    const long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
    if (i >= mk) return;  // mk is a multiple of 64 (K is)
    float4 sum = *reinterpret_cast<const float4 *>(y_partial + i);
    for (int s = 1; s < splits; ++s) {
        const float4 p = *reinterpret_cast<const float4 *>(y_partial + s * mk + i);
        sum.x += p.x;
        sum.y += p.y;
        sum.z += p.z;
        sum.w += p.w;
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(sum.z, sum.w);
    *reinterpret_cast<uint2 *>(y + i) =
        make_uint2(*reinterpret_cast<const uint32_t *>(&lo), *reinterpret_cast<const uint32_t *>(&hi));
}

// Explicit instantiations so nvcc compile checks see every variant; NVRTC builds one per name expression.
template __global__ void twell_up_down<1>(const uint32_t *, const __nv_bfloat16 *, const __nv_bfloat16 *,
                                          const __nv_bfloat16 *, __nv_bfloat16 *, float *, float *, int *,
                                          int *, int *, int, int, int, int);
template __global__ void twell_up_down<8>(const uint32_t *, const __nv_bfloat16 *, const __nv_bfloat16 *,
                                          const __nv_bfloat16 *, __nv_bfloat16 *, float *, float *, int *,
                                          int *, int *, int, int, int, int);
template __global__ void twell_up_down<16>(const uint32_t *, const __nv_bfloat16 *, const __nv_bfloat16 *,
                                           const __nv_bfloat16 *, __nv_bfloat16 *, float *, float *, int *,
                                           int *, int *, int, int, int, int);
