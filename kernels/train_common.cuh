// Shared helpers of the training kernels (hybrid format: ELL rows + dense backup rows; the torch
// specification is sparse_llm/formats.py, the op is sparse_llm/twell_train.py).
//
// Warp-row convention: one warp works on one row of K bf16 values (a token's x or dy, or a weight row).
// Lane l owns the 8 columns v*256 + 8l .. v*256 + 8l + 7 of piece v < KV, so K <= 256 * KV; columns >= K
// are masked (K is a multiple of 64, so a lane's 8 columns are either all valid or all masked).
// Rounding points follow formats.py: every stored or multiplied value is rounded to bf16 where the torch
// reference holds a bf16 tensor; sums are fp32.
#ifndef TRAIN_COMMON_CUH
#define TRAIN_COMMON_CUH
#include "twell_common.cuh"

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float bf16_load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

// Stage an activation row (read once: streaming loads) in shared memory as this warp's KV*32 uint4 (piece v
// of lane l at [v * 32 + l]: no bank conflicts), so registers stay free for the weight rows in flight.
template <int KV>
__device__ __forceinline__ void stage_row(uint4 *smem_row, const __nv_bfloat16 *row, int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        smem_row[v * 32 + lane] = col < K ? __ldcs(reinterpret_cast<const uint4 *>(row + col)) : make_uint4(0, 0, 0, 0);
    }
}

// This lane's share of the dot product of a staged row and a loaded row (warp_sum gives the full dot).
template <int KV>
__device__ __forceinline__ float lane_dot(const uint4 *smem_row, const uint4 (&w)[KV], int lane) {
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        float a[8], b[8];
        bf16x8_to_float(smem_row[v * 32 + lane], a);
        bf16x8_to_float(w[v], b);
        float part = 0.0f;  // one short chain per piece instead of one long one
#pragma unroll
        for (int j = 0; j < 8; ++j) part = fmaf(a[j], b[j], part);
        dot += part;
    }
    return dot;
}

// acc += scale * row (this lane's pieces).
template <int KV>
__device__ __forceinline__ void axpy(float (&acc)[KV][8], float scale, const uint4 (&w)[KV]) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        float b[8];
        bf16x8_to_float(w[v], b);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[v][j] = fmaf(scale, b[j], acc[v][j]);
    }
}

template <int KV>
__device__ __forceinline__ void zero_acc(float (&acc)[KV][8]) {
#pragma unroll
    for (int v = 0; v < KV; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[v][j] = 0.0f;
}

// Round this lane's pieces to bf16 and store them in a K-wide row.
template <int KV>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16 *row, const float (&acc)[KV][8], int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col >= K) continue;
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[v][2 * i], acc[v][2 * i + 1]);
            w[i] = *reinterpret_cast<const uint32_t *>(&pair);
        }
        *reinterpret_cast<uint4 *>(row + col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Walks one token's ELL entries (columns cols[0 .. count)) 32 at a time. begin(base, here) lets lane j load
// what it needs of entry base + j; then for each entry j of the batch the R weight rows of its column n
// (row n of mats[0 .. R), evict_last in L2) are requested together and step(j, n, rows) runs on the whole
// warp; finish(base, here) lets lane j store its results. Rows in flight come from many resident warps
// rather than from prefetching within one: a second set of rows in registers costs more warps than it adds.
template <int KV, int R, typename Begin, typename Step, typename Finish>
__device__ __forceinline__ void walk_entries(const int *__restrict__ cols, int count,
                                             const __nv_bfloat16 *const (&mats)[R], int lane, int K, Begin &&begin,
                                             Step &&step, Finish &&finish) {
    const uint64_t keep = l2_keep_policy();
    for (int base = 0; base < count; base += 32) {
        const int here = min(32, count - base);
        const int my_col = lane < here ? __ldcs(cols + base + lane) : 0;
        begin(base, here);
        for (int j = 0; j < here; ++j) {
            const long long n = __shfl_sync(FULL_MASK, my_col, j);
            uint4 rows[R][KV];
#pragma unroll
            for (int r = 0; r < R; ++r) load_weight_row<KV>(rows[r], mats[r] + n * K, lane, K, keep);
            step(j, n, rows);
        }
        finish(base, here);
    }
}

#endif  // TRAIN_COMMON_CUH
