// Gate GEMM with ReLU and TwELL packing fused into the epilogue (inference), for sm_90a:
//   packed = twell(relu(x w_gate^T)),  x [M, K] bf16, w_gate [N, K] bf16 (nn.Linear layout, K-major)
// The dense gate [M, N] is never written to memory.
//
// A persistent grid of 2-CTA clusters (one CTA per SM) walks pairs of 128 x 256 output tiles (one TwELL tile
// column-range for 128 tokens): the two CTAs of a cluster take the same 256 columns of two token blocks, so each
// loads half of the w_gate tile and the copy engine multicasts it to both, halving the weight bytes read from L2 (at
// this tile shape the GEMM needs ~7 TB/s of L2 reads without it). The 22 column tiles of a token-block pair follow
// one another, so x's blocks are read from L2 by every CTA that needs them. Each CTA has three warpgroups:
//   - the first: one lane of its first warp streams 128 x 64 tiles of x and its 128 x 64 half of the w_gate tile by
//     the bulk tensor copy engine (tensor maps with the 128-byte swizzle that wgmma reads) into a ring of STAGES
//     shared-memory stages, each with a "full" mbarrier (its 48 KiB landed, half of w_gate's from the other CTA) and
//     an "empty" one (the consumers of both CTAs are done with it: the multicast writes into both). Its other three
//     warps pack: they read each finished tile's bf16 rows back from shared memory, list every row's positives in
//     column order and store each row's 128-byte TwELL segment whole;
//   - two consumers, each issuing wgmma m64n256k16 (bf16 in, fp32 accumulate) on 64 of the tile's rows, then
//     rounding them to bf16 into the tile buffer the packers read.
// The consumers' only work between two tiles is that copy: the packing of one tile overlaps the products of the
// next (with the consumers packing, the kernel took 0.599 ms at the paper's block against 0.524, H100).
// A tile with more than 31 positives keeps its true count in word 0 (the consumer routes that row to a dense path).
//
// Requirements (checked by the caller): K % 64 == 0, N % 256 == 0, N <= 65536, 16-byte aligned rows.
// M is arbitrary: the copy engine fills rows past M with zeros, and they are never stored.
#include "twell_common.cuh"

namespace {

constexpr int BM = GATE_BLOCK_M;  // the tile geometry comes from sparse_llm/cuda/kernel_constants.py
constexpr int BN = 256;
constexpr int BK = 64;
constexpr int STAGES = GATE_STAGES;
constexpr int A_BYTES = BM * BK * 2;       // 16 KiB
constexpr int B_BYTES = BN * BK * 2;       // 32 KiB
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
// The finished tile as bf16 rows of BN values; the pitch of 132 words puts the 8 rows a consumer warp writes at
// once (lane / 4) in distinct banks.
constexpr int TILE_PITCH = BN / 2 + 4;  // words
constexpr int TILE_OFFSET = STAGES * STAGE_BYTES;
constexpr int PACKERS = 3;  // warps
constexpr int LISTS_OFFSET = TILE_OFFSET + BM * TILE_PITCH * 4;  // a 32-word segment being built, per packer
constexpr int BARRIERS_OFFSET = LISTS_OFFSET + PACKERS * TWELL_SLOTS * 4;
constexpr int CLUSTER = GATE_CLUSTER;  // CTAs sharing each w_gate tile (multicast)
constexpr int B_PART_ROWS = BN / CLUSTER;  // w_gate rows each CTA of the cluster loads
constexpr int RELEASES = 8 * CLUSTER;  // a stage is free once each consumer warp of both CTAs has read it
// Named barriers between the consumers (256 threads) and the packers (96): the tile buffer is full / free again. Both
// sides wait at both (bar.sync): with the packers only arriving at "free" and the consumers only at "full",
// compute-sanitizer's racecheck reported the tile's reuse as a hazard; waiting costs nothing measurable here, since
// each side reaches the other barrier right after (H100, M = 4096 to 32768).
constexpr int TILE_FULL = 1, TILE_FREE = 2, TILE_PARTIES = 256 + 32 * PACKERS;
// Dynamic shared memory: the stages, the tile buffer, the packers' lists, 2 * STAGES barriers, and slack to align the
// stages to 1024 bytes (the swizzle pattern is a function of the address bits).
[[maybe_unused]] constexpr int SMEM_BYTES = BARRIERS_OFFSET + 2 * STAGES * 8 + 1024;
static_assert(SMEM_BYTES == GATE_SMEM_BYTES, "the launcher reserves GATE_SMEM_BYTES (kernel_constants.py): keep both");
static_assert(BN == TWELL_TILE && 3 * 128 == GATE_THREADS, "a tile of the GEMM is a TwELL tile; three warpgroups");

// A CUtensorMap (the driver's 128-byte opaque tensor map), passed by value as a __grid_constant__ parameter.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// wgmma shared-memory matrix descriptor of a K-major operand tile in the layout the copy engine writes with the
// 128-byte swizzle: rows of 128 bytes, the 16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups 1024 bytes
// apart. The tile base must be 1024-byte aligned.
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

// One thread: the box at (column c0, row r0) of the map's tensor into shared memory at dst; its bytes complete `bar`.
__device__ __forceinline__ void tensor_copy_2d(uint32_t dst, const TensorMap &map, int c0, int r0, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
}

// One thread: as tensor_copy_2d, with the box written at the same offset into the shared memory of every CTA of the
// cluster in cta_mask, each of whose barriers at bar's offset receives the bytes.
__device__ __forceinline__ void tensor_copy_2d_multicast(uint32_t dst, const TensorMap &map, int c0, int r0,
                                                         uint32_t bar, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(r0), "r"(bar), "h"(cta_mask)
        : "memory");
}

// One arrival on the barrier at the shared-space address `bar` in the shared memory of cluster CTA `rank`. No
// cluster-scope release: a release.cluster arrive per k-block made the kernel twice as slow (H100), and the stage's
// readers are wgmma reads that have retired before it.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// Every thread of both CTAs of the cluster: ordinary and barrier writes before it are seen by both CTAs after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

__device__ __forceinline__ void expect_bytes(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A consumer's 64 rows of the tile (accumulators d in wgmma's layout) as bf16 into the tile buffer. Warp w of the
// warpgroup holds rows 16w .. 16w + 15; register 4j + e holds row lane / 4 (+ 8 for e >= 2) and column 8j + 2 (lane %
// 4) + (e & 1), so each register pair is one 4-byte word.
__device__ __forceinline__ void store_tile_rows(const float (&d)[128], uint32_t *tile, int consumer) {
    const int lane = threadIdx.x % 32;
    const int row = consumer * 64 + (threadIdx.x % 128) / 32 * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < 128; i += 2) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(d[i], d[i + 1]);
        tile[(row + ((i % 4) / 2) * 8) * TILE_PITCH + (i / 4) * 4 + lane % 4] =
            *reinterpret_cast<const uint32_t *>(&pair);
    }
}

// One packer warp: the TwELL segments of rows packer, packer + PACKERS, ... of the tile buffer (columns n0 ..
// n0 + 255 of tokens m0 ..), built in `list` (32 words) and stored whole. A row whose segment overflows also goes to
// overflow_gate (when given) as its 256 bf16 values, for the dense path its token takes.
__device__ __forceinline__ void pack_tile(const uint32_t *tile, uint32_t *list, uint32_t *__restrict__ packed,
                                          __nv_bfloat16 *__restrict__ overflow_gate, int packer, int m0, int tile_n,
                                          int tiles_n, int M) {
    const int lane = threadIdx.x % 32;
    for (int r = packer; r < BM && m0 + r < M; r += PACKERS) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(tile + r * TILE_PITCH + lane * 4);
        const int total = list_positives(raw, tile_n * BN + lane * 8, list, 1, TWELL_SLOTS, lane);
        if (lane == 0) list[0] = total;
        __syncwarp();
        packed[(static_cast<long long>(m0 + r) * tiles_n + tile_n) * TWELL_SLOTS + lane] = list[lane];
        if (total > TWELL_CAPACITY && overflow_gate != nullptr)
            reinterpret_cast<uint4 *>(overflow_gate + (static_cast<long long>(m0 + r) * tiles_n + tile_n) * BN)[lane] = raw;
        __syncwarp();  // the list is read before the next row overwrites it
    }
}

}  // namespace

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(GATE_THREADS, 1) twell_gate_wgmma(
    const __grid_constant__ TensorMap x_map,  // x [M, K]: boxes of 64 columns x 128 rows, 128-byte swizzle
    const __grid_constant__ TensorMap w_map,  // w_gate [N, K]: boxes of 64 columns x 128 rows, 128-byte swizzle
    uint32_t *__restrict__ packed,            // [M, (N/256) * 32]
    __nv_bfloat16 *__restrict__ overflow_gate,  // [M, N] or null: the gate rows of overflowed segments
    int M, int N, int K) {
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw_addr = smem_addr(smem_raw);
    const uint32_t pad = (1024 - (raw_addr & 1023)) & 1023;  // the same in both CTAs: one kernel, one layout
    const uint32_t pipe = raw_addr + pad;
    uint32_t *tile = reinterpret_cast<uint32_t *>(smem_raw + pad + TILE_OFFSET);
    const uint32_t full_bars = pipe + BARRIERS_OFFSET, empty_bars = full_bars + STAGES * 8;
    uint32_t rank, cluster, clusters;
    asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    asm("mov.u32 %0, %%clusterid.x;\n" : "=r"(cluster));
    asm("mov.u32 %0, %%nclusterid.x;\n" : "=r"(clusters));

    // Work item p: columns (p % tiles_n) * 256 of token block 2 (p / tiles_n) + rank. A block past M is loaded as
    // zeros (its CTA still multicasts its half of w_gate) and never stored.
    const int tiles_n = N / BN, kblocks = K / BK;
    const int items = (M + CLUSTER * BM - 1) / (CLUSTER * BM) * tiles_n;
    const auto token_block = [&](int item) { return (item / tiles_n * CLUSTER + static_cast<int>(rank)) * BM; };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(full_bars + 8 * s);
            mbarrier_init(empty_bars + 8 * s, RELEASES);
        }
        mbarrier_init_fence();
    }
    cluster_sync();  // both CTAs' barriers are initialised before either copies or arrives

    const int warpgroup = threadIdx.x / 128, warp = threadIdx.x / 32;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (warp == 0) {
            // The whole warp walks the loop (one lane issues), so no lane waits at the final cluster barrier while
            // diverged from the issuing one: the warp would then alternate between the two paths.
            int it = 0;  // k-blocks loaded so far: stage it % STAGES, pass it / STAGES over the ring
            for (int item = cluster; item < items; item += clusters) {
                const int m0 = token_block(item), n0 = item % tiles_n * BN;
                for (int kb = 0; kb < kblocks; ++kb, ++it) {
                    const int s = it % STAGES;
                    // The first pass finds every stage free; later ones wait for both CTAs' consumers.
                    mbarrier_wait(empty_bars + 8 * s, ((it / STAGES) & 1) ^ 1);
                    if (threadIdx.x == 0) {
                        const uint32_t stage = pipe + s * STAGE_BYTES;
                        expect_bytes(full_bars + 8 * s, STAGE_BYTES);
                        tensor_copy_2d(stage, x_map, kb * BK, m0, full_bars + 8 * s);
                        tensor_copy_2d_multicast(stage + A_BYTES + rank * B_PART_ROWS * 128, w_map, kb * BK,
                                                 n0 + rank * B_PART_ROWS, full_bars + 8 * s, (1u << CLUSTER) - 1);
                    }
                    __syncwarp();
                }
            }
        } else {
            uint32_t *list = reinterpret_cast<uint32_t *>(smem_raw + pad + LISTS_OFFSET) + (warp - 1) * TWELL_SLOTS;
            for (int item = cluster; item < items; item += clusters) {
                named_sync(TILE_FREE, TILE_PARTIES);  // the previous tile has been read
                named_sync(TILE_FULL, TILE_PARTIES);
                pack_tile(tile, list, packed, overflow_gate, warp - 1, token_block(item), item % tiles_n, tiles_n, M);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
        const int consumer = warpgroup - 1;
        const bool releases = threadIdx.x % 32 == 0;  // one arrival per warp on a stage's empty barriers
        const auto release = [&](int s) {
            if (releases)
                for (uint32_t r = 0; r < CLUSTER; ++r) mbarrier_arrive_cluster(empty_bars + 8 * s, r);
        };
        int it = 0;  // k-blocks consumed so far, as the producer counts them
        for (int item = cluster; item < items; item += clusters) {
            float d[128];
#pragma unroll
            for (int i = 0; i < 128; ++i) d[i] = 0.0f;  // defined values; the first wgmma ignores them (scale-d 0)
            for (int kb = 0; kb < kblocks; ++kb, ++it) {
                const int s = it % STAGES;
                mbarrier_wait(full_bars + 8 * s, (it / STAGES) & 1);
                const uint32_t a_tile = pipe + s * STAGE_BYTES + consumer * 64 * 128;
                const uint32_t b_tile = pipe + s * STAGE_BYTES + A_BYTES;
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    wgmma_m64n256k16(d, smem_desc(a_tile + kk * 32), smem_desc(b_tile + kk * 32), kb > 0 || kk > 0);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                // The previous k-block's group has retired: its stage goes back to the producers.
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (kb > 0) release((it - 1) % STAGES);
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            release((it - 1) % STAGES);
            named_sync(TILE_FREE, TILE_PARTIES);  // the packers are done with the previous tile
            store_tile_rows(d, tile, consumer);
            named_sync(TILE_FULL, TILE_PARTIES);
        }
    }
    cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
}
