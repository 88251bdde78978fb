// Training backward of the gated FFN on the hybrid format, light (ELL) tokens only; the dense backup rows
// go through cuBLAS in sparse_llm/ffn/twell/train_op.py. Tested on an H100 (tests/gpu/test_twell_train.py).
//
//   train_bwd_sddmm : per light token, at its ELL entries (n, g, u):
//                       dh = bf16(bf16(dy[m] . w_down[:, n]) + dl1 * sign(h)),  h = bf16(g * u)
//                       du = bf16(dh * g),  dg = bf16(dh * u)
//                     stored at the entries (h too, for dW_down), and the sort keys of the transposed view
//                     (int16 where N fits, so the radix sort makes two passes over them rather than four).
//   train_bwd_dx    : per light token, dx[m] = sum over its entries of du * w_up[n] + dg * w_gate[n],
//                     summed in one fp32 accumulator before rounding.
//                     Both walk the entries of the columns [col_begin, col_end) only (entries_in): a block whose
//                     rows outgrow L2 is walked in column parts, one launch each; dx's fp32 sums are carried
//                     from part to part in `partial` (the one-pass steps, so the same bits), sddmm writes the
//                     sort keys in its first part.
//                     torch reference of both: formats.hybrid_gated_mlp_backward_ref (hybrid_sddmm, the L1
//                     shift, hybrid_mul, hybrid_matmul). Two kernels rather than one so that each streams
//                     only the weight rows it needs: w_down (N x K) then w_up and w_gate (2 x N x K), working
//                     sets that stay in L2 where all three together (69 MB at K = 2048, N = 5632) do not.
//   train_csc_columns, train_csc_chunks : column starts, chunk starts and the chunks' columns of the
//                     transposed view from the sorted keys sddmm wrote.
//   train_csc_wgrad : weight gradients out[n] = sum over the entries e of column n of value(e) * src[row(e)]
//                     (with `add`: out[n] += that sum, a gradient accumulated over micro-batches in place),
//                     e.g. dW_gate = dg^T x, dW_up = du^T x (NV = 2, one gather of x for both) and
//                     dW_down^T = h^T dy (NV = 1). torch reference: formats.hybrid_t_matmul.
//   train_backup_grads : the heavy (backup) tokens' pointwise step between their cuBLAS GEMMs, all of it in
//                     one pass over their [R, N] rows (one launch where torch needs about a dozen):
//                       g = relu(x w_gate^T), u = x w_up^T on g's support, h = bf16(g * u),
//                       dh = bf16((dy w_down)_g's support + dl1 * sign(h)), du = bf16(dh * g), dg = bf16(dh * u).
//                     torch reference: the backup branch of formats.hybrid_gated_mlp_backward_ref.
#include "train_common.cuh"

template <int KV, typename Key>
__global__ void __launch_bounds__(128, 4) train_bwd_sddmm(
    const __nv_bfloat16 *__restrict__ dy,        // [M, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of down_proj.weight [K, N])
    const int *__restrict__ ell_cols,            // [M, W]
    const __nv_bfloat16 *__restrict__ ell_g,     // [M, W]
    const __nv_bfloat16 *__restrict__ ell_u,     // [M, W]
    const int *__restrict__ ell_count,           // [M]
    const bool *__restrict__ heavy,              // [M] heavy tokens are skipped
    const float *__restrict__ dl1,               // [1] gradient of the loss w.r.t. sum |h|
    __nv_bfloat16 *__restrict__ ell_h,           // [M, W] out
    __nv_bfloat16 *__restrict__ ell_du,          // [M, W] out
    __nv_bfloat16 *__restrict__ ell_dg,          // [M, W] out
    Key *__restrict__ csc_key,                   // [M, W] out: column of a light token's entry, else N
    int M, int N, int K, int W, int col_begin, int col_end, int part) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (m >= M) return;  // whole warp
    // Sort keys of the transposed (CSC) view for the weight gradients: unused slots and heavy tokens sort last.
    const int used = heavy[m] ? 0 : ell_count[m];
    if (part & FIRST_PART) {
        for (int s = lane; s < W; s += 32) csc_key[m * W + s] = static_cast<Key>(s < used ? ell_cols[m * W + s] : N);
    }
    if (heavy[m]) return;  // whole warp
    extern __shared__ uint4 smem[];
    uint4 *dy_row = smem + (threadIdx.x / 32) * KV * 32;
    stage_row<KV>(dy_row, dy + m * K, lane, K);
    __syncwarp();
    const float l1_grad = *dl1;
    const long long row0 = m * W;
    float my_g = 0.0f, my_u = 0.0f, my_h = 0.0f, my_du = 0.0f, my_dg = 0.0f;
    const __nv_bfloat16 *const down[1] = {w_down_t};
    auto begin = [&](int base, int here) {
        const bool has = lane < here;
        my_g = has ? bf16_load(ell_g + row0 + base + lane) : 0.0f;
        my_u = has ? bf16_load(ell_u + row0 + base + lane) : 0.0f;
    };
    auto step = [&](int j, long long, const uint4 (&rows)[1][KV]) {
        const float g = __shfl_sync(FULL_MASK, my_g, j);
        const float u = __shfl_sync(FULL_MASK, my_u, j);
        const float d = bf16_round(warp_sum(lane_dot<KV>(dy_row, rows[0], lane)));
        const float h = bf16_round(g * u);
        const float sign = h > 0.0f ? 1.0f : (h < 0.0f ? -1.0f : 0.0f);  // d|h|/dh, 0 at 0 like autograd
        const float dh = bf16_round(d + l1_grad * sign);
        if (lane == j) {
            my_h = h;
            my_du = bf16_round(dh * g);
            my_dg = bf16_round(dh * u);
        }
    };
    auto finish = [&](int base, int here) {
        if (lane < here) {
            const long long at = row0 + base + lane;
            ell_h[at] = __float2bfloat16_rn(my_h);
            ell_du[at] = __float2bfloat16_rn(my_du);
            ell_dg[at] = __float2bfloat16_rn(my_dg);
        }
    };
    const EntryRange range = entries_in(EllColumn{ell_cols + row0}, used, col_begin, col_end, N, lane);
    walk_entries<KV, 1>(EllColumn{ell_cols + row0}, range.first, range.end, down, lane, K, begin, step, finish);
}

// Column starts of the transposed view from the E sort keys in ascending order (a column per light entry, N
// for the rest): col_start[c] = the first e with key[e] >= c, for c = 0..N. Every e in [0, E] owns the
// columns between the key before it and its own key, so each start is written once, by one thread, with no
// search. torch reference: the searchsorted of csc_order in sparse_llm/ffn/twell/train_op.py.
template <typename Key>
__global__ void __launch_bounds__(256) train_csc_columns(
    const Key *__restrict__ sorted_key,    // [E] ascending, values in [0, N]
    long long *__restrict__ col_start,     // [N + 1] out
    long long E, int N) {
    for (long long e = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; e <= E;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int lo = e == 0 ? 0 : sorted_key[e - 1] + 1;
        const int hi = e == E ? N : min(sorted_key[e], N);
        for (int c = lo; c <= hi; ++c) col_start[c] = e;
    }
}

// Work chunks of a column with `entries` entries: one for a column of up to `whole` entries (so that every
// column's rows of the weight gradients are written by some item; an empty column's item writes zeros), else
// chunks of `chunk` entries, which spread a hot neuron over many warps and keep the longest item short.
__device__ __forceinline__ long long column_chunks(long long entries, int chunk, int whole) {
    return entries > whole ? (entries + chunk - 1) / chunk : 1;
}

// Work chunks of the transposed view, in one block: chunk_start = the exclusive prefix sum over columns of
// column_chunks(entries, ...) (chunk_start[N] = the number of chunks), chunk_col[j] = the column of chunk j, so
// the weight-gradient kernel finds an item's column with one load, and shared_rank[n] = how many columns before n
// have more than one chunk (it picks a many-chunk column's scratch slot). Each thread takes a run of consecutive
// columns; the block scans the runs' totals, both counts in one 64-bit value (chunks in the low RANK_SHIFT bits).
// Launch with 1024 threads. torch reference: csc_chunk_starts, csc_chunk_columns and csc_shared_ranks in
// sparse_llm/ffn/twell/train_op.py.
constexpr int RANK_SHIFT = 40;

__device__ __forceinline__ long long chunks_and_rank(long long chunks) {
    return chunks + (chunks > 1 ? 1LL << RANK_SHIFT : 0);
}

extern "C" __global__ void __launch_bounds__(1024, 1) train_csc_chunks(
    const long long *__restrict__ col_start,  // [N + 1] from train_csc_columns
    long long *__restrict__ chunk_start,      // [N + 1] out
    int *__restrict__ chunk_col,              // [>= chunk_start[N]] out
    int *__restrict__ shared_rank,            // [N] out
    int N, int chunk, int whole_floor, int whole_per_mean) {
    __shared__ long long warp_total[32];
    const int t = threadIdx.x, lane = t & 31, warp = t / 32;
    const long long low = (1LL << RANK_SHIFT) - 1;
    // A column is one item up to whole_per_mean times the mean column (at least whole_floor entries): dense layers'
    // typical columns are stored without atomics, and no item is much longer than the typical one.
    const long long mean_bound = whole_per_mean * col_start[N] / max(N, 1);
    const int whole = static_cast<int>(max(static_cast<long long>(whole_floor), min(mean_bound, 1LL << 30)));
    const int per = (N + blockDim.x - 1) / blockDim.x;
    const int c0 = min(N, t * per), c1 = min(N, c0 + per);
    long long mine = 0;
    for (int c = c0; c < c1; ++c) mine += chunks_and_rank(column_chunks(col_start[c + 1] - col_start[c], chunk, whole));
    // Block-wide exclusive scan of `mine`: within warps by shuffles, then over the warp totals.
    const long long inclusive = warp_inclusive_sum(mine, lane);
    if (lane == 31) warp_total[warp] = inclusive;
    __syncthreads();
    if (warp == 0) warp_total[lane] = warp_inclusive_sum(lane < blockDim.x / 32 ? warp_total[lane] : 0LL, lane);
    __syncthreads();
    long long before = inclusive - mine + (warp > 0 ? warp_total[warp - 1] : 0);
    for (int c = c0; c < c1; ++c) {
        const long long chunks = before & low;
        chunk_start[c] = chunks;
        shared_rank[c] = static_cast<int>(before >> RANK_SHIFT);
        const long long here = column_chunks(col_start[c + 1] - col_start[c], chunk, whole);
        for (long long j = 0; j < here; ++j) chunk_col[chunks + j] = c;
        before += chunks_and_rank(here);
    }
    if (t == 0) chunk_start[N] = warp_total[blockDim.x / 32 - 1] & low;
}


template <int KV>
__global__ void __launch_bounds__(128, KV <= 8 ? 3 : 1) train_bwd_dx(
    const __nv_bfloat16 *__restrict__ w_gate,  // [N, K]
    const __nv_bfloat16 *__restrict__ w_up,    // [N, K]
    const int *__restrict__ ell_cols,          // [M, W]
    const __nv_bfloat16 *__restrict__ ell_du,  // [M, W]
    const __nv_bfloat16 *__restrict__ ell_dg,  // [M, W]
    const int *__restrict__ ell_count,         // [M]
    const bool *__restrict__ heavy,            // [M] heavy tokens are skipped
    __nv_bfloat16 *__restrict__ dx,            // [M, K] out (light rows)
    float *__restrict__ partial,               // [M, K] fp32 running dx sums between column parts, or null (one part)
    int M, int N, int K, int W, int col_begin, int col_end, int part) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (m >= M || heavy[m]) return;  // whole warp
    const long long row0 = m * W;
    float acc[KV][8];
    if (part & FIRST_PART) {
        zero_acc<KV>(acc);
    } else {
        load_partial<KV>(acc, partial + m * K, lane, K);
    }
    float my_du = 0.0f, my_dg = 0.0f;
    // Up to K = 2048 an entry's two weight rows are requested together; wider rows load w_gate[n] after
    // the w_up axpy, to stay within the register file.
    constexpr int R = KV <= 8 ? 2 : 1;
    const __nv_bfloat16 *mats[R];
    mats[0] = w_up;
    if constexpr (R == 2) mats[1] = w_gate;
    const uint64_t keep = l2_keep_policy();
    auto begin = [&](int base, int here) {
        const bool has = lane < here;
        my_du = has ? bf16_load(ell_du + row0 + base + lane) : 0.0f;
        my_dg = has ? bf16_load(ell_dg + row0 + base + lane) : 0.0f;
    };
    auto step = [&](int j, long long n, const uint4 (&rows)[R][KV]) {
        axpy<KV>(acc, __shfl_sync(FULL_MASK, my_du, j), rows[0]);
        const float dg = __shfl_sync(FULL_MASK, my_dg, j);
        if constexpr (R == 2) {
            axpy<KV>(acc, dg, rows[1]);
        } else {
            uint4 gate[KV];
            load_weight_row<KV>(gate, w_gate + n * K, lane, K, keep);
            axpy<KV>(acc, dg, gate);
        }
    };
    auto finish = [](int, int) {};
    const EntryRange range = entries_in(EllColumn{ell_cols + row0}, ell_count[m], col_begin, col_end, N, lane);
    walk_entries<KV, R>(EllColumn{ell_cols + row0}, range.first, range.end, mats, lane, K, begin, step, finish);
    if (part & LAST_PART) {
        store_row_bf16<KV>(dx + m * K, acc, lane, K);
    } else {
        store_partial<KV>(partial + m * K, acc, lane, K);
    }
}

// Eight fp32 sums stored as `Out` at p (fp32, or bf16 rounded once), or with `add` added to the eight values p holds
// (a gradient accumulated over micro-batches in place).
__device__ __forceinline__ void store8(float *p, const float (&v)[8], bool add) {
    float4 *const p4 = reinterpret_cast<float4 *>(p);
    float4 lo = make_float4(v[0], v[1], v[2], v[3]), hi = make_float4(v[4], v[5], v[6], v[7]);
    if (add) {
        const float4 a = p4[0], b = p4[1];
        lo = make_float4(lo.x + a.x, lo.y + a.y, lo.z + a.z, lo.w + a.w);
        hi = make_float4(hi.x + b.x, hi.y + b.y, hi.z + b.z, hi.w + b.w);
    }
    p4[0] = lo;
    p4[1] = hi;
}
__device__ __forceinline__ void store8(__nv_bfloat16 *p, const float (&v)[8], bool add) {
    uint4 *const p8 = reinterpret_cast<uint4 *>(p);
    if (!add) {
        *p8 = pack_bf16x8(v);
        return;
    }
    float sum[8];
    bf16x8_to_float(*p8, sum);
#pragma unroll
    for (int j = 0; j < 8; ++j) sum[j] += v[j];
    *p8 = pack_bf16x8(sum);
}

// Slot protocol of train_csc_wgrad's many-chunk columns (counters = [next item, slot_gen[slots],
// slot_done[slots]]). Out of line: the rare path keeps its registers out of the gather loop's budget.
// Waits until the slot of the column of this rank is its turn (slot_gen == rank / slots).
__device__ __noinline__ void await_slot(unsigned long long *counters, int rank, int slots, int lane) {
    if (lane == 0) {
        volatile unsigned long long *const gen = counters + 1 + rank % slots;
        const auto turn = static_cast<unsigned long long>(rank / slots);
        while (*gen != turn) __nanosleep(128);
        __threadfence();
    }
    __syncwarp();
}

// After an item's additions to its slot rows: counts the item done; the column's last item (of `items`) stores
// the rows' sums to out[row_offset ...] as Out (adds them with `add`), zeroes the rows and hands the slot to its
// next column.
template <int NV, typename Out>
__device__ __noinline__ void finish_slot(unsigned long long *counters, int rank, int slots, long long items,
                                         float *slot_rows, Out *out0, Out *out1, long long row_offset, int K, bool add,
                                         int lane) {
    unsigned long long *const gen = counters + 1 + rank % slots, *const done = gen + slots;
    __threadfence();  // this lane's additions land before the item counts itself done
    __syncwarp();
    unsigned long long finished = 0;
    if (lane == 0) finished = atomicAdd(done, 1ULL) + 1;
    if (__shfl_sync(FULL_MASK, finished, 0) != static_cast<unsigned long long>(items)) return;
    __threadfence();  // every item's additions have landed: read them past L1
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        float *const sums = slot_rows + i * K;
        Out *const dst = (i == 0 ? out0 : out1) + row_offset;
        for (int col = lane * 8; col < K; col += 256) {
            const float4 lo = __ldcg(reinterpret_cast<const float4 *>(sums + col));
            const float4 hi = __ldcg(reinterpret_cast<const float4 *>(sums + col + 4));
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            store8(dst + col, v, add);
            __stcg(reinterpret_cast<float4 *>(sums + col), make_float4(0.0f, 0.0f, 0.0f, 0.0f));
            __stcg(reinterpret_cast<float4 *>(sums + col + 4), make_float4(0.0f, 0.0f, 0.0f, 0.0f));
        }
    }
    __threadfence();  // the zeroed rows land before the slot is handed on
    __syncwarp();
    if (lane == 0) {
        *done = 0;
        __threadfence();
        atomicAdd(gen, 1ULL);
    }
}

// Column-major (CSC) walk of the ELL entries: `order` lists the positions m * W + s of all light entries
// sorted by column (stable, so rows ascend within a column), col_start[n] .. col_start[n+1] are column n's.
// A column of more entries than train_csc_chunks' `whole` is cut into chunks of `chunk` entries, so a hot neuron
// (firing for most tokens) is spread over many warps and no item runs long enough to stretch the kernel's tail;
// a shorter column is one chunk. chunk_start[n] is the first chunk of column n, chunk_start[N] the total, read
// on the device (the host never learns it), and chunk_col[c] the column of chunk c; every column has at least one
// chunk.
// K is cut into `parts` slices of KW * 256 columns, so a warp holds KW pieces per row and its accumulators
// (NV * KW * 8 floats per lane) stay in registers at any K. A work item is a (chunk, slice) pair; warps take
// items from the counter counters[0] (zeroed by the caller), so the grid can be sized to the GPU without
// knowing the occupancy, and a slow column does not hold up a fixed share of the work. The two slices of a
// chunk are consecutive items, so the second gather of a src row usually hits L2. Each item accumulates in
// fp32 registers. The item of a single-chunk column (most columns, and every empty one, whose item writes
// zeros) stores its sums as `Out`. The items of a many-chunk column add theirs with fp32 vector atomics to a
// row of `scratch`, and the last of them stores that row as `Out` and zeroes it: bf16 outputs need no fp32 copy
// of the gradients (3 x N x K x 4 bytes), and every sum is rounded once. With `add` every such store adds to the
// row instead, and an empty column's item skips its row: a gradient held over a step's micro-batches is read and
// written once per micro-batch, where a separate gradient buffer added into it costs three passes.
// The scratch has `slots` rows per value array: the many-chunk column of rank r (shared_rank) takes slot
// r % slots once the column of rank r - slots has released it (slot_gen[slot] == r / slots). That column's items
// were all claimed before any of this column's (items are claimed in column order) and wait only on still
// earlier columns, so the wait always ends; with more slots than many-chunk columns in flight it never starts.
// The order of the atomic additions (not their set) varies run to run.
constexpr int WGRAD_AHEAD = 2;  // entries between a row's request and its use in train_csc_wgrad

template <int KW, int NV, typename Out>
__global__ void __launch_bounds__(128, NV == 1 ? 4 : 3) train_csc_wgrad(
    const long long *__restrict__ order,        // [M * W] entry positions sorted by column
    const long long *__restrict__ col_start,    // [N + 1]
    const long long *__restrict__ chunk_start,  // [N + 1]
    const int *__restrict__ chunk_col,          // [chunk_start[N]] column of each chunk
    const int *__restrict__ shared_rank,        // [N] rank of each many-chunk column among them
    const __nv_bfloat16 *__restrict__ value0,   // [M, W] values at the entries
    const __nv_bfloat16 *__restrict__ value1,   // [M, W] (NV == 2) second value array
    const __nv_bfloat16 *__restrict__ src,      // [M, K] rows gathered per entry (x or dy)
    Out *__restrict__ out0,                     // [N, K] every row written (add: every row added to)
    Out *__restrict__ out1,                     // [N, K] likewise (NV == 2)
    float *__restrict__ scratch,                // [slots * NV, K] zeroed; left zeroed
    unsigned long long *__restrict__ counters,  // [1 + 2 * slots] zeroed: next item, slot_gen, slot_done
    int N, int K, int W, int chunk, int parts, int slots, int add) {
    const int lane = threadIdx.x & 31;
    const long long total = chunk_start[N] * parts;
    for (;;) {
        unsigned long long claimed = 0;
        if (lane == 0) claimed = atomicAdd(counters, 1ULL);  // counters[0]: the next item
        const long long item = static_cast<long long>(__shfl_sync(FULL_MASK, claimed, 0));
        if (item >= total) break;
        const long long c = item / parts;
        const int col0 = static_cast<int>(item - c * parts) * KW * 256 + lane * 8;  // this lane's first column
        const int n = chunk_col[c];
        const bool alone = chunk_start[n + 1] - chunk_start[n] == 1;  // this item owns the column's row
        const long long e0 = col_start[n] + (c - chunk_start[n]) * chunk;
        // entries of this item, counted from e0 (a whole column is at most 2^30 entries: train_csc_chunks)
        const int length = static_cast<int>((alone ? col_start[n + 1] : min(e0 + chunk, col_start[n + 1])) - e0);

        // This lane's KW pieces of src row `token` (zeros past K). Rows are requested WGRAD_AHEAD entries before
        // they are accumulated, so WGRAD_AHEAD + 1 gathers are in flight per warp: the kernel is bound by how many
        // gathers are in flight, and registers allow three rows per warp at the residency the bounds ask for.
        auto load = [&](uint4 (&dst)[KW], int token) {
            const __nv_bfloat16 *const row = src + static_cast<long long>(token) * K;
#pragma unroll
            for (int v = 0; v < KW; ++v) {
                const int col = col0 + v * 256;
                dst[v] = col < K ? *reinterpret_cast<const uint4 *>(row + col) : make_uint4(0, 0, 0, 0);
            }
        };
        float acc[NV][KW][8];
#pragma unroll
        for (int i = 0; i < NV; ++i) zero_acc<KW>(acc[i]);
        for (int base = 0; base < length; base += 32) {
            const bool mine = base + lane < length;
            const long long my_pos = mine ? order[e0 + base + lane] : 0;
            const float my_v0 = mine ? bf16_load(value0 + my_pos) : 0.0f;
            const float my_v1 = (NV == 2 && mine) ? bf16_load(value1 + my_pos) : 0.0f;
            // Each lane divides its own entry's position once; the walk below shuffles tokens, so no division sits
            // between an entry and its row's request.
            const int my_token = static_cast<int>(my_pos / W);
            const int here = min(32, length - base);
            uint4 rows[WGRAD_AHEAD + 1][KW];  // rows[0] is entry j's, rows[d] entry j + d's (compile-time indices)
#pragma unroll
            for (int d = 0; d < WGRAD_AHEAD; ++d) {
                const int token = __shfl_sync(FULL_MASK, my_token, min(d, here - 1));
                if (d < here) load(rows[d], token);
            }
            for (int j = 0; j < here; ++j) {
                const int ahead = j + WGRAD_AHEAD;
                const int token_ahead = __shfl_sync(FULL_MASK, my_token, min(ahead, here - 1));
                if (ahead < here) load(rows[WGRAD_AHEAD], token_ahead);
                axpy<KW>(acc[0], __shfl_sync(FULL_MASK, my_v0, j), rows[0]);
                if constexpr (NV == 2) axpy<KW>(acc[NV - 1], __shfl_sync(FULL_MASK, my_v1, j), rows[0]);
#pragma unroll
                for (int d = 0; d < WGRAD_AHEAD; ++d) {
#pragma unroll
                    for (int v = 0; v < KW; ++v) rows[d][v] = rows[d + 1][v];
                }
            }
        }
        if (alone) {
            if (add && length == 0) continue;  // an empty column adds nothing
#pragma unroll
            for (int i = 0; i < NV; ++i) {
#pragma unroll
                for (int v = 0; v < KW; ++v) {
                    const int col = col0 + v * 256;
                    if (col < K) store8((i == 0 ? out0 : out1) + static_cast<long long>(n) * K + col, acc[i][v], add);
                }
            }
            continue;
        }
        const int rank = shared_rank[n];
        float *const slot_rows = scratch + static_cast<long long>(rank % slots) * NV * K;
        await_slot(counters, rank, slots, lane);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
#pragma unroll
            for (int v = 0; v < KW; ++v) {
                const int col = col0 + v * 256;
                if (col >= K) continue;
                const float(&a)[8] = acc[i][v];
                atomicAdd(reinterpret_cast<float4 *>(slot_rows + i * K + col), make_float4(a[0], a[1], a[2], a[3]));
                atomicAdd(reinterpret_cast<float4 *>(slot_rows + i * K + col + 4), make_float4(a[4], a[5], a[6], a[7]));
            }
        }
        finish_slot<NV>(counters, rank, slots, (chunk_start[n + 1] - chunk_start[n]) * parts, slot_rows, out0, out1,
                        static_cast<long long>(n) * K, K, add, lane);
    }
}

// Instantiations for the nvcc compile check; NVRTC builds the ones named by the launcher.
#define TRAIN_BWD_SDDMM(KV, KEY)                                                                                 \
    template __global__ void train_bwd_sddmm<KV, KEY>(const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,  \
                                                      const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,  \
                                                      const bool *, const float *, __nv_bfloat16 *,               \
                                                      __nv_bfloat16 *, __nv_bfloat16 *, KEY *, int, int, int, int,   \
                                                      int, int, int);
#define TRAIN_BWD_DX(KV)                                                                                           \
    template __global__ void train_bwd_dx<KV>(const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,          \
                                              const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,          \
                                              const bool *, __nv_bfloat16 *, float *, int, int, int, int, int,    \
                                              int, int);
#define TRAIN_CSC_WGRAD(KW, NV, OUT)                                                                              \
    template __global__ void train_csc_wgrad<KW, NV, OUT>(                                                        \
        const long long *, const long long *, const long long *, const int *, const int *, const __nv_bfloat16 *, \
        const __nv_bfloat16 *, const __nv_bfloat16 *, OUT *, OUT *, float *, unsigned long long *, int, int, int,  \
        int, int, int, int);
TRAIN_BWD_SDDMM(1, short)
TRAIN_BWD_SDDMM(1, int)
TRAIN_BWD_SDDMM(8, short)
TRAIN_BWD_SDDMM(8, int)
TRAIN_BWD_SDDMM(16, short)
TRAIN_BWD_SDDMM(16, int)
TRAIN_BWD_DX(1)
TRAIN_BWD_DX(8)
TRAIN_BWD_DX(16)
template __global__ void train_csc_columns<short>(const short *, long long *, long long, int);
template __global__ void train_csc_columns<int>(const int *, long long *, long long, int);
TRAIN_CSC_WGRAD(1, 1, float)
TRAIN_CSC_WGRAD(1, 2, float)
TRAIN_CSC_WGRAD(4, 1, float)
TRAIN_CSC_WGRAD(4, 2, float)
TRAIN_CSC_WGRAD(1, 1, __nv_bfloat16)
TRAIN_CSC_WGRAD(1, 2, __nv_bfloat16)
TRAIN_CSC_WGRAD(4, 1, __nv_bfloat16)
TRAIN_CSC_WGRAD(4, 2, __nv_bfloat16)

// One thread per 8 consecutive elements of the heavy tokens' [R, N] rows (N % 8 == 0). The GEMMs' outputs are
// rewritten in place: the gate pre-activations become dg, the up products du, dy w_down becomes h.

extern "C" __global__ void __launch_bounds__(BACKUP_GRADS_THREADS) train_backup_grads(
    __nv_bfloat16 *__restrict__ gate_dg,  // [R, N] in: x w_gate^T; out: dg
    __nv_bfloat16 *__restrict__ up_du,    // [R, N] in: x w_up^T; out: du
    __nv_bfloat16 *__restrict__ dhd_h,    // [R, N] in: dy w_down; out: h
    const float *__restrict__ dl1,        // [1] gradient of the loss w.r.t. sum |h|
    long long pieces) {                   // R * N / 8
    const long long i = static_cast<long long>(blockIdx.x) * BACKUP_GRADS_THREADS + threadIdx.x;
    if (i >= pieces) return;
    uint4 *gate8 = reinterpret_cast<uint4 *>(gate_dg) + i;
    uint4 *up8 = reinterpret_cast<uint4 *>(up_du) + i;
    uint4 *dhd8 = reinterpret_cast<uint4 *>(dhd_h) + i;
    float g[8], u[8], dh[8], h[8], du[8], dg[8];
    bf16x8_to_float(*gate8, g);
    bf16x8_to_float(*up8, u);
    bf16x8_to_float(*dhd8, dh);
    const float l1_grad = *dl1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float gj = g[j] > 0.0f || isnan(g[j]) ? g[j] : 0.0f;  // relu, which passes NaN on as torch's does
        const bool on = gj != 0.0f;                                     // the ReLU's support
        const float uj = on ? u[j] : 0.0f;
        h[j] = bf16_round(gj * uj);
        const float sign_h = h[j] > 0.0f ? 1.0f : (h[j] < 0.0f ? -1.0f : 0.0f);
        const float dhj = bf16_round((on ? dh[j] : 0.0f) + l1_grad * sign_h);
        du[j] = dhj * gj;  // rounded by pack_bf16x8
        dg[j] = dhj * uj;
    }
    *gate8 = pack_bf16x8(dg);
    *up8 = pack_bf16x8(du);
    *dhd8 = pack_bf16x8(h);
}
