// Rotary position embedding in the rotate-half convention of Llama checkpoints, for q and k in one pass.
// A head vector x of width D = 2 * half turns by the angles whose cosines and sines `cos`, `sin` hold per
// (batch, position, d) (entries d and d + half repeat the same angle):
//   out[d]        = x[d] * cos[d]               - x[d + half] * sin[d]
//   out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half]
// in fp32 with one rounding to T. transformers runs this as ten elementwise kernels over q and k (about
// 1 ms per layer at 16384 tokens x 2048 features); here it is one read and one write of each.
// sign = -1 negates the sines: the inverse rotation, which is the backward (rotations are orthogonal).
//
// Layouts: q [tokens, q_heads, D] and k [tokens, k_heads, D] contiguous (the projections' outputs viewed
// as heads), token = b * seq_len + s; cos/sin element (b, s, d) at b * angle_stride_b + s * angle_stride_s + d.
// One thread per rotated pair (token, head, d < half) of q, then of k.
#include "twell_common.cuh"

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store(float *p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T, typename A>
__global__ void __launch_bounds__(256) rope_rotate_half(const T *__restrict__ q_in, const T *__restrict__ k_in,
                                                        T *__restrict__ q_out, T *__restrict__ k_out,
                                                        const A *__restrict__ cos, const A *__restrict__ sin,
                                                        long long tokens, int seq_len, int q_heads, int k_heads,
                                                        int half, long long angle_stride_b,
                                                        long long angle_stride_s, float sign) {
    const long long q_pairs = tokens * q_heads * half;
    const long long pairs = q_pairs + tokens * k_heads * half;
    for (long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
         p += static_cast<long long>(gridDim.x) * blockDim.x) {
        const bool is_q = p < q_pairs;
        const long long local = is_q ? p : p - q_pairs;
        const int heads = is_q ? q_heads : k_heads;
        const int d = static_cast<int>(local % half);
        const long long token = local / half / heads;
        const long long base = local / half * (2LL * half) + d;  // (token * heads + head) * D + d
        const T *in = is_q ? q_in : k_in;
        T *out = is_q ? q_out : k_out;
        const long long angle = token / seq_len * angle_stride_b + token % seq_len * angle_stride_s + d;
        const float x1 = to_float(in[base]), x2 = to_float(in[base + half]);
        const float c1 = to_float(cos[angle]), c2 = to_float(cos[angle + half]);
        const float s1 = sign * to_float(sin[angle]), s2 = sign * to_float(sin[angle + half]);
        store(out + base, x1 * c1 - x2 * s1);
        store(out + base + half, x2 * c2 + x1 * s2);
    }
}

template __global__ void rope_rotate_half<__nv_bfloat16, __nv_bfloat16>(
    const __nv_bfloat16 *, const __nv_bfloat16 *, __nv_bfloat16 *, __nv_bfloat16 *, const __nv_bfloat16 *,
    const __nv_bfloat16 *, long long, int, int, int, int, long long, long long, float);
template __global__ void rope_rotate_half<__nv_bfloat16, float>(
    const __nv_bfloat16 *, const __nv_bfloat16 *, __nv_bfloat16 *, __nv_bfloat16 *, const float *, const float *,
    long long, int, int, int, int, long long, long long, float);
template __global__ void rope_rotate_half<float, float>(const float *, const float *, float *, float *, const float *,
                                                        const float *, long long, int, int, int, int, long long,
                                                        long long, float);
