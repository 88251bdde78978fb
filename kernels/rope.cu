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
#include "twell_common.cuh"

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_float(float &dst, float v) { dst = v; }
__device__ __forceinline__ void from_float(__nv_bfloat16 &dst, float v) { dst = __float2bfloat16_rn(v); }

// V consecutive elements, loaded and stored as one access (8 or 16 bytes for the launcher's choices of V).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

// One thread turns V consecutive pairs (d .. d + V - 1, d + half .. d + half + V - 1) of one head; the
// launcher picks V so that half, D and the angle strides are multiples of it (V = 1 always works).
template <typename T, typename A, int V>
__global__ void __launch_bounds__(256) rope_rotate_half(const T *__restrict__ q_in, const T *__restrict__ k_in,
                                                        T *__restrict__ q_out, T *__restrict__ k_out,
                                                        const A *__restrict__ cos, const A *__restrict__ sin,
                                                        long long tokens, int seq_len, int q_heads, int k_heads,
                                                        int half, long long angle_stride_b,
                                                        long long angle_stride_s, float sign) {
    const int chunks = half / V;  // per head
    const long long q_items = tokens * q_heads * chunks;
    const long long items = q_items + tokens * k_heads * chunks;
    for (long long item = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<long long>(gridDim.x) * blockDim.x) {
        const bool is_q = item < q_items;
        const long long local = is_q ? item : item - q_items;
        const long long row = local / chunks;  // token * heads + head
        const int d = static_cast<int>(local - row * chunks) * V;
        const long long token = row / (is_q ? q_heads : k_heads);
        const long long base = row * (2LL * half) + d;
        const T *in = is_q ? q_in : k_in;
        T *out = is_q ? q_out : k_out;
        const long long angle = token / seq_len * angle_stride_b + token % seq_len * angle_stride_s + d;
        const Pack<T, V> x1 = *reinterpret_cast<const Pack<T, V> *>(in + base);
        const Pack<T, V> x2 = *reinterpret_cast<const Pack<T, V> *>(in + base + half);
        const Pack<A, V> c1 = *reinterpret_cast<const Pack<A, V> *>(cos + angle);
        const Pack<A, V> c2 = *reinterpret_cast<const Pack<A, V> *>(cos + angle + half);
        const Pack<A, V> s1 = *reinterpret_cast<const Pack<A, V> *>(sin + angle);
        const Pack<A, V> s2 = *reinterpret_cast<const Pack<A, V> *>(sin + angle + half);
        Pack<T, V> y1, y2;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float a = to_float(x1.v[i]), b = to_float(x2.v[i]);
            from_float(y1.v[i], a * to_float(c1.v[i]) - b * sign * to_float(s1.v[i]));
            from_float(y2.v[i], b * to_float(c2.v[i]) + a * sign * to_float(s2.v[i]));
        }
        *reinterpret_cast<Pack<T, V> *>(out + base) = y1;
        *reinterpret_cast<Pack<T, V> *>(out + base + half) = y2;
    }
}

#define ROPE_ROTATE_HALF(T, A, V)                                                                         \
    template __global__ void rope_rotate_half<T, A, V>(const T *, const T *, T *, T *, const A *, const A *, \
                                                       long long, int, int, int, int, long long, long long, float);
ROPE_ROTATE_HALF(__nv_bfloat16, __nv_bfloat16, 8)
ROPE_ROTATE_HALF(__nv_bfloat16, __nv_bfloat16, 1)
ROPE_ROTATE_HALF(__nv_bfloat16, float, 8)
ROPE_ROTATE_HALF(__nv_bfloat16, float, 1)
ROPE_ROTATE_HALF(float, float, 4)
ROPE_ROTATE_HALF(float, float, 1)
