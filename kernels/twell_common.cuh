// Shared definitions of the TwELL format (see sparse_llm/formats/twell.py for the torch specification).
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

// TWELL_TILE (columns of g per tile), TWELL_SLOTS (words per (token, tile) segment) and the other constants shared
// with Python are #defined in front of every source by sparse_llm/cuda/runtime.py (sparse_llm/cuda/kernel_constants.py).
[[maybe_unused]] constexpr int TWELL_CAPACITY = TWELL_SLOTS - 1;  // payload words per segment
[[maybe_unused]] constexpr unsigned FULL_MASK = 0xffffffffu;

// One packed entry: the value's bf16 bits (round to nearest even) above the 16-bit global column.
__device__ __forceinline__ uint32_t twell_entry(float value, int col) {
    const uint32_t bits = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(value)));
    return (bits << 16) | static_cast<uint32_t>(col);
}

// The entry's value as fp32 (exact: bf16 is the upper half of an fp32).
__device__ __forceinline__ float twell_value(uint32_t entry) { return __uint_as_float(entry & 0xffff0000u); }

__device__ __forceinline__ int twell_col(uint32_t entry) { return static_cast<int>(entry & 0xffffu); }

// v rounded to bf16 (round to nearest even), as fp32: a value where the torch reference holds a bf16 tensor.
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Eight bf16 packed in a 16-byte vector, widened to fp32.
__device__ __forceinline__ void bf16x8_to_float(const uint4 &v, float (&f)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// L2 policy for weight rows: they are re-read by many tokens, so ask L2 to keep them (evict_last) while
// activations stream through with evict_first loads.
__device__ __forceinline__ uint64_t l2_keep_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// L2 policy for data each reader needs once (e.g. a weight slice copied to shared memory): evict it first.
__device__ __forceinline__ uint64_t l2_stream_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// 4-byte read-only load under an L2 cache policy.
__device__ __forceinline__ uint32_t load_u32_policy(const uint32_t *ptr, uint64_t policy) {
    uint32_t v;
    asm("ld.global.nc.L2::cache_hint.u32 %0, [%1], %2;\n" : "=r"(v) : "l"(ptr), "l"(policy));
    return v;
}

// 16-byte read-only load of ptr + OFFSET bytes under an L2 cache policy. The constant offset goes into
// the instruction, so all pieces of a row share one address register.
template <int OFFSET>
__device__ __forceinline__ uint4 load_keep(const void *ptr, uint64_t policy) {
    uint4 v;
    asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4+%6], %5;\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr), "l"(policy), "n"(OFFSET));
    return v;
}

template <int KV, int V = 0>
__device__ __forceinline__ void load_weight_pieces(uint4 (&dst)[KV], const __nv_bfloat16 *lane_row, int lane_col, int K,
                                                   uint64_t policy) {
    if constexpr (V < KV) {
        dst[V] = lane_col + V * 256 < K ? load_keep<V * 512>(lane_row, policy) : make_uint4(0, 0, 0, 0);
        load_weight_pieces<KV, V + 1>(dst, lane_row, lane_col, K, policy);
    }
}

// This lane's KV 16-byte pieces of a K-wide weight row (lane l owns columns v * 256 + 8l .. + 7 of piece v;
// zeros past K) under the L2 policy `policy`.
template <int KV>
__device__ __forceinline__ void load_weight_row(uint4 (&dst)[KV], const __nv_bfloat16 *row, int lane, int K,
                                                uint64_t policy) {
    load_weight_pieces<KV>(dst, row + lane * 8, lane * 8, K, policy);
}

// Sum of v over lanes 0 .. lane of a full warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const T below = __shfl_up_sync(FULL_MASK, v, d);
        if (lane >= d) v += below;
    }
    return v;
}

// This lane's 8 bf16 gate values (columns col0 .. col0 + 7 of a 256-column chunk whose lanes hold consecutive
// 8-column groups): their positives are appended as entries to `list` in ascending column order from slot
// `base` on (slots >= cap are counted, not stored). Returns the chunk's positive count (same on all lanes).
// A lane's slot comes from votes, not from a prefix sum by shuffles (a token lists its N / 256 chunks one after the
// other, and two votes answer sooner than a chain of five shuffles): where no lane holds two positives (nearly every
// chunk of a sparse row), each lane's slot is a count of bits; otherwise four ballots give the lanes' counts bit by
// bit. No early exit for a chunk without positives: the callers that list several chunks at once interleave them.
__device__ __forceinline__ int list_positives(const uint4 &raw, int col0, uint32_t *list, int base, int cap,
                                              int lane) {
    float v[8];
    bf16x8_to_float(raw, v);
    int mine = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) mine += v[i] > 0.0f;
    const uint32_t holding = __ballot_sync(FULL_MASK, mine != 0);
    const uint32_t lanes_below = (1u << lane) - 1u;
    int total = __popc(holding), slot = base + __popc(holding & lanes_below);
    if (__any_sync(FULL_MASK, mine > 1)) {
        total = 0;
        slot = base;
#pragma unroll
        for (int b = 0; b < 4; ++b) {  // mine <= 8: four bits
            const uint32_t lanes = __ballot_sync(FULL_MASK, (mine >> b) & 1);
            total += __popc(lanes) << b;
            slot += __popc(lanes & lanes_below) << b;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (v[i] > 0.0f) {
            // The values are already bf16, so twell_entry's rounding is the identity here.
            if (slot < cap) list[slot] = twell_entry(v[i], col0 + i);
            ++slot;
        }
    }
    return total;
}

// 16 bytes of a bf16 gate row: this lane's 8 columns of 256-column chunk c (streaming: each row is read once).
__device__ __forceinline__ uint4 gate_piece(const __nv_bfloat16 *__restrict__ row, int c, int lane) {
    return __ldcs(reinterpret_cast<const uint4 *>(row + c * 256 + lane * 8));
}

[[maybe_unused]] constexpr int GATE_BATCH = 8;  // 256-column chunks of a gate row whose loads one warp issues together

// One warp lists the positives of a bf16 gate row of `chunks` * 256 columns as entries (list_positives) in
// ascending column order in `list` (slots >= cap are counted, not stored). Returns the row's positive count
// (same on all lanes). The list is written by all lanes: __syncwarp() before reading another lane's slots.
__device__ __forceinline__ int list_gate_row(const __nv_bfloat16 *__restrict__ row, int chunks, uint32_t *list,
                                             int cap, int lane) {
    int total = 0;
    for (int c0 = 0; c0 < chunks; c0 += GATE_BATCH) {
        uint4 raw[GATE_BATCH];
#pragma unroll
        for (int b = 0; b < GATE_BATCH; ++b) {
            raw[b] = c0 + b < chunks ? gate_piece(row, c0 + b, lane) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < GATE_BATCH; ++b) {
            total += list_positives(raw[b], (c0 + b) * 256 + lane * 8, list, total, cap, lane);
        }
    }
    return total;
}

// A token whose TwELL row has an overflowed segment: its entries are incomplete, so it must take a dense path.
[[maybe_unused]] constexpr int TWELL_ROW_OVERFLOW = 1 << 30;

// One warp lists the entries of a token's TwELL row (`tiles` segments) in `list` in segment order, as list_gate_row
// lists the same positives from the bf16 row (slots >= cap are counted, not stored). Lane l reads the first 8 words
// of segment l of each 32 (one 32-byte sector: the count and, at the paper's sparsity, every entry) and the rest
// only where its count is larger. Returns the token's entry count, or TWELL_ROW_OVERFLOW where a segment overflowed
// (same on all lanes). The list is written by all lanes: __syncwarp() before reading another lane's slots.
__device__ __forceinline__ int list_twell_row(const uint32_t *__restrict__ row, int tiles, uint32_t *list, int cap,
                                              int lane) {
    int total = 0;
    bool overflow = false;
    for (int t0 = 0; t0 < tiles; t0 += 32) {
        const uint32_t *segment = row + (t0 + lane) * TWELL_SLOTS;
        uint4 head[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (t0 + lane < tiles) {
            head[0] = __ldcs(reinterpret_cast<const uint4 *>(segment));
            head[1] = __ldcs(reinterpret_cast<const uint4 *>(segment) + 1);
        }
        const int count = static_cast<int>(head[0].x);
        overflow |= __any_sync(FULL_MASK, count > TWELL_CAPACITY);
        const int kept = min(count, TWELL_CAPACITY);
        const int inclusive = warp_inclusive_sum(kept, lane);
        const uint32_t first[7] = {head[0].y, head[0].z, head[0].w, head[1].x, head[1].y, head[1].z, head[1].w};
        const int base = total + inclusive - kept;
#pragma unroll
        for (int i = 0; i < 7; ++i)
            if (i < kept && base + i < cap) list[base + i] = first[i];
        for (int i = 7; i < kept; ++i)
            if (base + i < cap) list[base + i] = __ldcs(segment + 1 + i);
        total += __shfl_sync(FULL_MASK, inclusive, 31);
    }
    return overflow ? TWELL_ROW_OVERFLOW : total;
}

// One warp writes a token's TwELL row back as the bf16 gate row a dense path reads (zeros where the gate is not
// positive, which a ReLU gate reads alike): every segment but the overflowed ones, whose columns the fused gate GEMM
// wrote there itself (kernels/twell_gate_wgmma.cu). Lane l writes columns 8l .. 8l + 7 of each tile.
__device__ __forceinline__ void twell_row_to_gate(const uint32_t *__restrict__ row, int tiles,
                                                  __nv_bfloat16 *__restrict__ gate_row, int lane) {
    for (int t = 0; t < tiles; ++t) {
        const uint32_t *segment = row + t * TWELL_SLOTS;
        const int count = static_cast<int>(segment[0]);
        if (count > TWELL_CAPACITY) continue;
        uint32_t pairs[4] = {0, 0, 0, 0};  // this lane's 8 columns as bf16 pairs
        for (int i = 0; i < count; ++i) {
            const uint32_t entry = segment[1 + i];
            const int col = twell_col(entry) % TWELL_TILE;  // (the row may be a part of the token's: col_begin > 0)
            const uint32_t bits = col / 8 == lane ? (entry >> 16) << (16 * (col % 2)) : 0u;
#pragma unroll
            for (int q = 0; q < 4; ++q) pairs[q] |= (col % 8) / 2 == q ? bits : 0u;  // constant indices: registers
        }
        reinterpret_cast<uint4 *>(gate_row + t * TWELL_TILE)[lane] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
}

// ---- Warp-row helpers. One warp works on one K-wide bf16 row (a token's x or dy, or a weight row): lane l
// owns the 8 columns v * 256 + 8l .. + 7 of piece v < KV, so K <= 256 * KV; columns >= K are masked (K is a
// multiple of 64, so a lane's 8 columns are either all valid or all masked).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

// Stage an activation row (read once: streaming loads) in shared memory as KV * 32 uint4, piece v of lane l
// at [v * 32 + l] (consecutive lanes, consecutive 16 bytes: no bank conflicts), so registers stay free for
// the weight rows in flight. Thread t of THREADS cooperating threads writes pieces t, t + THREADS, ...
// (piece q holds columns 8q .. 8q + 7); a warp staging its own row passes its lane.
template <int KV, int THREADS = 32>
__device__ __forceinline__ void stage_row(uint4 *smem_row, const __nv_bfloat16 *__restrict__ row, int t, int K) {
#pragma unroll
    for (int i = 0; i < (KV * 32 + THREADS - 1) / THREADS; ++i) {
        const int q = t + i * THREADS;
        if (q < KV * 32) {
            smem_row[q] = q * 8 < K ? __ldcs(reinterpret_cast<const uint4 *>(row + q * 8)) : make_uint4(0, 0, 0, 0);
        }
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

// Eight fp32 values rounded to bf16 (round to nearest even) and packed into 16 bytes.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t *>(&pair);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int KV>
__device__ __forceinline__ void zero_acc(float (&acc)[KV][8]) {
#pragma unroll
    for (int v = 0; v < KV; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[v][j] = 0.0f;
}

// Round this lane's pieces of a K-wide fp32 row (lane l owns columns v * 256 + 8l .. + 7) to bf16 and store
// them; the rows are written once (streaming stores).
template <int KV>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16 *row, const float (&acc)[KV][8], int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col < K) __stcs(reinterpret_cast<uint4 *>(row + col), pack_bf16x8(acc[v]));
    }
}

// Eight fp32 block outputs plus eight bf16 values of the residual stream: the output rounded to bf16 first, as
// the unfused path stores it, then the sum in fp32 (pack_bf16x8 rounds it), as torch adds two bf16 tensors.
__device__ __forceinline__ void add_residual8(float (&v)[8], const uint4 &residual) {
    float r[8];
    bf16x8_to_float(residual, r);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = r[j] + __bfloat162float(__float2bfloat16_rn(v[j]));
}

// ---- The next layer's input RMSNorm, written beside an output row (inference). The kernel that stores a row of the
// residual stream also stores normed = bf16(r * rstd * w): r the row as stored (bf16), rstd = 1 / sqrt(mean(r^2) +
// eps), statistics and products in fp32 with one rounding, as F.rms_norm computes it on a bf16 row and weight. The
// next layer then skips its norm, a pass of its own that reads the row back.

// The sum of squares of eight fp32 values, each rounded to bf16 first (the row as stored).
__device__ __forceinline__ float bf16_squares8(const float (&v)[8]) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float r = bf16_round(v[j]);
        sum = fmaf(r, r, sum);
    }
    return sum;
}

__device__ __forceinline__ float rms_rstd(float sum_squares, int K, float eps) {
    return rsqrtf(sum_squares / static_cast<float>(K) + eps);
}

// Eight columns of the normed row: the row's fp32 values (rounded to bf16 here, as stored) and their 8 weights.
__device__ __forceinline__ uint4 rms_normed8(const float (&v)[8], float rstd, const uint4 &weight_raw) {
    float weight[8], out[8];
    bf16x8_to_float(weight_raw, weight);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = bf16_round(v[j]) * rstd * weight[j];
    return pack_bf16x8(out);
}

// Sum over a block's threads (blockDim.x a multiple of 32), the same value in every thread, added in a fixed order.
// Every thread of the block calls it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    v = warp_sum(v);
    __syncthreads();  // an earlier call's reads are done
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += warp_sums[w];
    return total;
}

// A block's normed row, once its threads have stored the bf16 row in 8-column groups (thread t: groups t,
// t + blockDim.x, ...) and each has summed bf16_squares8 of its groups into `squares`. Every thread of the block calls
// it; each reads back the groups it stored.
__device__ __forceinline__ void store_groups_normed(const __nv_bfloat16 *row, __nv_bfloat16 *normed_row,
                                                    const __nv_bfloat16 *__restrict__ weight, float squares, float eps,
                                                    int K) {
    const float rstd = rms_rstd(block_sum(squares), K, eps);
    for (int c = threadIdx.x; c < K / 8; c += blockDim.x) {
        float stored[8];
        bf16x8_to_float(reinterpret_cast<const uint4 *>(row)[c], stored);
        const uint4 weight_raw = __ldg(reinterpret_cast<const uint4 *>(weight) + c);
        __stcs(reinterpret_cast<uint4 *>(normed_row) + c, rms_normed8(stored, rstd, weight_raw));
    }
}

// A warp's fp32 row as store_row_bf16 stores it (lane l holds columns v * 256 + 8l .. + 7): its normed row.
template <int KV>
__device__ __forceinline__ void store_row_normed(__nv_bfloat16 *normed_row, const float (&acc)[KV][8],
                                                 const __nv_bfloat16 *__restrict__ weight, float eps, int lane, int K) {
    float squares = 0.0f;
#pragma unroll
    for (int v = 0; v < KV; ++v)
        if (v * 256 + lane * 8 < K) squares += bf16_squares8(acc[v]);
    const float rstd = rms_rstd(warp_sum(squares), K, eps);
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col < K) {
            const uint4 weight_raw = __ldg(reinterpret_cast<const uint4 *>(weight + col));
            __stcs(reinterpret_cast<uint4 *>(normed_row + col), rms_normed8(acc[v], rstd, weight_raw));
        }
    }
}

// `part` flags of the kernels that walk a weight block in column parts, one launch per part: FIRST_PART (no earlier
// part: sums start at zero, once-per-call outputs are written) and LAST_PART (no later part: sums are stored in
// bf16 rather than carried in an fp32 row). Both are #defined with the shared constants.

// This lane's pieces of a K-wide fp32 row of running sums (lane l owns columns v * 256 + 8l .. + 7 of piece v),
// carried in memory from one column part of a walk to the next.
template <int KV>
__device__ __forceinline__ void load_partial(float (&acc)[KV][8], const float *row, int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        const float4 lo = col < K ? reinterpret_cast<const float4 *>(row + col)[0] : make_float4(0, 0, 0, 0);
        const float4 hi = col < K ? reinterpret_cast<const float4 *>(row + col)[1] : make_float4(0, 0, 0, 0);
        acc[v][0] = lo.x, acc[v][1] = lo.y, acc[v][2] = lo.z, acc[v][3] = lo.w;
        acc[v][4] = hi.x, acc[v][5] = hi.y, acc[v][6] = hi.z, acc[v][7] = hi.w;
    }
}

template <int KV>
__device__ __forceinline__ void store_partial(float *row, const float (&acc)[KV][8], int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col < K) {
            reinterpret_cast<float4 *>(row + col)[0] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
            reinterpret_cast<float4 *>(row + col)[1] = make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7]);
        }
    }
}

// 16-byte asynchronous copy from global to shared memory (dst: a shared-space address); src_bytes = 0 fills the
// destination with zeros instead of reading src.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// cp_async_16 of a whole 16-byte piece under an L2 cache policy. There is deliberately no zero-filling form: on an
// H100 a cp.async with both a source size and a cache hint faults as an illegal instruction.
__device__ __forceinline__ void cp_async_16_policy(uint32_t dst, const void *src, uint64_t policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(policy));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// ---- Bulk copies: the TMA engine copies a contiguous global range into shared memory and reports the bytes on an
// mbarrier, so a warp can keep rows in flight without holding them in registers. Addresses are shared-space
// (__cvta_generic_to_shared); sizes and addresses are multiples of 16 bytes.

// An mbarrier whose phase completes after `arrivals` arrivals (by default one: the thread that starts each copy) and
// the bytes its copies announced.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals = 1) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes mbarrier_init's writes visible to the copy engine; then a __syncwarp() before other lanes wait.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One thread: the barrier's next phase completes once `bytes` bytes from src have landed at dst.
__device__ __forceinline__ void bulk_copy_to_smem(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar,
                                                  uint64_t policy) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
}

// Waits until the barrier's phase of the given parity (0 for its first phase, then alternating) has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}

#endif  // TWELL_COMMON_CUH
