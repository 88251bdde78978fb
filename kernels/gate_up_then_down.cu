// Up, then down, as two kernels (inference, the direct route's "slices" walk, for many tokens):
//   gate_up_entries : one warp per token. As gate_up_down_light (gate_up_down.cu) it lists the positives g of the
//                     token's gate row, but computes only h = g * (x . w_up[n]) and writes each h as a TwELL-style
//                     entry (bf16 h << 16 | column). Entries are token-interleaved by fours: entry j of token m is
//                     at entries[m / 32][j / 4][m % 32][j % 4] (`entry_slot`), so a warp reading entries
//                     j .. j + 3 of 32 consecutive tokens reads 512 contiguous bytes, 16 per lane. A token with
//                     more than split_nnz positives is appended to heavy_rows (its count is -1) for
//                     gate_up_down_heavy, which computes its whole y row. With PACKED the positives come from the
//                     fused gate GEMM's TwELL words (32 bytes a segment at this sparsity, against 512 of bf16 gate);
//                     a token with an overflowed segment is heavy too, and the warp writes its segments back as a
//                     bf16 gate row for the dense paths (the GEMM wrote the overflowed ones).
//   order_tokens    : one block per 1024 tokens places them in "slots" by descending count (heavy tokens last), and
//   entries_to_slots  copies their entries into slot order, so that the 32 tokens a warp of entries_down walks
//                     together have nearly equal counts (a warp takes as many steps as its densest token).
//   entries_down    : y[:, k0 : k0 + KS] = h w_down^T[:, k0 : k0 + KS], one slice of KS output columns at a time:
//                     the slice of w_down_t (N x KS bf16) is staged in shared memory and each thread walks one
//                     slot's entries, reading KS weights per entry from there.
//   ell_to_slots    : the training op's way in (sparse_llm/ffn/twell/train_op.py): the slot-order entries of its ELL rows,
//                     h for y = h w_down^T, or du and dg for dx = du w_up + dg w_gate (entries_down twice, fp32 sums
//                     carried between the two passes).
// Why two kernels: the one-pass walk reads a K-wide w_down row from L2 per non-zero (4 KiB at K = 2048), at the
// L2's rate for random rows; here every SM reads each weight once per slice it holds and the per-non-zero bytes
// come from shared memory. The price: h is rounded to bf16 between the kernels (as the dense bf16 block rounds it),
// and the entries are re-read once per slice (4 bytes per non-zero per KS columns).
// torch reference: formats.gated_mlp_ref.
#include "up_down_common.cuh"


// Where piece q (0 .. PIECES - 1) of row n of entries_down's slice sits, in 16-byte units. Threads of a warp read
// rows at random, and two pieces in the same 16-byte column of the 128-byte bank line conflict. With two pieces
// per row, rows alone would reach only 4 of the 8 columns for piece 0; swapping the pieces of rows with bit 2 set
// spreads each piece over all 8.
template <int PIECES>
__device__ __forceinline__ int slice_piece(int n, int q) {
    static_assert(PIECES == 1 || PIECES == 2, "slices of 8 or 16 columns");
    return PIECES == 1 ? n : 2 * n + (q ^ ((n >> 2) & 1));
}

// gate_up_entries orders each token's entries by the bank column of their piece 0, rotated by the token's position
// (m mod 8): the 32 tokens of a warp then start at different columns, and at each step of entries_down the lanes'
// reads spread over the columns rather than colliding at random.
__device__ __forceinline__ int bank_key(int n, int pieces, long long m) {
    const int column = (pieces == 1 ? slice_piece<1>(n, 0) : slice_piece<2>(n, 0)) & 7;
    return (column - static_cast<int>(m & 7)) & 7;
}

// Reorders a warp's list of `total` <= DIRECT_LIST_CAP entries (in shared memory) by bank_key, stably.
__device__ __forceinline__ void order_by_bank(uint32_t *list, int total, int pieces, long long m, int lane) {
    constexpr int PER_LANE = DIRECT_LIST_CAP / 32;
    uint32_t entry[PER_LANE];
    int key[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int j = i * 32 + lane;
        entry[i] = j < total ? list[j] : 0u;
        key[i] = j < total ? bank_key(twell_col(entry[i]), pieces, m) : 8;
    }
    __syncwarp();  // every entry is read before any is moved
    const unsigned below = (1u << lane) - 1u;
    int base = 0;
    for (int v = 0; v < 8; ++v) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const unsigned mask = __ballot_sync(FULL_MASK, key[i] == v);
            if (key[i] == v) list[base + __popc(mask & below)] = entry[i];
            base += __popc(mask);
        }
    }
    __syncwarp();
}

// Offset of a token's entry j from its first slot (entries[m / 32][0][m % 32][0]).
__device__ __forceinline__ int entry_slot(int j) { return (j / 4) * 128 + j % 4; }

// Shared memory of one gate_up_entries warp: its ring's two slots first (bulk copies land fastest 128-byte aligned),
// then its list, then the ring's barriers.
template <int KV>
__device__ __forceinline__ int up_list_offset() { return 2 * KV * 512; }
template <int KV>
__device__ __forceinline__ int up_barriers_offset() { return up_list_offset<KV>() + DIRECT_LIST_CAP * 4; }

// One warp per block (launched with 32 threads). The walk is bound per SM by its warps' random w_up rows, so it keeps
// as many warps resident as it can, each with two rows in flight. The rows come by bulk copies into the warp's ring
// (no registers held while they fly) and x stays in registers; the gate row comes through the same ring, both pieces
// in flight, before the walk: faster than register loads with x in shared memory, with the same bits (docs/kernels.md,
// measured choices).
template <int KV, bool PACKED>
__global__ void __launch_bounds__(32, KV <= 8 ? 21 : 4) gate_up_entries(
    const void *__restrict__ gate,           // [M, N] bf16 pre-activation x w_gate^T, or (PACKED) its TwELL words
    __nv_bfloat16 *__restrict__ heavy_gate,  // PACKED: [M, N], heavy tokens' rows completed here (twell_row_to_gate)
    const __nv_bfloat16 *__restrict__ x,     // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,  // [N, K]
    uint32_t *__restrict__ entries,          // [ceil(M / 32), DIRECT_LIST_CAP / 4, 32, 4] out
    int *__restrict__ counts,                // [M] out: entries per token; -1 for a heavy token
    float *__restrict__ l1,                  // [M] out (light tokens)
    int *__restrict__ l0,                    // [M] out (light tokens)
    int *__restrict__ fired,                 // [N] zeroed; set to 1 where h != 0
    int *__restrict__ heavy_rows,            // [M] out: heavy tokens, first heavy_count[0] valid
    int *__restrict__ heavy_count,           // [1] zeroed
    int M, int K, int N, int split_nnz, int pieces) {
    const int lane = threadIdx.x & 31;
    extern __shared__ __align__(128) uint8_t up_smem[];
    const long long m = blockIdx.x;
    if (m >= M) return;
    uint32_t *list = reinterpret_cast<uint32_t *>(up_smem + up_list_offset<KV>());
    RowRing<KV, 2> ring(reinterpret_cast<uint4 *>(up_smem),
                        reinterpret_cast<uint64_t *>(up_smem + up_barriers_offset<KV>()), lane);
    __syncwarp();  // the barriers are initialised
    const uint32_t *words = static_cast<const uint32_t *>(gate) + m * (N / TWELL_TILE) * TWELL_SLOTS;
    const int total = PACKED ? list_twell_row(words, N / TWELL_TILE, list, DIRECT_LIST_CAP, lane)
                             : list_gate_row_ring<KV, 2>(static_cast<const __nv_bfloat16 *>(gate) + m * N, N, ring,
                                                         list, DIRECT_LIST_CAP, lane);
    if (total > split_nnz) {
        if (PACKED) twell_row_to_gate(words, N / TWELL_TILE, heavy_gate + m * N, lane);
        if (lane == 0) {
            heavy_rows[atomicAdd(heavy_count, 1)] = static_cast<int>(m);
            counts[m] = -1;
        }
        return;
    }
    ring.clear_past(K, lane);  // after the gate pieces, which fill whole slots
    uint4 x_row[KV];  // this lane's pieces of x (lane l: columns v * 256 + 8l .. + 7), zeros past K
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        x_row[v] = col < K ? __ldcs(reinterpret_cast<const uint4 *>(x + m * K + col)) : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();  // the list is written by all lanes
    order_by_bank(list, total, pieces, m, lane);  // ends with __syncwarp(): the list is read by all lanes
    const uint64_t keep = l2_keep_policy();
    const auto fill = [&](int j) {
        ring.fill(j % 2, w_up + static_cast<long long>(twell_col(list[j])) * K, K * 2, keep);
    };
    if (lane == 0)
        for (int j = 0; j < 2 && j < total; ++j) fill(j);
    uint32_t *out = entries + (m / 32) * (DIRECT_LIST_CAP * 32) + (m % 32) * 4;
    float l1_sum = 0.0f;
    int l0_sum = 0;
    for (int j = 0; j < total; ++j) {
        const uint32_t entry = list[j];
        const int n = twell_col(entry);
        const int flag = fired_flag(fired, n, lane);
        const uint4 *w = ring.wait(j % 2);
        // lane_dot's products w * x are its x * w: h has the bits of the register walk's
        const float dot = lane_dot<KV>(w, x_row, lane);
        __syncwarp();  // every lane has read the slot before it is refilled
        if (lane == 0 && j + 2 < total) fill(j + 2);
        const float h = twell_value(entry) * warp_sum(dot);
        count_h(h, n, flag, l1_sum, l0_sum, fired);
        if (lane == 0) out[entry_slot(j)] = twell_entry(h, n);
    }
    if (lane == 0) {
        counts[m] = total;
        l1[m] = l1_sum;
        l0[m] = l0_sum;
    }
}

constexpr int BANK_CLASSES = 8;    // tokens m and slots s keep m % 8 == s % 8 (bank_key's rotation)
constexpr int COUNT_BINS = DIRECT_LIST_CAP + 2;  // counts DIRECT_LIST_CAP .. 0, then the heavy tokens (count -1)

// The tokens of a group with the same m % 8 trade places among themselves, by descending count: class r's k-th
// token goes to slot group + 8 k + r. A slot's token so has the rotation gate_up_entries ordered its entries for,
// and the 32 slots a warp of entries_down walks hold ranks 4 w .. 4 w + 3 of every class: nearly equal counts.
// Ties go in the arrival order of the block's atomics (a token's y does not depend on its slot: one thread sums its
// entries in their own order).
extern "C" __global__ void __launch_bounds__(ORDER_GROUP) order_tokens(
    const int *__restrict__ counts,  // [M] entries per token: from gate_up_entries (-1: heavy), or ELL counts
    const bool *__restrict__ heavy,  // [M] tokens whose count stands for -1 (the training ELL's heavy flags), or null
    int *__restrict__ token_slots,   // [M] out: the slot of each token
    int *__restrict__ slot_counts,   // [M] out: the count of the token in each slot
    int *__restrict__ slot_tokens,   // [M] out: the token in each slot
    int M) {
    __shared__ int bin_size[BANK_CLASSES][COUNT_BINS];
    __shared__ int bin_start[BANK_CLASSES][COUNT_BINS];
    const long long group = static_cast<long long>(blockIdx.x) * ORDER_GROUP;
    const long long m = group + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int bank_class = threadIdx.x % BANK_CLASSES;
    const int count = m >= M ? 0 : heavy != nullptr && heavy[m] ? -1 : counts[m];
    const int bin = count >= 0 ? DIRECT_LIST_CAP - count : DIRECT_LIST_CAP + 1;
    for (int b = threadIdx.x; b < BANK_CLASSES * COUNT_BINS; b += blockDim.x) (&bin_size[0][0])[b] = 0;
    __syncthreads();
    if (m < M) atomicAdd(&bin_size[bank_class][bin], 1);
    __syncthreads();
    if (warp < BANK_CLASSES) {  // exclusive scan of class `warp`'s bin sizes, PER_LANE consecutive bins a lane
        constexpr int PER_LANE = (COUNT_BINS + 31) / 32;
        const int *size = bin_size[warp];
        int own = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) own += lane * PER_LANE + i < COUNT_BINS ? size[lane * PER_LANE + i] : 0;
        int start = warp_inclusive_sum(own, lane) - own;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int b = lane * PER_LANE + i;
            if (b < COUNT_BINS) {
                bin_start[warp][b] = start;
                start += size[b];
            }
        }
    }
    __syncthreads();
    if (m < M) {
        const int slot = static_cast<int>(group) + BANK_CLASSES * atomicAdd(&bin_start[bank_class][bin], 1) + bank_class;
        token_slots[m] = slot;
        slot_counts[slot] = count;
        slot_tokens[slot] = static_cast<int>(m);
    }
}

// Copies each token's entries to its slot: one thread per 16 bytes (four entries) of the token-order layout, so
// that the reads are contiguous (the writes land 16 bytes at a time, at the slots).
extern "C" __global__ void __launch_bounds__(256) entries_to_slots(
    const uint32_t *__restrict__ entries,  // [ceil(M / 32), DIRECT_LIST_CAP / 4, 32, 4] in token order
    const int *__restrict__ counts,        // [M] entries per token, -1 for a heavy token
    const int *__restrict__ token_slots,   // [M] from order_tokens
    uint32_t *__restrict__ slot_entries,   // [ceil(M / 32), DIRECT_LIST_CAP / 4, 32, 4] out: the same, in slot order
    int M) {
    constexpr int CHUNK_FOURS = DIRECT_LIST_CAP / 4 * 32;  // 16-byte units of a 32-token chunk
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;  // [chunk][four][token % 32]
    const long long m = i / CHUNK_FOURS * 32 + i % 32;
    const int four = static_cast<int>(i / 32 % (DIRECT_LIST_CAP / 4));
    if (m >= M || four * 4 >= counts[m]) return;
    const long long slot = token_slots[m];
    reinterpret_cast<uint4 *>(slot_entries)[slot / 32 * CHUNK_FOURS + four * 32 + slot % 32] =
        reinterpret_cast<const uint4 *>(entries)[i];
}

// The training op's walks through entries_down, from its ELL rows (ascending columns): the light tokens' entries in
// slot order (order_tokens), each token's ordered by bank column as gate_up_entries orders its own. One warp per
// token. PRODUCT (the forward's y = h w_down^T): one entry array of h = bf16(a * b) (a = g, b = u). Otherwise (the
// backward's dx = du w_up + dg w_gate, one pass per weight): two arrays, of a (du) and of b (dg).
template <bool PRODUCT>
__global__ void __launch_bounds__(128) ell_to_slots(
    const int *__restrict__ ell_cols,          // [M, W] entry columns
    const __nv_bfloat16 *__restrict__ ell_a,   // [M, W] g, or du
    const __nv_bfloat16 *__restrict__ ell_b,   // [M, W] u, or dg
    const int *__restrict__ ell_count,         // [M] entries per token (W >= count, W <= DIRECT_LIST_CAP)
    const bool *__restrict__ heavy,            // [M] heavy tokens (no entries here) are skipped
    const int *__restrict__ token_slots,       // [M] from order_tokens
    uint32_t *__restrict__ a_entries,          // [ceil(M / 32), DIRECT_LIST_CAP / 4, 32, 4] out, slot order: h, or du
    uint32_t *__restrict__ b_entries,          // the same for dg; unused with PRODUCT
    int M, int W, int pieces) {
    constexpr int WARPS = 4;  // blockDim.x = 128
    __shared__ uint32_t lists[WARPS][DIRECT_LIST_CAP];  // per warp: (ELL position << 16 | column), then ordered by bank
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const long long m = static_cast<long long>(blockIdx.x) * WARPS + warp;
    if (m >= M || heavy[m]) return;  // whole warp
    const int count = ell_count[m];
    uint32_t *list = lists[warp];
    for (int j = lane; j < count; j += 32) list[j] = static_cast<uint32_t>(j) << 16 | ell_cols[m * W + j];
    __syncwarp();
    order_by_bank(list, count, pieces, m, lane);
    const long long slot = token_slots[m];
    const long long first = (slot / 32) * (DIRECT_LIST_CAP * 32) + (slot % 32) * 4;
    for (int i = lane; i < count; i += 32) {
        const int j = static_cast<int>(list[i] >> 16), n = twell_col(list[i]);
        const float a = __bfloat162float(ell_a[m * W + j]), b = __bfloat162float(ell_b[m * W + j]);
        if constexpr (PRODUCT) {
            a_entries[first + entry_slot(i)] = twell_entry(a * b, n);  // rounds as train_fwd_gate rounds h
        } else {
            a_entries[first + entry_slot(i)] = twell_entry(a, n);
            b_entries[first + entry_slot(i)] = twell_entry(b, n);
        }
    }
}

// Entries a thread requests together before using any (their loads are independent; their uses wait on them).
constexpr int ENTRY_BATCH = 16;

// Persistent blocks, one per SM (the slice takes most of its shared memory). The work items are (slice, 32 slots)
// in slice-major order; block b takes a contiguous range of them, so it stages at most a few slices. Warp w of a
// block takes its range's items w, w + warps, ...; lane l owns slot 32 c + l of item c, whose token's KS outputs it
// writes. Every lane of a warp takes as many steps as the warp's longest count (rounded up to 4): a lane past its own
// count reads the slice's zero row N, which adds exact zeros, so the loop has no branch per entry.
template <int KS, bool SUMS>
__global__ void __launch_bounds__(1024, 1) entries_down(
    const uint32_t *__restrict__ entries,        // [ceil(M / 32), DIRECT_LIST_CAP / 4, 32, 4] in slot order (order_tokens)
    const int *__restrict__ counts,              // [M] per slot; -1: a heavy token, whose y row gate_up_down_heavy writes
    const int *__restrict__ tokens,              // [M] the token in each slot
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of nn.Linear's [K, N])
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (light tokens), unless sums_out is given
    const __nv_bfloat16 *__restrict__ residual,  // [M, K] added to y, or null
    const float *__restrict__ sums_in,           // SUMS only: [M, K] fp32 sums the rows start from, or null
    float *__restrict__ sums_out,                // SUMS only: [M, K] out, the fp32 sums instead of y, or null
    int M, int K, int N,
    int token_base) {  // the slots hold tokens token_base .. + M - 1: y's rows are tokens, the sums' token_base less
    constexpr int PIECES = KS / 8;
    extern __shared__ uint4 slice[];  // (N + 1) rows of PIECES 16-byte pieces, placed by slice_piece
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const long long chunks = (M + 31) / 32;
    const long long items = static_cast<long long>(K / KS) * chunks;
    const long long begin = items * blockIdx.x / gridDim.x;
    const long long end = items * (blockIdx.x + 1) / gridDim.x;
    const uint32_t pad = static_cast<uint32_t>(N);  // value 0 at the zero row
    // Every block re-reads the entries and counts (a few MB) once per slice: keep them in L2, and let the weight
    // slices (read by one or two blocks each, from a w_down_t of up to ~100 MB) go first.
    const uint64_t keep = l2_keep_policy();
    const uint64_t stream = l2_stream_policy();
    const uint32_t *counts_u32 = reinterpret_cast<const uint32_t *>(counts);
    for (long long s = begin / chunks; s * chunks < end; ++s) {
        const int k0 = static_cast<int>(s) * KS;
        __syncthreads();  // every warp is done with the previous slice
        // Asynchronous copies: all of a thread's pieces are in flight at once (one memory latency per slice, where
        // loads through registers waited once per piece, which dominated wide blocks whose w_down is read from HBM).
        for (int p = threadIdx.x; p < N * PIECES; p += blockDim.x) {
            const int n = p / PIECES;
            const int q = p % PIECES;
            cp_async_16_policy(static_cast<uint32_t>(__cvta_generic_to_shared(slice + slice_piece<PIECES>(n, q))),
                               w_down_t + static_cast<long long>(n) * K + k0 + q * 8, stream);
        }
        cp_async_commit();
        if (threadIdx.x < PIECES) slice[slice_piece<PIECES>(N, threadIdx.x)] = make_uint4(0, 0, 0, 0);
        cp_async_wait_all();
        __syncthreads();
        const long long first = max(begin, s * chunks);
        const long long last = min(end, (s + 1) * chunks);
        // This lane's token count in the warp's item `item` (0 past M); the next item's is requested before the
        // current one is walked, so its latency overlaps the walk.
        auto count_of = [&](long long item) {
            const long long t = (item - s * chunks) * 32 + lane;
            return item < last && t < M ? static_cast<int>(load_u32_policy(counts_u32 + t, keep)) : 0;
        };
        int count = count_of(first + warp);
        for (long long item = first + warp; item < last; item += warps) {
            const int next_count = count_of(item + warps);
            const long long c = item - s * chunks;
            const long long t = c * 32 + lane;
            const int steps = __reduce_max_sync(FULL_MASK, count);
            const uint4 *mine = reinterpret_cast<const uint4 *>(entries + c * (DIRECT_LIST_CAP * 32)) + lane;
            const bool writes = t < M && count >= 0;
            // The slot's token (read after the walk unless needed before: registers).
            auto token = [&]() { return static_cast<long long>(tokens[t]); };
            float acc[KS];
#pragma unroll
            for (int i = 0; i < KS; ++i) acc[i] = 0.0f;
            if constexpr (SUMS) {
                if (writes && sums_in != nullptr) {
                    const float *from = sums_in + (token() - token_base) * K + k0;
#pragma unroll
                    for (int i = 0; i < KS; i += 4) {
                        const float4 v = __ldcs(reinterpret_cast<const float4 *>(from + i));
                        acc[i] = v.x, acc[i + 1] = v.y, acc[i + 2] = v.z, acc[i + 3] = v.w;
                    }
                }
            }
            for (int j0 = 0; j0 < steps; j0 += ENTRY_BATCH) {
                // Four entries per 16-byte load; slots at or past the count (unwritten) are replaced by the pad.
                uint32_t batch[ENTRY_BATCH];
#pragma unroll
                for (int r = 0; r < ENTRY_BATCH; r += 4) {
                    const uint4 four = j0 + r < count ? load_keep<0>(mine + (j0 + r) / 4 * 32, keep) : uint4{};
                    const uint32_t words[4] = {four.x, four.y, four.z, four.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) batch[r + i] = j0 + r + i < count ? words[i] : pad;
                }
#pragma unroll
                for (int r = 0; r < ENTRY_BATCH; ++r) {
                    if (r % 4 == 0 && j0 + r >= steps) break;  // the same for the whole warp
                    const float h = twell_value(batch[r]);
                    const int n = twell_col(batch[r]);
#pragma unroll
                    for (int q = 0; q < PIECES; ++q) {
                        float b[8];
                        bf16x8_to_float(slice[slice_piece<PIECES>(n, q)], b);
#pragma unroll
                        for (int i = 0; i < 8; ++i) acc[q * 8 + i] = fmaf(h, b[i], acc[q * 8 + i]);
                    }
                }
            }
            const long long at = writes ? token() * K + k0 : 0;
            if (SUMS && writes && sums_out != nullptr) {
                float *to = sums_out + at - static_cast<long long>(token_base) * K;
#pragma unroll
                for (int i = 0; i < KS; i += 4) {
                    __stcs(reinterpret_cast<float4 *>(to + i),
                           make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
                }
            } else if (writes) {
#pragma unroll
                for (int q = 0; q < PIECES; ++q) {
                    float v[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[i] = acc[q * 8 + i];
                    if (residual != nullptr) {
                        add_residual8(v, __ldcs(reinterpret_cast<const uint4 *>(residual + at + q * 8)));
                    }
                    __stcs(reinterpret_cast<uint4 *>(y + at + q * 8), pack_bf16x8(v));
                }
            }
            count = next_count;
        }
    }
}

// Explicit instantiations so nvcc compile checks see every variant; NVRTC builds one per name expression.
#define GATE_UP_ENTRIES(KV, PACKED)                                                                           \
    template __global__ void gate_up_entries<KV, PACKED>(const void *, __nv_bfloat16 *, const __nv_bfloat16 *,    \
                                                         const __nv_bfloat16 *, uint32_t *, int *, float *, int *, \
                                                         int *, int *, int *, int, int, int, int, int);
GATE_UP_ENTRIES(1, false)
GATE_UP_ENTRIES(8, false)
GATE_UP_ENTRIES(16, false)
GATE_UP_ENTRIES(1, true)
GATE_UP_ENTRIES(8, true)
GATE_UP_ENTRIES(16, true)
#define ENTRIES_DOWN(KS, SUMS)                                                                                 \
    template __global__ void entries_down<KS, SUMS>(const uint32_t *, const int *, const int *,                 \
                                                    const __nv_bfloat16 *, __nv_bfloat16 *, const __nv_bfloat16 *, \
                                                    const float *, float *, int, int, int, int);
ENTRIES_DOWN(8, false)
ENTRIES_DOWN(16, false)
ENTRIES_DOWN(16, true)
#define ELL_TO_SLOTS(PRODUCT)                                                                                    \
    template __global__ void ell_to_slots<PRODUCT>(const int *, const __nv_bfloat16 *, const __nv_bfloat16 *,      \
                                                   const int *, const bool *, const int *, uint32_t *, uint32_t *, \
                                                   int, int, int);
ELL_TO_SLOTS(true)
ELL_TO_SLOTS(false)
