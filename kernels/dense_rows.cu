// The direct route's heavy tokens through dense GEMMs (inference). gate_up_down_light lists the tokens with more gate
// positives than split_nnz in heavy_rows (heavy_count[0] of them, a number only the device knows). Walking such a token
// costs two weight rows per positive; a dense row of the block costs about as much as 70 of them
// (sparse_llm/ffn/twell/cost_model.py prices both). The host reserves `capacity` rows from the layer's recent density,
// and these kernels give the first min(count, capacity) heavy tokens the dense path's arithmetic around two cuBLAS
// GEMMs:
//   gather_dense_rows : x_CK[i] = x[heavy_rows[i]]                     (zero rows past the taken ones)
//   u_CN = x_CK w_up^T                                                 (cuBLAS)
//   dense_rows_h      : h_CN[i] = relu(gate[heavy_rows[i]]) * u_CN[i]  (in place, bf16 as the dense path rounds it),
//                       with the token's l1 (sum |h|), l0 (h != 0) and fired flags
//   y_CK = h_CN w_down^T                                               (cuBLAS)
//   scatter_dense_rows: y[heavy_rows[i]] = y_CK[i] (+ the residual row, rounded as the two unfused bf16 steps),
//                       and with norm_weight the row's RMSNorm (the next layer's input norm) into normed
// Tokens past the capacity stay on gate_up_down_heavy, which reads heavy_rows + capacity and rest_count[0], written
// here; no host synchronisation anywhere. One block of DENSE_ROWS_THREADS per reserved row.
#include "twell_common.cuh"


__device__ __forceinline__ int rows_taken(const int *__restrict__ heavy_count, int capacity) {
    return min(*heavy_count, capacity);
}

extern "C" __global__ void __launch_bounds__(DENSE_ROWS_THREADS) gather_dense_rows(
    const __nv_bfloat16 *__restrict__ x,   // [M, K]
    const int *__restrict__ heavy_rows,    // [M] from gate_up_down_light
    const int *__restrict__ heavy_count,   // [1]
    __nv_bfloat16 *__restrict__ x_CK,      // [capacity, K] out
    int *__restrict__ rest_count,          // [1] out: heavy tokens left to gate_up_down_heavy
    int capacity, int K) {
    const int i = blockIdx.x;
    const int taken = rows_taken(heavy_count, capacity);
    if (i == 0 && threadIdx.x == 0) *rest_count = *heavy_count - taken;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + static_cast<long long>(i < taken ? heavy_rows[i] : 0) * K);
    uint4 *dst = reinterpret_cast<uint4 *>(x_CK + static_cast<long long>(i) * K);
    for (int c = threadIdx.x; c < K / 8; c += DENSE_ROWS_THREADS) {
        dst[c] = i < taken ? __ldcs(src + c) : make_uint4(0, 0, 0, 0);
    }
}

extern "C" __global__ void __launch_bounds__(DENSE_ROWS_THREADS) dense_rows_h(
    const __nv_bfloat16 *__restrict__ gate,  // [M, N] pre-activation x w_gate^T
    const int *__restrict__ heavy_rows,      // [M]
    const int *__restrict__ heavy_count,     // [1]
    __nv_bfloat16 *__restrict__ u_CN,        // [capacity, N] in: x_CK w_up^T; out: h (zero rows past the taken ones)
    float *__restrict__ l1,                  // [M] out (taken tokens)
    int *__restrict__ l0,                    // [M] out (taken tokens)
    int *__restrict__ fired,                 // [N] set to 1 where h != 0
    int capacity, int N) {
    const int i = blockIdx.x;
    const bool taken = i < rows_taken(heavy_count, capacity);
    const long long m = taken ? heavy_rows[i] : 0;
    const uint4 *g_row = reinterpret_cast<const uint4 *>(gate + m * N);
    uint4 *h_row = reinterpret_cast<uint4 *>(u_CN + static_cast<long long>(i) * N);
    float l1_sum = 0.0f;
    int l0_sum = 0;
    for (int c = threadIdx.x; c < N / 8; c += DENSE_ROWS_THREADS) {
        if (!taken) {
            h_row[c] = make_uint4(0, 0, 0, 0);
            continue;
        }
        float g[8], u[8], h[8];
        bf16x8_to_float(__ldcs(g_row + c), g);
        bf16x8_to_float(h_row[c], u);
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = fmaxf(g[j], 0.0f) * u[j];
        const uint4 packed = pack_bf16x8(h);
        h_row[c] = packed;
        bf16x8_to_float(packed, h);  // the statistics count the stored bf16 values, as the dense path's do
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            l1_sum += fabsf(h[j]);
            if (h[j] != 0.0f) {
                ++l0_sum;
                if (fired[c * 8 + j] == 0) fired[c * 8 + j] = 1;
            }
        }
    }
    if (!taken) return;  // the whole block leaves: no barrier below is skipped by part of it
    __shared__ float warp_l1[DENSE_ROWS_THREADS / 32];
    __shared__ int warp_l0[DENSE_ROWS_THREADS / 32];
    const int lane = threadIdx.x & 31;
    l1_sum = warp_sum(l1_sum);
    l0_sum = __reduce_add_sync(FULL_MASK, l0_sum);
    if (lane == 0) {
        warp_l1[threadIdx.x / 32] = l1_sum;
        warp_l0[threadIdx.x / 32] = l0_sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float l1_total = 0.0f;
        int l0_total = 0;
        for (int w = 0; w < DENSE_ROWS_THREADS / 32; ++w) {
            l1_total += warp_l1[w];
            l0_total += warp_l0[w];
        }
        l1[m] = l1_total;
        l0[m] = l0_total;
    }
}

extern "C" __global__ void __launch_bounds__(DENSE_ROWS_THREADS) scatter_dense_rows(
    const __nv_bfloat16 *__restrict__ y_CK,      // [capacity, K] = h_CN w_down^T
    const int *__restrict__ heavy_rows,          // [M]
    const int *__restrict__ heavy_count,         // [1]
    const __nv_bfloat16 *__restrict__ residual,  // [M, K] added to y, or null
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (taken tokens)
    int capacity, int K,
    const __nv_bfloat16 *__restrict__ norm_weight,  // [K] the next layer's input norm weight, or null
    __nv_bfloat16 *__restrict__ normed,              // [M, K] out with norm_weight (taken tokens)
    float norm_eps) {
    const int i = blockIdx.x;
    if (i >= rows_taken(heavy_count, capacity)) return;
    const long long m = heavy_rows[i];
    const uint4 *src = reinterpret_cast<const uint4 *>(y_CK + static_cast<long long>(i) * K);
    const uint4 *res = residual == nullptr ? nullptr : reinterpret_cast<const uint4 *>(residual + m * K);
    uint4 *dst = reinterpret_cast<uint4 *>(y + m * K);
    float squares = 0.0f;  // of the stored row's columns this thread owns, for its norm
    for (int c = threadIdx.x; c < K / 8; c += DENSE_ROWS_THREADS) {
        float v[8];
        bf16x8_to_float(__ldcs(src + c), v);
        if (res != nullptr) add_residual8(v, __ldcs(res + c));
        __stcs(dst + c, pack_bf16x8(v));
        squares += bf16_squares8(v);
    }
    if (norm_weight != nullptr) store_groups_normed(y + m * K, normed + m * K, norm_weight, squares, norm_eps, K);
}
