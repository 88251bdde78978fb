// The per-entry step shared by the inference up + down kernels (twell_up_down.cu reads the entries from
// TwELL words, gate_up_down.cu straight from the gate pre-activation).
#ifndef UP_DOWN_COMMON_CUH
#define UP_DOWN_COMMON_CUH
#include "twell_common.cuh"

// One gate non-zero (column n, value g) of a token whose x row is staged in x_smem (piece v of lane l at
// x_smem[v * 32 + l]): u = x . w_up[n] (fp32), h = g * u, acc += h * w_down_t[n], and the token's |h| sum,
// non-zero count and the neuron's fired flag. Both weight rows are requested before any use so they are
// in flight together; above K = 2048 the down row waits for the dot product, to stay within the register
// file. Every lane ends with the same h, l1_sum and l0_sum.
template <int KV>
__device__ __forceinline__ void up_down_entry(long long n, float g, const uint4 *x_smem, float (&acc)[KV][8],
                                              float &l1_sum, int &l0_sum, const __nv_bfloat16 *__restrict__ w_up,
                                              const __nv_bfloat16 *__restrict__ w_down_t, int *__restrict__ fired,
                                              int lane, int K, uint64_t keep) {
    uint4 up_raw[KV], down_raw[KV];
    load_weight_row<KV>(up_raw, w_up + n * K, lane, K, keep);
    if (KV <= 8) load_weight_row<KV>(down_raw, w_down_t + n * K, lane, K, keep);
    // One partial sum per 16-byte piece: KV short FMA chains instead of one long one.
    float dot = 0.0f;
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        float w[8], xv[8];
        bf16x8_to_float(up_raw[v], w);
        bf16x8_to_float(x_smem[v * 32 + lane], xv);
        float part = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) part = fmaf(xv[j], w[j], part);
        dot += part;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, d);
    const float h = g * dot;
    if (KV > 8) load_weight_row<KV>(down_raw, w_down_t + n * K, lane, K, keep);
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        float w[8];
        bf16x8_to_float(down_raw[v], w);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[v][j] = fmaf(h, w[j], acc[v][j]);
    }
    l1_sum += fabsf(h);
    if (h != 0.0f) {
        ++l0_sum;
        // Read before write: once the flag is set, later tokens only read (cheap, no L2 write traffic).
        if (lane == 0 && fired[n] == 0) fired[n] = 1;
    }
}

// Stage a token's x row (read once: streaming loads) as KV * 32 uint4, piece v of lane l at [v * 32 + l];
// thread t of THREADS cooperating threads writes pieces t, t + THREADS, ... (piece q holds columns 8q..).
template <int KV, int THREADS>
__device__ __forceinline__ void stage_x(uint4 *x_smem, const __nv_bfloat16 *__restrict__ x_row, int t, int K) {
#pragma unroll
    for (int i = 0; i < (KV * 32 + THREADS - 1) / THREADS; ++i) {
        const int q = t + i * THREADS;
        if (q < KV * 32) {
            x_smem[q] = q * 8 < K ? __ldcs(reinterpret_cast<const uint4 *>(x_row + q * 8)) : make_uint4(0, 0, 0, 0);
        }
    }
}

// Store a token's fp32 output row (lane layout of acc) as bf16 with streaming stores.
template <int KV>
__device__ __forceinline__ void store_y_row(__nv_bfloat16 *__restrict__ y_row, const float (&acc)[KV][8], int lane,
                                            int K) {
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
        __stcs(reinterpret_cast<uint4 *>(y_row + col), make_uint4(w[0], w[1], w[2], w[3]));
    }
}
#endif  // UP_DOWN_COMMON_CUH
