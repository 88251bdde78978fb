// Gate GEMM with ReLU and TwELL packing fused into the epilogue (inference), for sm_90a:
//   packed = twell(relu(x w_gate^T)),  x [M, K] bf16, w_gate [N, K] bf16 (nn.Linear layout, K-major)
// The dense gate [M, N] is never written to memory.
//
// One CTA computes a 128 x 256 output tile (one TwELL tile column-range for 128 tokens) with two consumer
// warpgroups, each issuing wgmma m64n256k16 (bf16 in, fp32 accumulate) on 64 rows. Operand tiles of
// 64 K-elements are staged in shared memory by cp.async in the 128-byte swizzled layout that wgmma reads
// directly, STAGES deep. The epilogue keeps values > 0, claims slots of each row's TwELL segment with
// shared-memory atomics, and writes each row's 32-word segment with one coalesced store. A tile with more
// than 31 positives keeps its true count in word 0 (the consumer routes that row to a dense path).
//
// Requirements (checked by the caller): K % 64 == 0, N % 256 == 0, N <= 65536, 16-byte aligned rows.
// M is arbitrary: rows past M are loaded as zeros and never stored.
#include "twell_common.cuh"

namespace {

constexpr int BM = 128;
constexpr int BN = 256;
constexpr int BK = 64;
constexpr int STAGES = 4;  // dynamic smem = STAGES * 48 KiB + 1 KiB alignment slack (cuda.py)
constexpr int A_BYTES = BM * BK * 2;       // 16 KiB
constexpr int B_BYTES = BN * BK * 2;       // 32 KiB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int ROW_WORDS = TWELL_SLOTS + 4;  // staging row pitch; +4 words staggers banks across rows

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A 128-byte-row tile as wgmma reads it with 128B swizzle: the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8); 8-row groups are 1024 bytes apart. The tile base must be 1024-byte aligned.
__device__ __forceinline__ uint32_t swizzled(uint32_t tile, int row, int chunk) {
    return tile + row * 128 + ((chunk ^ (row & 7)) << 4);
}

// wgmma shared-memory matrix descriptor, K-major operand in the 128B-swizzle layout above.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
    uint64_t desc = (addr & 0x3ffff) >> 4;           // start address
    desc |= static_cast<uint64_t>(1) << 16;           // leading byte offset (unused with this swizzle)
    desc |= static_cast<uint64_t>(1024 >> 4) << 32;   // stride byte offset: next 8-row group
    desc |= static_cast<uint64_t>(1) << 62;           // swizzle mode: 128 bytes
    return desc;
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
          : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Copy k-block kb of the A (x) and B (w_gate) tiles into one pipeline stage.
__device__ __forceinline__ void load_stage(uint32_t stage, const __nv_bfloat16 *x, const __nv_bfloat16 *w,
                                           int M, int K, int m0, int n0, int kb) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < (BM * 8) / 256; ++i) {
        const int c = tid + i * 256;
        const int row = c >> 3, chunk = c & 7;
        const bool in_range = m0 + row < M;
        const __nv_bfloat16 *src = x + static_cast<long long>(in_range ? m0 + row : 0) * K + kb * BK + chunk * 8;
        cp_async_16(swizzled(stage, row, chunk), src, in_range ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < (BN * 8) / 256; ++i) {
        const int c = tid + i * 256;
        const int row = c >> 3, chunk = c & 7;
        const __nv_bfloat16 *src = w + static_cast<long long>(n0 + row) * K + kb * BK + chunk * 8;
        cp_async_16(swizzled(stage + A_BYTES, row, chunk), src, 16);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256, 1) twell_gate_wgmma(
    const __nv_bfloat16 *__restrict__ x,       // [M, K]
    const __nv_bfloat16 *__restrict__ w_gate,  // [N, K]
    uint32_t *__restrict__ packed,             // [M, (N/256) * 32]
    int M, int N, int K) {
    extern __shared__ uint8_t smem_raw[];
    // Align the pipeline to 1024 bytes (the swizzle pattern is a function of the address bits).
    const uint32_t raw_addr = smem_addr(smem_raw);
    const uint32_t pad = (1024 - (raw_addr & 1023)) & 1023;
    const uint32_t pipe = raw_addr + pad;

    const int tile_n = blockIdx.x;
    const int m0 = blockIdx.y * BM;
    const int n0 = tile_n * BN;
    const int kblocks = K / BK;
    const int warpgroup = threadIdx.x / 128;

    // Pipeline: k-block kb+2 is loaded while wgmma works on kb and kb-1 may still be in flight, so the
    // tensor cores are not idle across the barrier. Slot (kb+2) % 4 was last read by wgmma(kb-2), which
    // every warpgroup retired (wait_group 1 after issuing kb-1) before the barrier of iteration kb.
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < kblocks) load_stage(pipe + s * STAGE_BYTES, x, w_gate, M, K, m0, n0, s);
        cp_async_commit();
    }

    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;

    for (int kb = 0; kb < kblocks; ++kb) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 3));
        // cp.async writes are generic-proxy; wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();  // k-block kb is in shared memory for all threads; wgmma(kb-2) has retired everywhere
        const int next = kb + STAGES - 2;
        if (next < kblocks) load_stage(pipe + (next % STAGES) * STAGE_BYTES, x, w_gate, M, K, m0, n0, next);
        cp_async_commit();

        const uint32_t a_tile = pipe + (kb % STAGES) * STAGE_BYTES + warpgroup * 64 * 128;
        const uint32_t b_tile = pipe + (kb % STAGES) * STAGE_BYTES + A_BYTES;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
            wgmma_m64n256k16(d, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), 1);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    cp_async_wait_all();
    __syncthreads();  // the pipeline's shared memory is reused for the packing below

    uint32_t *stage_rows = reinterpret_cast<uint32_t *>(smem_raw + pad);  // [BM][ROW_WORDS]
    if (threadIdx.x < BM) stage_rows[threadIdx.x * ROW_WORDS] = 0;
    __syncthreads();

    // wgmma accumulator layout: warp w of a warpgroup holds rows 16w..16w+15; register 4j+e holds row
    // lane/4 (+8 for e >= 2) and column 8j + 2*(lane%4) + (e & 1).
    const int lane = threadIdx.x & 31;
    const int row_a = warpgroup * 64 + ((threadIdx.x / 32) & 3) * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float value = d[4 * j + e];
            if (value > 0.0f) {
                const int row = row_a + (e >= 2 ? 8 : 0);
                const int col = n0 + 8 * j + 2 * (lane & 3) + (e & 1);
                const int slot = atomicAdd(&stage_rows[row * ROW_WORDS], 1u) + 1;
                if (slot <= TWELL_CAPACITY) stage_rows[row * ROW_WORDS + slot] = twell_entry(value, col);
            }
        }
    }
    __syncthreads();

    const int tiles = N / TWELL_TILE;
    const int warp = threadIdx.x / 32;
#pragma unroll 4
    for (int r = warp * 16; r < warp * 16 + 16; ++r) {
        if (m0 + r < M)
            packed[(static_cast<long long>(m0 + r) * tiles + tile_n) * TWELL_SLOTS + lane] =
                stage_rows[r * ROW_WORDS + lane];
    }
}
