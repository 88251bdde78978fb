// Shared definitions of the TwELL format (see sparse_llm/formats.py for the torch specification).
//
// The gate activations g = relu(x Wg^T) [M, N] are cut into tiles of 256 columns. Each (token, tile) owns a
// segment of 32 uint32 words in a row-major buffer [M, (N/256) * 32]:
//   word 0      : number of strictly positive values in that 256-column slice (never clamped, so a count
//                 above TWELL_CAPACITY marks an overflowed tile whose entries are incomplete),
//   words 1..31 : (bf16 bits of the value << 16) | global column index, in any order.
// Files that include this header are compiled by NVRTC, which has no host C++ headers: only CUDA headers.
#ifndef TWELL_COMMON_CUH
#define TWELL_COMMON_CUH
#include <cuda_bf16.h>
#include <cuda/std/cstdint>

using cuda::std::uint8_t;
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;

[[maybe_unused]] constexpr int TWELL_TILE = 256;      // columns of g per tile
[[maybe_unused]] constexpr int TWELL_SLOTS = 32;      // words per (token, tile) segment
[[maybe_unused]] constexpr int TWELL_CAPACITY = 31;   // payload words per segment
[[maybe_unused]] constexpr unsigned FULL_MASK = 0xffffffffu;

// One packed entry: the value's bf16 bits (round to nearest even) above the 16-bit global column.
__device__ __forceinline__ uint32_t twell_entry(float value, int col) {
    const uint32_t bits = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(value)));
    return (bits << 16) | static_cast<uint32_t>(col);
}

// The entry's value as fp32 (exact: bf16 is the upper half of an fp32).
__device__ __forceinline__ float twell_value(uint32_t entry) { return __uint_as_float(entry & 0xffff0000u); }

__device__ __forceinline__ int twell_col(uint32_t entry) { return static_cast<int>(entry & 0xffffu); }

// Eight bf16 packed in a 16-byte vector, widened to fp32.
__device__ __forceinline__ void bf16x8_to_float(const uint4 &v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
#endif  // TWELL_COMMON_CUH
