// The gated FFN for a few tokens at a time (decode steps, small batches):
//   y = (relu(x Wg^T) * (x Wu^T)) Wd^T   for M <= DECODE_MAX_M tokens, in one pass over the neurons.
//
// A few tokens cannot share weight rows the way a large batch does: every weight byte is read for a handful of
// dot products, so the block is bound by how many weight bytes it reads. The dense block reads all three
// matrices; this kernel reads w_gate whole and, of w_up and w_down, only the rows of neurons that fire for some
// token. Each warp takes whole neurons: it loads the neuron's gate row once, dots it with every token's x
// (staged in shared memory by its block), and only where some token's gate is positive loads the neuron's up row,
// forms h, loads the neuron's row of w_down^T and adds h * that row into the tokens' fp32 output rows with vector
// atomics. Any density is exact (nothing to overflow: a neuron firing for every token costs one more row pair,
// as in the dense block); the atomics make the order of y's fp32 sums vary from call to call (last-bit
// differences after rounding to bf16).
//
// Rounding follows the dense bf16 block: g and u are rounded to bf16 as a bf16 GEMM stores them, h = g * u is
// rounded to bf16, and y is summed in fp32 and rounded once (decode_finish).
#include "twell_common.cuh"

[[maybe_unused]] constexpr int DECODE_MAX_M = 16;  // tokens per call (DECODE_MAX_M in sparse_llm/twell_backend.py)
[[maybe_unused]] constexpr int DECODE_WARPS = 16;  // warps per block (DECODE_WARPS there)

// Adds h * w (this lane's KV pieces of a K-wide bf16 row) into a K-wide fp32 row, 16 bytes per atomic.
template <int KV>
__device__ __forceinline__ void add_scaled_row(float *__restrict__ out, float h, const uint4 (&w)[KV], int lane,
                                               int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col < K) {
            float b[8];
            bf16x8_to_float(w[v], b);
            atomicAdd(reinterpret_cast<float4 *>(out + col), make_float4(h * b[0], h * b[1], h * b[2], h * b[3]));
            atomicAdd(reinterpret_cast<float4 *>(out + col + 4), make_float4(h * b[4], h * b[5], h * b[6], h * b[7]));
        }
    }
}

// One pass over the N neurons for M tokens. x, w_gate, w_up, w_down_t: bf16 [M, K], [N, K], [N, K], [N, K] (w_down_t
// is w_down transposed: row n = neuron n's output weights). y_sum: fp32 [M, K], zeroed, receives h w_down^T.
// l1 (fp32 [M]) and l0 (int32 [M]), zeroed: sum |h| and the count of h != 0 per token; fired (int32 [N]): 1 where
// neuron n has some h != 0, else 0. Grid: any number of blocks of DECODE_WARPS warps (they stride over the
// neurons); dynamic shared memory: M * KV * 512 bytes of x plus DECODE_WARPS * DECODE_MAX_M floats of gate values.
template <int KV>
__global__ void __launch_bounds__(DECODE_WARPS * 32, KV <= 8 ? 2 : 1) decode_ffn(
    const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w_gate,
    const __nv_bfloat16 *__restrict__ w_up, const __nv_bfloat16 *__restrict__ w_down_t, float *__restrict__ y_sum,
    float *__restrict__ l1, int *__restrict__ l0, int *__restrict__ fired, int M, int K, int N) {
    extern __shared__ uint4 smem[];
    uint4 *x_rows = smem;  // token t's row at [t * KV * 32], in stage_row's layout
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *values = reinterpret_cast<float *>(smem + M * KV * 32) + warp * DECODE_MAX_M;  // this warp's g, then h
    for (int q = threadIdx.x; q < M * KV * 32; q += blockDim.x) {
        const int t = q / (KV * 32), p = q % (KV * 32);  // piece p of token t holds its columns 8p .. 8p + 7
        x_rows[q] = p * 8 < K ? __ldg(reinterpret_cast<const uint4 *>(x + static_cast<size_t>(t) * K + p * 8))
                              : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    const uint64_t once = l2_stream_policy();  // each weight row is read once per call
    for (int n = blockIdx.x * DECODE_WARPS + warp; n < N; n += gridDim.x * DECODE_WARPS) {
        uint4 w[KV];
        load_weight_row<KV>(w, w_gate + static_cast<size_t>(n) * K, lane, K, once);
        // Butterfly sums leave every lane with the same dot products, so `live` (bit t: token t has h != 0 here) is
        // the same on all lanes; lane 0 keeps the values where the other lanes read them after a __syncwarp.
        unsigned live = 0;
        for (int t = 0; t < M; ++t) {
            const float g = bf16_round(warp_sum(lane_dot<KV>(x_rows + t * KV * 32, w, lane)));
            if (lane == 0) values[t] = g;
            if (g > 0.0f) live |= 1u << t;
        }
        __syncwarp();
        if (live != 0) {
            load_weight_row<KV>(w, w_up + static_cast<size_t>(n) * K, lane, K, once);
            for (unsigned rest = live; rest != 0; rest &= rest - 1) {
                const int t = __ffs(rest) - 1;
                const float u = bf16_round(warp_sum(lane_dot<KV>(x_rows + t * KV * 32, w, lane)));
                const float h = bf16_round(values[t] * u);
                __syncwarp();
                if (lane == 0) values[t] = h;
                if (h == 0.0f) live &= ~(1u << t);
            }
            __syncwarp();
        }
        if (lane == 0 && fired != nullptr) fired[n] = live != 0;
        if (live == 0) continue;
        load_weight_row<KV>(w, w_down_t + static_cast<size_t>(n) * K, lane, K, once);
        for (unsigned rest = live; rest != 0; rest &= rest - 1) {
            const int t = __ffs(rest) - 1;
            const float h = values[t];
            add_scaled_row<KV>(y_sum + static_cast<size_t>(t) * K, h, w, lane, K);
            if (lane == 0) {
                atomicAdd(l0 + t, 1);
                atomicAdd(l1 + t, fabsf(h));
            }
        }
        __syncwarp();
    }
}

// y (bf16 [M, K]) = y_sum (fp32 [M, K]) rounded to bf16, plus residual (bf16 [M, K], or null) added as the unfused
// path adds it (add_residual8). `pieces` = M * K / 8; any grid.
extern "C" __global__ void decode_finish(const float *__restrict__ y_sum, const __nv_bfloat16 *__restrict__ residual,
                                         __nv_bfloat16 *__restrict__ y, int pieces) {
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < pieces; q += gridDim.x * blockDim.x) {
        const float4 lo = __ldcs(reinterpret_cast<const float4 *>(y_sum) + 2 * q);
        const float4 hi = __ldcs(reinterpret_cast<const float4 *>(y_sum) + 2 * q + 1);
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (residual != nullptr) add_residual8(v, __ldcs(reinterpret_cast<const uint4 *>(residual) + q));
        __stcs(reinterpret_cast<uint4 *>(y) + q, pack_bf16x8(v));
    }
}

#define DECODE_FFN(KV)                                                                                                \
    template __global__ void decode_ffn<KV>(const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *,    \
                                            const __nv_bfloat16 *, float *, float *, int *, int *, int, int, int);
DECODE_FFN(1)
DECODE_FFN(2)
DECODE_FFN(3)
DECODE_FFN(4)
DECODE_FFN(5)
DECODE_FFN(6)
DECODE_FFN(7)
DECODE_FFN(8)
DECODE_FFN(9)
DECODE_FFN(10)
DECODE_FFN(11)
DECODE_FFN(12)
DECODE_FFN(13)
DECODE_FFN(14)
DECODE_FFN(15)
DECODE_FFN(16)
