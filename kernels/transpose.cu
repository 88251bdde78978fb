// Transposed copy to bf16: dst [C, R] = bf16(src [R, C]) for a bf16 or fp32 src. Used for the transposed
// down-projection weight the gather kernels read row by row, and for the fp32 dW_down accumulator of the
// training backward. A strided torch copy is uncoalesced on one side; here a 32 x 32 tile goes through
// shared memory so reads and writes are both coalesced. R and C are multiples of 32 (the launcher checks).
#include "twell_common.cuh"

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Block (32, 8) moves one 32 x 32 tile: thread (x, y) reads rows y, y + 8, ... of the tile at column x.
template <typename T>
__global__ void __launch_bounds__(256) transpose_to_bf16(const T *__restrict__ src, __nv_bfloat16 *__restrict__ dst,
                                                         int R, int C) {
    __shared__ float tile[32][33];  // one padding column: the transposed reads hit 32 different banks
    const long long r0 = static_cast<long long>(blockIdx.y) * 32;
    const long long c0 = static_cast<long long>(blockIdx.x) * 32;
    const int x = threadIdx.x, y = threadIdx.y;
#pragma unroll
    for (int i = 0; i < 32; i += 8) tile[y + i][x] = as_float(__ldcs(src + (r0 + y + i) * C + c0 + x));
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 32; i += 8) dst[(c0 + y + i) * R + r0 + x] = __float2bfloat16_rn(tile[x][y + i]);
}

template __global__ void transpose_to_bf16<float>(const float *, __nv_bfloat16 *, int, int);
template __global__ void transpose_to_bf16<__nv_bfloat16>(const __nv_bfloat16 *, __nv_bfloat16 *, int, int);
