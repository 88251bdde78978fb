// Transposed copy with a cast: dst [C, R] = src [R, C]^T (or dst += src^T), bf16 or fp32 on either side. Used for
// the transposed down-projection weight the gather kernels read row by row (bf16 or fp32 master weights -> bf16),
// and for the fp32 dW_down accumulator of the training backward (-> fp32 master weights' gradient, or bf16; added to
// the gradient a step holds over its micro-batches). A strided
// torch copy is uncoalesced on one side; here a 32 x 32 tile goes through shared memory so reads and writes
// are both coalesced. R and C are multiples of 32 (the launcher checks).
#include "twell_common.cuh"

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Block (32, 8) moves one 32 x 32 tile: thread (x, y) reads rows y, y + 8, ... of the tile at column x. With `add`
// the tile is added to what dst holds (a gradient accumulated over micro-batches in place).
template <typename In, typename Out>
__global__ void __launch_bounds__(256) transpose_cast(const In *__restrict__ src, Out *__restrict__ dst, int R, int C,
                                                      int add) {
    __shared__ float tile[32][33];  // one padding column: the transposed reads hit 32 different banks
    const long long r0 = static_cast<long long>(blockIdx.y) * 32;
    const long long c0 = static_cast<long long>(blockIdx.x) * 32;
    const int x = threadIdx.x, y = threadIdx.y;
#pragma unroll
    for (int i = 0; i < 32; i += 8) tile[y + i][x] = as_float(__ldcs(src + (r0 + y + i) * C + c0 + x));
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 32; i += 8) {
        Out *const at = dst + (c0 + y + i) * R + r0 + x;
        *at = from_float<Out>(tile[x][y + i] + (add ? as_float(*at) : 0.0f));
    }
}

template __global__ void transpose_cast<float, __nv_bfloat16>(const float *, __nv_bfloat16 *, int, int, int);
template __global__ void transpose_cast<__nv_bfloat16, __nv_bfloat16>(const __nv_bfloat16 *, __nv_bfloat16 *, int, int,
                                                                       int);
template __global__ void transpose_cast<float, float>(const float *, float *, int, int, int);
