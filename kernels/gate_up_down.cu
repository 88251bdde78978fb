// Up + down projection straight from the gate pre-activation (inference, the "direct" route):
//   for every token m and every column n with gate[m, n] > 0:  u = x[m, :] . w_up[n, :],  h = gate[m, n] * u,
//   y[m, :] += h * w_down_t[n, :]
// where gate = x w_gate^T comes from a cuBLAS GEMM (or as TwELL words from the fused one: PACKED below). Reading the
// bf16 gate row replaces the TwELL packing pass and has no slot capacity, so no token is ever recomputed, and the call
// needs no host synchronisation: the host never learns how many tokens were heavy.
//
//   gate_up_down_light : one warp per token. One pass over the token's gate row (brought into shared memory
//                        by bulk copies) lists its positives as TwELL entries (bf16 value << 16 | column)
//                        in ascending column order in shared memory. A token with more than split_nnz
//                        positives (split_nnz <= DIRECT_LIST_CAP) is appended to heavy_rows for gate_up_down_heavy;
//                        the others are computed entry by entry, as up_down_entry computes one, with the
//                        weight rows also brought by bulk copies.
//                        With PACKED the positives come from the fused gate GEMM's TwELL words instead
//                        (list_twell_row: ~0.7 KiB a token at the paper's sparsity, against 11 KiB of bf16 row), and a
//                        token with an overflowed segment is heavy too; a heavy token's row of heavy_gate (the GEMM's
//                        overflow buffer, which holds its overflowed segments) is completed from the words
//                        (twell_row_to_gate), so the heavy paths read it as they read cuBLAS's gate.
//   gate_up_down_heavy : heavy_warps<KV>() warps per heavy token, so a token with hundreds or thousands of
//                        positives does not hold one warp for the whole tail of the call. Persistent blocks
//                        walk heavy_rows (its length is read on the device); warp w takes the 256-column
//                        chunks w, w + warps, ...; the warps' fp32 partial rows are summed in a fixed
//                        order in shared memory (w + w + warps / 2 first, then the halves' sums in
//                        warp order), so the result is deterministic.
// Every token's y row, l1[m] (sum |h|) and l0[m] (h != 0 count) are written exactly once, by one of the two
// kernels; fired[n] (zeroed by the caller) is set to 1 where h != 0. torch reference: formats.gated_mlp_ref.
// Column parts: a call covers the gate columns [col_begin, col_end). A block whose weight rows outgrow L2 is walked
// in parts, one call each, so that each part's rows stay in L2 while every token passes over them. A part that is
// not FIRST_PART starts from the fp32 running sums the previous part left in `partial` (y, l1 and l0), so a light
// token's sums take the same steps as in one pass; a part that is not LAST_PART leaves its y sums there.
// With a residual (non-null [M, K]), y = residual + the block's output, rounded as the two unfused bf16 steps
// (the decoder layer's residual add, which would otherwise be its own pass over [M, K] three times).
// With norm_weight (non-null [K]) the last part also writes normed [M, K]: the y row's RMSNorm (store_row_normed in
// twell_common.cuh), the next layer's input norm.
#include "up_down_common.cuh"


// Warps sharing one heavy token: 16 (512 threads, 128 registers each) up to K = 2048; wider rows need
// more registers per thread, so 8.
template <int KV>
__host__ __device__ constexpr int heavy_warps() {
    return KV <= 8 ? 16 : 8;
}

// gate_up_down_light's ring: up to K = 2048, two slots and 16 warps per SM (128 registers); wider rows, three slots:
// their 8 KiB slots hold an SM to 6 warps by shared memory, where a third row in flight pays.
template <int KV>
__host__ __device__ constexpr int light_slots() {
    return KV <= 8 ? 2 : 3;
}
template <int KV>
__host__ __device__ constexpr int light_warps_per_sm() {
    return KV <= 8 ? 16 : 6;
}
// Its shared memory: the ring's slots (first: bulk copies land fastest 128-byte aligned) | the x row | the list
// (DIRECT_LIST_CAP entries) | the ring's barriers and the residual's, padded to 128 bytes | with a residual, its row.
// The launcher sizes it as light_smem_bytes (sparse_llm/ffn/twell/infer_launch.py).
template <int KV>
__host__ __device__ constexpr int light_list_offset() {
    return (light_slots<KV>() + 1) * KV * 512;
}
template <int KV>
__host__ __device__ constexpr int light_residual_offset() {
    return light_list_offset<KV>() + DIRECT_LIST_CAP * 4 + 128;
}

// One warp per block (launched with 32 threads). The walk is bound per SM by the latency of its warps' random weight
// rows, so it keeps many warps resident, each with light_slots rows in flight: w_up[n0], w_down_t[n0], w_up[n1], ...
// come by bulk copies into the warp's ring (no registers held while they fly), and a bf16 gate row comes through the
// same ring first. The arithmetic is up_down_entry's, in its order; faster than register loads of both rows, which
// hold registers while the rows fly (docs/kernels.md, measured choices).
template <int KV, bool PACKED>
__global__ void __launch_bounds__(32, light_warps_per_sm<KV>()) gate_up_down_light(
    const void *__restrict__ gate,               // [M, N] bf16 pre-activation x w_gate^T, or (PACKED) its TwELL words
    __nv_bfloat16 *__restrict__ heavy_gate,      // PACKED: [M, N], heavy tokens' rows completed here
    const __nv_bfloat16 *__restrict__ x,         // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of nn.Linear's [K, N])
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (light tokens)
    const __nv_bfloat16 *__restrict__ residual,  // [M, K] added to y, or null
    float *__restrict__ l1,                      // [M] out (light tokens)
    int *__restrict__ l0,                        // [M] out (light tokens)
    int *__restrict__ fired,                     // [N] zeroed; set to 1 where h != 0
    int *__restrict__ heavy_rows,                // [M] out: heavy tokens, first heavy_count[0] valid
    int *__restrict__ heavy_count,               // [1] zeroed
    float *__restrict__ partial,                 // [M, K] fp32 running y sums between parts, or null (one part)
    int M, int K, int N, int split_nnz, int col_begin, int col_end, int part,
    const __nv_bfloat16 *__restrict__ norm_weight,  // [K] the next layer's input norm weight, or null
    __nv_bfloat16 *__restrict__ normed,              // [M, K] out with norm_weight (light tokens)
    float norm_eps) {
    constexpr int SLOTS = light_slots<KV>();
    const int lane = threadIdx.x & 31;
    extern __shared__ __align__(128) uint8_t light_smem[];
    const long long m = blockIdx.x;
    if (m >= M) return;
    uint4 *x_smem = reinterpret_cast<uint4 *>(light_smem + SLOTS * KV * 512);
    uint32_t *list = reinterpret_cast<uint32_t *>(light_smem + light_list_offset<KV>());
    uint64_t *barriers = reinterpret_cast<uint64_t *>(list + DIRECT_LIST_CAP);  // the ring's, then the residual's
    uint4 *residual_row = reinterpret_cast<uint4 *>(light_smem + light_residual_offset<KV>());
    const uint32_t residual_bar = static_cast<uint32_t>(__cvta_generic_to_shared(barriers + SLOTS));
    if (lane == 0) mbarrier_init(residual_bar);  // before the ring's fence, which covers it
    RowRing<KV, SLOTS> ring(reinterpret_cast<uint4 *>(light_smem), barriers, lane);
    __syncwarp();  // the barriers are initialised
    // The part's positives: from its bf16 gate columns (entries' columns counted from col_begin) or from its TwELL
    // segments (entries' columns counted from 0).
    const __nv_bfloat16 *gate_row = static_cast<const __nv_bfloat16 *>(gate) + m * N + col_begin;
    const uint32_t *words = static_cast<const uint32_t *>(gate) + (m * N + col_begin) / TWELL_TILE * TWELL_SLOTS;
    const int tiles = (col_end - col_begin) / TWELL_TILE;
    const int total = PACKED ? list_twell_row(words, tiles, list, DIRECT_LIST_CAP, lane)
                             : list_gate_row_ring<KV, SLOTS>(gate_row, col_end - col_begin, ring, list, DIRECT_LIST_CAP, lane);
    const int col0 = PACKED ? 0 : col_begin;
    if (total > split_nnz) {  // (an overflowed segment's TWELL_ROW_OVERFLOW too)
        if (PACKED) twell_row_to_gate(words, tiles, heavy_gate + m * N + col_begin, lane);
        if (lane == 0) heavy_rows[atomicAdd(heavy_count, 1)] = static_cast<int>(m);
        return;
    }

    // The residual row lands during the walk.
    const bool last = part & LAST_PART;
    if (lane == 0 && last && residual != nullptr) {
        bulk_copy_to_smem(static_cast<uint32_t>(__cvta_generic_to_shared(residual_row)), residual + m * K, K * 2,
                          residual_bar, l2_stream_policy());
    }
    ring.clear_past(K, lane);  // after the gate pieces, which fill whole slots
    stage_row<KV>(x_smem, x + m * K, lane, K);
    __syncwarp();  // the list and x are written by all lanes, read by all lanes
    const uint64_t keep = l2_keep_policy();
    // row r of the walk: w_up[n] of entry r / 2 for even r, its w_down_t[n] for odd r
    const auto fill = [&](int r) {
        const long long n = col0 + twell_col(list[r / 2]);
        ring.fill(r % SLOTS, ((r & 1) ? w_down_t : w_up) + n * K, K * 2, keep);
    };
    if (lane == 0)
        for (int r = 0; r < SLOTS && r < 2 * total; ++r) fill(r);
    float acc[KV][8];
    float l1_sum = 0.0f;
    int l0_sum = 0;
    if (part & FIRST_PART) {
        zero_acc<KV>(acc);
    } else {
        load_partial<KV>(acc, partial + m * K, lane, K);
        l1_sum = l1[m];
        l0_sum = l0[m];
    }
    for (int j = 0; j < total; ++j) {
        uint4 w[KV];
        const int up = 2 * j % SLOTS, down = (2 * j + 1) % SLOTS;
        const uint32_t entry = list[j];
        const long long n = col0 + twell_col(entry);
        const int flag = fired_flag(fired, n, lane);
        ring.wait(up);
        ring.read(up, lane, w);
        const float dot = lane_dot<KV>(x_smem, w, lane);
        __syncwarp();  // every lane has read the slot before it is refilled
        if (lane == 0 && 2 * j + SLOTS < 2 * total) fill(2 * j + SLOTS);
        const float h = twell_value(entry) * warp_sum(dot);
        ring.wait(down);
        ring.read(down, lane, w);
        axpy<KV>(acc, h, w);
        __syncwarp();
        if (lane == 0 && 2 * j + 1 + SLOTS < 2 * total) fill(2 * j + 1 + SLOTS);
        count_h(h, n, flag, l1_sum, l0_sum, fired);
    }
    if (!last) {
        store_partial<KV>(partial + m * K, acc, lane, K);
    } else {
        if (residual != nullptr) {
            mbarrier_wait(residual_bar, 0);
#pragma unroll
            for (int v = 0; v < KV; ++v)
                if (v * 256 + lane * 8 < K) add_residual8(acc[v], residual_row[v * 32 + lane]);  // K columns landed
        }
        store_row_bf16<KV>(y + m * K, acc, lane, K);
        if (norm_weight != nullptr) store_row_normed<KV>(normed + m * K, acc, norm_weight, norm_eps, lane, K);
    }
    __syncwarp();  // every lane has read l1[m] and l0[m] before lane 0 overwrites them
    if (lane == 0) {
        l1[m] = l1_sum;
        l0[m] = l0_sum;
    }
}

// Shared memory: x row (KV * 32 uint4) | partial rows [warps / 2][KV * 256] fp32 | chunk lists
// [warps][256] uint32 | per-warp l1 [warps] fp32 | per-warp l0 [warps] int.
template <int KV>
__global__ void __launch_bounds__(heavy_warps<KV>() * 32, 1) gate_up_down_heavy(
    const __nv_bfloat16 *__restrict__ gate,      // [M, N] pre-activation x w_gate^T
    const __nv_bfloat16 *__restrict__ x,         // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K]
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (heavy tokens)
    const __nv_bfloat16 *__restrict__ residual,  // [M, K] added to y, or null
    float *__restrict__ l1,                      // [M] out (heavy tokens)
    int *__restrict__ l0,                        // [M] out (heavy tokens)
    int *__restrict__ fired,                     // [N] set to 1 where h != 0
    const int *__restrict__ heavy_rows,          // [M] from gate_up_down_light
    const int *__restrict__ heavy_count,         // [1]
    float *__restrict__ partial,                 // [M, K] fp32 running y sums between parts, or null (one part)
    int K, int N, int col_begin, int col_end, int part,
    const __nv_bfloat16 *__restrict__ norm_weight,  // [K] the next layer's input norm weight, or null
    __nv_bfloat16 *__restrict__ normed,              // [M, K] out with norm_weight (heavy tokens)
    float norm_eps) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x / 32;
    extern __shared__ uint4 smem[];
    uint4 *x_smem = smem;
    constexpr int WARPS = heavy_warps<KV>();
    constexpr int HALF = WARPS / 2;
    float *warp_rows = reinterpret_cast<float *>(smem + KV * 32);
    uint32_t *list = reinterpret_cast<uint32_t *>(warp_rows + HALF * KV * 256) + warp * 256;
    float *warp_l1 = reinterpret_cast<float *>(list - warp * 256 + WARPS * 256);
    int *warp_l0 = reinterpret_cast<int *>(warp_l1 + WARPS);
    const int chunks = (col_end - col_begin) / 256;
    const int count = *heavy_count;
    const uint64_t keep = l2_keep_policy();

    for (int i = blockIdx.x; i < count; i += gridDim.x) {
        const long long m = heavy_rows[i];
        const __nv_bfloat16 *row = gate + m * N + col_begin;
        stage_row<KV, WARPS * 32>(x_smem, x + m * K, threadIdx.x, K);
        __syncthreads();  // x staged (and the previous token's partial rows consumed)

        float acc[KV][8];
        zero_acc<KV>(acc);
        float l1_sum = 0.0f;
        int l0_sum = 0;
        for (int c = warp; c < chunks; c += WARPS) {
            const int here = list_positives(gate_piece(row, c, lane), c * 256 + lane * 8, list, 0, 256, lane);
            __syncwarp();
            for (int j = 0; j < here; ++j) {
                const uint32_t entry = list[j];
                up_down_entry<KV>(col_begin + twell_col(entry), twell_value(entry), x_smem, acc, l1_sum, l0_sum,
                                  w_up, w_down_t, fired, lane, K, keep);
            }
            __syncwarp();  // the list is rewritten by the next chunk
        }
        if (lane == 0) {
            warp_l1[warp] = l1_sum;
            warp_l0[warp] = l0_sum;
        }
        // Partial rows in column order (lane l's piece v holds columns v * 256 + 8l .. + 7): the upper half
        // of the warps writes, the lower half adds its own and writes the pair's sum.
        float *mine = warp_rows + (warp % HALF) * KV * 256 + lane * 8;
        if (warp >= HALF) {
#pragma unroll
            for (int v = 0; v < KV; ++v) {
                reinterpret_cast<float4 *>(mine + v * 256)[0] = make_float4(acc[v][0], acc[v][1], acc[v][2], acc[v][3]);
                reinterpret_cast<float4 *>(mine + v * 256)[1] = make_float4(acc[v][4], acc[v][5], acc[v][6], acc[v][7]);
            }
        }
        __syncthreads();
        if (warp < HALF) {
#pragma unroll
            for (int v = 0; v < KV; ++v) {
#pragma unroll
                for (int j = 0; j < 8; ++j) mine[v * 256 + j] += acc[v][j];
            }
        }
        __syncthreads();
        // Sum the pairs in warp order: thread t owns columns 8t .. 8t + 7 of each 256 * WARPS.
        float squares = 0.0f;  // of the stored y row's columns this thread owns, for its norm
        for (int col = threadIdx.x * 8; col < K; col += WARPS * 32 * 8) {
            float sum[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) sum[j] = 0.0f;
            for (int w = 0; w < HALF; ++w) {
#pragma unroll
                for (int j = 0; j < 8; ++j) sum[j] += warp_rows[w * KV * 256 + col + j];
            }
            float *running = partial + m * K + col;  // (only dereferenced when there are several parts)
            if (!(part & FIRST_PART)) {
#pragma unroll
                for (int j = 0; j < 8; ++j) sum[j] += running[j];
            }
            if (part & LAST_PART) {
                if (residual != nullptr) {
                    add_residual8(sum, __ldcs(reinterpret_cast<const uint4 *>(residual + m * K + col)));
                }
                __stcs(reinterpret_cast<uint4 *>(y + m * K + col), pack_bf16x8(sum));
                squares += bf16_squares8(sum);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) running[j] = sum[j];
            }
        }
        if (norm_weight != nullptr && (part & LAST_PART)) {
            store_groups_normed(y + m * K, normed + m * K, norm_weight, squares, norm_eps, K);
        }
        if (threadIdx.x == 0) {
            const bool first = part & FIRST_PART;
            float l1_total = first ? 0.0f : l1[m];
            int l0_total = first ? 0 : l0[m];
            for (int w = 0; w < WARPS; ++w) {
                l1_total += warp_l1[w];
                l0_total += warp_l0[w];
            }
            l1[m] = l1_total;
            l0[m] = l0_total;
        }
        __syncthreads();  // partial rows, per-warp sums and x are reused by the next token
    }
}

// Explicit instantiations so nvcc compile checks see every variant; NVRTC builds one per name expression.
#define GATE_UP_DOWN_LIGHT(KV, PACKED)                                                                          \
    template __global__ void gate_up_down_light<KV, PACKED>(                                                    \
        const void *, __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *,     \
        __nv_bfloat16 *, const __nv_bfloat16 *, float *, int *, int *, int *, int *, float *, int, int, int, int, \
        int, int, int, const __nv_bfloat16 *, __nv_bfloat16 *, float);
#define GATE_UP_DOWN_HEAVY(KV)                                                                                  \
    template __global__ void gate_up_down_heavy<KV>(const __nv_bfloat16 *, const __nv_bfloat16 *,              \
                                                    const __nv_bfloat16 *, const __nv_bfloat16 *,              \
                                                    __nv_bfloat16 *, const __nv_bfloat16 *, float *, int *,    \
                                                    int *, const int *, const int *, float *, int, int, int,   \
                                                    int, int, const __nv_bfloat16 *, __nv_bfloat16 *, float);
GATE_UP_DOWN_LIGHT(1, false)
GATE_UP_DOWN_LIGHT(1, true)
GATE_UP_DOWN_LIGHT(8, false)
GATE_UP_DOWN_LIGHT(8, true)
GATE_UP_DOWN_LIGHT(16, false)
GATE_UP_DOWN_LIGHT(16, true)
GATE_UP_DOWN_HEAVY(1)
GATE_UP_DOWN_HEAVY(8)
GATE_UP_DOWN_HEAVY(16)
