// Training backward of the gated FFN on the hybrid format, light (ELL) tokens only; the dense backup rows
// go through cuBLAS in sparse_llm/twell_train.py. Tested on an H100 (tests/gpu/test_twell_train.py).
//
//   train_bwd_light : per light token, at its ELL entries (n, g, u):
//                       dh = bf16(bf16(dy[m] . w_down[:, n]) + dl1 * sign(h)),  h = bf16(g * u)
//                       du = bf16(dh * g),  dg = bf16(dh * u)
//                       dx[m] = sum du * w_up[n] + dg * w_gate[n]
//                     and stores h, du, dg at the entries for the weight gradients.
//                     torch reference: formats.hybrid_gated_mlp_backward_ref (hybrid_sddmm, the L1 shift,
//                     hybrid_mul, hybrid_matmul); dx is summed in one fp32 accumulator before rounding.
//   train_csc_wgrad : weight gradients out[n] += sum over the entries e of column n of value(e) * src[row(e)],
//                     e.g. dW_gate = dg^T x, dW_up = du^T x (NV = 2, one gather of x for both) and
//                     dW_down^T = h^T dy (NV = 1). torch reference: formats.hybrid_t_matmul.
#include "train_common.cuh"

// __launch_bounds__(128, 1): without the 1, ptxas caps registers for occupancy (168 at KV = 8) and spills
// the three weight rows in flight; 8 warps per SM with three rows in flight each beat 12 with one (untimed).
template <int KV>
__global__ void __launch_bounds__(128, 1) train_bwd_light(
    const __nv_bfloat16 *__restrict__ dy,        // [M, K]
    const __nv_bfloat16 *__restrict__ w_gate,    // [N, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of down_proj.weight [K, N])
    const int *__restrict__ ell_cols,            // [M, W]
    const __nv_bfloat16 *__restrict__ ell_g,     // [M, W]
    const __nv_bfloat16 *__restrict__ ell_u,     // [M, W]
    const int *__restrict__ ell_count,           // [M]
    const int *__restrict__ row_slot,            // [M] -1 = light
    const float *__restrict__ dl1,               // [1] gradient of the loss w.r.t. sum |h|
    __nv_bfloat16 *__restrict__ ell_h,           // [M, W] out
    __nv_bfloat16 *__restrict__ ell_du,          // [M, W] out
    __nv_bfloat16 *__restrict__ ell_dg,          // [M, W] out
    __nv_bfloat16 *__restrict__ dx,              // [M, K] out (light rows)
    int M, int K, int W) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    if (m >= M || row_slot[m] >= 0) return;  // whole warp
    extern __shared__ uint4 smem[];
    uint4 *dy_row = smem + (threadIdx.x / 32) * KV * 32;
    stage_row<KV>(dy_row, dy + m * K, lane, K);
    __syncwarp();
    const float l1_grad = *dl1;

    float acc[KV][8];
    zero_acc<KV>(acc);
    const int count = ell_count[m];
    for (int base = 0; base < count; base += 32) {
        const int mine = base + lane;
        const bool has = mine < count;
        const long long at = m * W + mine;
        const int my_col = has ? ell_cols[at] : 0;
        const float my_g = has ? bf16_load(ell_g + at) : 0.0f;
        const float my_u = has ? bf16_load(ell_u + at) : 0.0f;
        float my_h = 0.0f, my_du = 0.0f, my_dg = 0.0f;
        const int here = min(32, count - base);
        for (int j = 0; j < here; ++j) {
            const long long n = __shfl_sync(FULL_MASK, my_col, j);
            const float g = __shfl_sync(FULL_MASK, my_g, j);
            const float u = __shfl_sync(FULL_MASK, my_u, j);
            // Up to K = 2048 the three weight rows are requested together so their latencies overlap;
            // above, the up and gate rows wait for the dot product, to stay within the register file.
            uint4 down[KV], up[KV], gate[KV];
            load_row<KV>(down, w_down_t + n * K, lane, K);
            if constexpr (KV <= 8) {
                load_row<KV>(up, w_up + n * K, lane, K);
                load_row<KV>(gate, w_gate + n * K, lane, K);
            }
            const float d = bf16_round(warp_sum(lane_dot<KV>(dy_row, down, lane)));
            const float h = bf16_round(g * u);
            const float sign = h > 0.0f ? 1.0f : (h < 0.0f ? -1.0f : 0.0f);  // d|h|/dh, 0 at 0 like autograd
            const float dh = bf16_round(d + l1_grad * sign);
            const float du = bf16_round(dh * g);
            const float dg = bf16_round(dh * u);
            if constexpr (KV > 8) {
                load_row<KV>(up, w_up + n * K, lane, K);
                load_row<KV>(gate, w_gate + n * K, lane, K);
            }
            axpy<KV>(acc, du, up);
            axpy<KV>(acc, dg, gate);
            if (lane == j) {
                my_h = h;
                my_du = du;
                my_dg = dg;
            }
        }
        if (has) {
            ell_h[at] = __float2bfloat16_rn(my_h);
            ell_du[at] = __float2bfloat16_rn(my_du);
            ell_dg[at] = __float2bfloat16_rn(my_dg);
        }
    }
    store_row_bf16<KV>(dx + m * K, acc, lane, K);
}

// Column-major (CSC) walk of the ELL entries: `order` lists the positions m * W + s of all light entries
// sorted by column (stable, so rows ascend within a column), col_start[n] .. col_start[n+1] are column n's.
// Columns are cut into chunks of `chunk` entries so a hot neuron (firing for most tokens) is spread over
// many warps; chunk_start[n] is the first chunk of column n and chunk_start[N] the total, read on the device
// (the host never learns it). A persistent grid of warps strides over the chunks. Each chunk accumulates
// its K-wide partial sums in fp32 registers and adds them to the fp32 output with vector atomics, so the
// order of the additions (not their set) varies run to run for columns with more than one chunk.
template <int KV, int NV>
__global__ void __launch_bounds__(128) train_csc_wgrad(
    const long long *__restrict__ order,        // [M * W] entry positions sorted by column
    const long long *__restrict__ col_start,    // [N + 1]
    const long long *__restrict__ chunk_start,  // [N + 1]
    const __nv_bfloat16 *__restrict__ value0,   // [M, W] values at the entries
    const __nv_bfloat16 *__restrict__ value1,   // [M, W] (NV == 2) second value array
    const __nv_bfloat16 *__restrict__ src,      // [M, K] rows gathered per entry (x or dy)
    float *__restrict__ out0,                   // [N, K] fp32, accumulated
    float *__restrict__ out1,                   // [N, K] fp32, accumulated (NV == 2)
    int N, int K, int W, int chunk) {
    const int lane = threadIdx.x & 31;
    const long long total = chunk_start[N];
    const long long warps = static_cast<long long>(gridDim.x) * 4;
    for (long long c = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32; c < total; c += warps) {
        // Column of chunk c: the last n with chunk_start[n] <= c (columns without entries have no chunks).
        int lo = 0, hi = N;
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (chunk_start[mid] <= c) lo = mid;
            else hi = mid;
        }
        const long long n = lo;
        const long long e0 = col_start[n] + (c - chunk_start[n]) * chunk;
        const long long e1 = min(e0 + chunk, col_start[n + 1]);

        float acc[NV][KV][8];
#pragma unroll
        for (int i = 0; i < NV; ++i) zero_acc<KV>(acc[i]);
        for (long long base = e0; base < e1; base += 32) {
            const long long e = base + lane;
            const long long my_pos = e < e1 ? order[e] : 0;
            const float my_v0 = e < e1 ? bf16_load(value0 + my_pos) : 0.0f;
            const float my_v1 = (NV == 2 && e < e1) ? bf16_load(value1 + my_pos) : 0.0f;
            const int here = static_cast<int>(min(32LL, e1 - base));
            for (int j = 0; j < here; ++j) {
                const long long pos = __shfl_sync(FULL_MASK, my_pos, j);
                const float v0 = __shfl_sync(FULL_MASK, my_v0, j);
                const float v1 = __shfl_sync(FULL_MASK, my_v1, j);
                uint4 row[KV];
                load_row<KV>(row, src + (pos / W) * K, lane, K);
                axpy<KV>(acc[0], v0, row);
                if constexpr (NV == 2) axpy<KV>(acc[NV - 1], v1, row);
            }
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            float *out = (i == 0 ? out0 : out1) + n * K;
#pragma unroll
            for (int v = 0; v < KV; ++v) {
                const int col = v * 256 + lane * 8;
                if (col >= K) continue;
                atomicAdd(reinterpret_cast<float4 *>(out + col),
                          make_float4(acc[i][v][0], acc[i][v][1], acc[i][v][2], acc[i][v][3]));
                atomicAdd(reinterpret_cast<float4 *>(out + col + 4),
                          make_float4(acc[i][v][4], acc[i][v][5], acc[i][v][6], acc[i][v][7]));
            }
        }
    }
}

// Instantiations for the nvcc compile check; NVRTC builds the ones named by the launcher.
#define TRAIN_BWD_LIGHT(KV)                                                                                   \
    template __global__ void train_bwd_light<KV>(                                                            \
        const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *,          \
        const int *, const __nv_bfloat16 *, const __nv_bfloat16 *, const int *, const int *, const float *,  \
        __nv_bfloat16 *, __nv_bfloat16 *, __nv_bfloat16 *, __nv_bfloat16 *, int, int, int);
#define TRAIN_CSC_WGRAD(KV, NV)                                                                                  \
    template __global__ void train_csc_wgrad<KV, NV>(const long long *, const long long *, const long long *, \
                                                     const __nv_bfloat16 *, const __nv_bfloat16 *,            \
                                                     const __nv_bfloat16 *, float *, float *, int, int, int, int);
TRAIN_BWD_LIGHT(1)
TRAIN_BWD_LIGHT(8)
TRAIN_BWD_LIGHT(16)
TRAIN_CSC_WGRAD(1, 1)
TRAIN_CSC_WGRAD(8, 1)
TRAIN_CSC_WGRAD(8, 2)
TRAIN_CSC_WGRAD(16, 2)
