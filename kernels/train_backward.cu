// Training backward of the gated FFN on the hybrid format, light (ELL) tokens only; the dense backup rows
// go through cuBLAS in sparse_llm/twell_train.py. Tested on an H100 (tests/gpu/test_twell_train.py).
//
//   train_bwd_sddmm : per light token, at its ELL entries (n, g, u):
//                       dh = bf16(bf16(dy[m] . w_down[:, n]) + dl1 * sign(h)),  h = bf16(g * u)
//                       du = bf16(dh * g),  dg = bf16(dh * u)
//                     stored at the entries (h too, for dW_down), and the sort keys of the transposed view
//                     (int16 where N fits, so the radix sort makes two passes over them rather than four).
//   train_bwd_dx    : per light token, dx[m] = sum over its entries of du * w_up[n] + dg * w_gate[n],
//                     summed in one fp32 accumulator before rounding.
//                     torch reference of both: formats.hybrid_gated_mlp_backward_ref (hybrid_sddmm, the L1
//                     shift, hybrid_mul, hybrid_matmul). Two kernels rather than one so that each streams
//                     only the weight rows it needs: w_down (N x K) then w_up and w_gate (2 x N x K), working
//                     sets that stay in L2 where all three together (69 MB at K = 2048, N = 5632) do not.
//   train_csc_columns, train_csc_chunks : column starts, chunk starts and the chunks' columns of the
//                     transposed view from the sorted keys sddmm wrote.
//   train_csc_wgrad : weight gradients out[n] += sum over the entries e of column n of value(e) * src[row(e)],
//                     e.g. dW_gate = dg^T x, dW_up = du^T x (NV = 2, one gather of x for both) and
//                     dW_down^T = h^T dy (NV = 1). torch reference: formats.hybrid_t_matmul.
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
    int M, int N, int K, int W) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    if (m >= M) return;  // whole warp
    // Sort keys of the transposed (CSC) view for the weight gradients: unused slots and heavy tokens sort last.
    const int used = heavy[m] ? 0 : ell_count[m];
    for (int s = lane; s < W; s += 32) csc_key[m * W + s] = static_cast<Key>(s < used ? ell_cols[m * W + s] : N);
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
    walk_entries<KV, 1>(EllColumn{ell_cols + row0}, ell_count[m], down, lane, K, begin, step, finish);
}

// Column starts of the transposed view from the E sort keys in ascending order (a column per light entry, N
// for the rest): col_start[c] = the first e with key[e] >= c, for c = 0..N. Every e in [0, E] owns the
// columns between the key before it and its own key, so each start is written once, by one thread, with no
// search. torch reference: the searchsorted of csc_order in sparse_llm/twell_train.py.
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
// column_chunks(entries, ...) (chunk_start[N] = the number of chunks), and chunk_col[j] = the column of chunk j, so
// the weight-gradient kernel finds an item's column with one load. Each thread takes a run of consecutive
// columns; the block scans the runs' chunk totals. Launch with 1024 threads. torch reference:
// csc_chunk_starts and csc_chunk_columns in sparse_llm/twell_train.py.
extern "C" __global__ void __launch_bounds__(1024, 1) train_csc_chunks(
    const long long *__restrict__ col_start,  // [N + 1] from train_csc_columns
    long long *__restrict__ chunk_start,      // [N + 1] out
    int *__restrict__ chunk_col,              // [>= chunk_start[N]] out
    int N, int chunk, int whole_floor, int whole_per_mean) {
    __shared__ long long warp_total[32];
    const int t = threadIdx.x, lane = t & 31, warp = t / 32;
    // A column is one item up to whole_per_mean times the mean column (at least whole_floor entries): dense layers'
    // typical columns are stored without atomics, and no item is much longer than the typical one.
    const long long mean_bound = whole_per_mean * col_start[N] / max(N, 1);
    const int whole = static_cast<int>(max(static_cast<long long>(whole_floor), min(mean_bound, 1LL << 30)));
    const int per = (N + blockDim.x - 1) / blockDim.x;
    const int c0 = min(N, t * per), c1 = min(N, c0 + per);
    long long mine = 0;
    for (int c = c0; c < c1; ++c) mine += column_chunks(col_start[c + 1] - col_start[c], chunk, whole);
    // Block-wide exclusive scan of `mine`: within warps by shuffles, then over the warp totals.
    long long inclusive = mine;
    for (int d = 1; d < 32; d *= 2) {
        const long long up = __shfl_up_sync(FULL_MASK, inclusive, d);
        if (lane >= d) inclusive += up;
    }
    if (lane == 31) warp_total[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        long long total = lane < blockDim.x / 32 ? warp_total[lane] : 0;
        for (int d = 1; d < 32; d *= 2) {
            const long long up = __shfl_up_sync(FULL_MASK, total, d);
            if (lane >= d) total += up;
        }
        warp_total[lane] = total;  // inclusive over warps
    }
    __syncthreads();
    long long chunks = inclusive - mine + (warp > 0 ? warp_total[warp - 1] : 0);
    for (int c = c0; c < c1; ++c) {
        chunk_start[c] = chunks;
        const long long here = column_chunks(col_start[c + 1] - col_start[c], chunk, whole);
        for (long long j = 0; j < here; ++j) chunk_col[chunks + j] = c;
        chunks += here;
    }
    if (t == 0) chunk_start[N] = warp_total[blockDim.x / 32 - 1];
}


// Zeroes the rows out[n, :] (of each non-null out) of every column n with more than one chunk: those chunks add
// their sums with atomics. A single-chunk column's row is stored whole by its one item, so the rest of the
// weight-gradient buffers needs no fill. One warp per column, grid-stride.
extern "C" __global__ void __launch_bounds__(256) train_csc_zero_shared(
    const long long *__restrict__ chunk_start,  // [N + 1] from train_csc_chunks
    float *__restrict__ out0, float *__restrict__ out1, float *__restrict__ out2,  // [N, K] fp32 each, or null
    int N, int K) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x / 32;
    float *const outs[3] = {out0, out1, out2};
    for (long long n = static_cast<long long>(blockIdx.x) * warps + threadIdx.x / 32; n < N;
         n += static_cast<long long>(gridDim.x) * warps) {
        if (chunk_start[n + 1] - chunk_start[n] <= 1) continue;  // whole warp
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            if (outs[i] == nullptr) continue;
            for (int col = lane * 4; col < K; col += 128)
                *reinterpret_cast<float4 *>(outs[i] + n * K + col) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
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
    int M, int K, int W) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    if (m >= M || heavy[m]) return;  // whole warp
    const long long row0 = m * W;
    float acc[KV][8];
    zero_acc<KV>(acc);
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
    walk_entries<KV, R>(EllColumn{ell_cols + row0}, ell_count[m], mats, lane, K, begin, step, finish);
    store_row_bf16<KV>(dx + m * K, acc, lane, K);
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
// items from the counter `next_item` (zeroed by the caller), so the grid can be sized to the GPU without
// knowing the occupancy, and a slow column does not hold up a fixed share of the work. The two slices of a
// chunk are consecutive items, so the second gather of a src row usually hits L2. Each item accumulates in
// fp32 registers. The item of a single-chunk column (most columns, and every empty one, whose item writes
// zeros) stores its sums; the items of a many-chunk column add theirs with vector atomics to a row zeroed by
// train_csc_zero_shared, so the order of those additions (not their set) varies run to run.
constexpr int WGRAD_AHEAD = 2;  // entries between a row's request and its use in train_csc_wgrad

template <int KW, int NV>
__global__ void __launch_bounds__(128, NV == 1 ? 4 : 3) train_csc_wgrad(
    const long long *__restrict__ order,        // [M * W] entry positions sorted by column
    const long long *__restrict__ col_start,    // [N + 1]
    const long long *__restrict__ chunk_start,  // [N + 1]
    const int *__restrict__ chunk_col,          // [chunk_start[N]] column of each chunk
    const __nv_bfloat16 *__restrict__ value0,   // [M, W] values at the entries
    const __nv_bfloat16 *__restrict__ value1,   // [M, W] (NV == 2) second value array
    const __nv_bfloat16 *__restrict__ src,      // [M, K] rows gathered per entry (x or dy)
    float *__restrict__ out0,                   // [N, K] fp32: stored, or accumulated on zeros (many-chunk columns)
    float *__restrict__ out1,                   // [N, K] fp32, likewise (NV == 2)
    unsigned long long *__restrict__ next_item,  // [1] zeroed work counter
    int N, int K, int W, int chunk, int parts) {
    const int lane = threadIdx.x & 31;
    const long long total = chunk_start[N] * parts;
    for (;;) {
        unsigned long long claimed = 0;
        if (lane == 0) claimed = atomicAdd(next_item, 1ULL);
        const long long item = static_cast<long long>(__shfl_sync(FULL_MASK, claimed, 0));
        if (item >= total) break;
        const long long c = item / parts;
        const int col0 = static_cast<int>(item - c * parts) * KW * 256 + lane * 8;  // this lane's first column
        const long long n = chunk_col[c];
        const bool alone = chunk_start[n + 1] - chunk_start[n] == 1;  // this item owns the column's row
        const long long e0 = col_start[n] + (c - chunk_start[n]) * chunk;
        const long long e1 = alone ? col_start[n + 1] : min(e0 + chunk, col_start[n + 1]);

        // This lane's KW pieces of src row `token` (zeros past K). Rows are requested WGRAD_AHEAD entries before
        // they are accumulated, so WGRAD_AHEAD + 1 gathers are in flight per warp: the kernel is bound by how many
        // gathers are in flight, and registers allow three rows per warp at the residency the bounds ask for.
        auto load = [&](uint4 (&dst)[KW], long long token) {
#pragma unroll
            for (int v = 0; v < KW; ++v) {
                const int col = col0 + v * 256;
                dst[v] = col < K ? *reinterpret_cast<const uint4 *>(src + token * K + col) : make_uint4(0, 0, 0, 0);
            }
        };
        float acc[NV][KW][8];
#pragma unroll
        for (int i = 0; i < NV; ++i) zero_acc<KW>(acc[i]);
        for (long long base = e0; base < e1; base += 32) {
            const long long e = base + lane;
            const long long my_pos = e < e1 ? order[e] : 0;
            const float my_v0 = e < e1 ? bf16_load(value0 + my_pos) : 0.0f;
            const float my_v1 = (NV == 2 && e < e1) ? bf16_load(value1 + my_pos) : 0.0f;
            const int here = static_cast<int>(min(32LL, e1 - base));
            uint4 rows[WGRAD_AHEAD + 1][KW];  // rows[0] is entry j's, rows[d] entry j + d's (compile-time indices)
#pragma unroll
            for (int d = 0; d < WGRAD_AHEAD; ++d) {
                const long long pos = __shfl_sync(FULL_MASK, my_pos, min(d, here - 1));
                if (d < here) load(rows[d], pos / W);
            }
            for (int j = 0; j < here; ++j) {
                const int ahead = j + WGRAD_AHEAD;
                const long long pos_ahead = __shfl_sync(FULL_MASK, my_pos, min(ahead, here - 1));
                if (ahead < here) load(rows[WGRAD_AHEAD], pos_ahead / W);
                axpy<KW>(acc[0], __shfl_sync(FULL_MASK, my_v0, j), rows[0]);
                if constexpr (NV == 2) axpy<KW>(acc[NV - 1], __shfl_sync(FULL_MASK, my_v1, j), rows[0]);
#pragma unroll
                for (int d = 0; d < WGRAD_AHEAD; ++d) {
#pragma unroll
                    for (int v = 0; v < KW; ++v) rows[d][v] = rows[d + 1][v];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            float *out = (i == 0 ? out0 : out1) + n * K;
#pragma unroll
            for (int v = 0; v < KW; ++v) {
                const int col = col0 + v * 256;
                if (col >= K) continue;
                const float4 lo = make_float4(acc[i][v][0], acc[i][v][1], acc[i][v][2], acc[i][v][3]);
                const float4 hi = make_float4(acc[i][v][4], acc[i][v][5], acc[i][v][6], acc[i][v][7]);
                if (alone) {
                    reinterpret_cast<float4 *>(out + col)[0] = lo;
                    reinterpret_cast<float4 *>(out + col)[1] = hi;
                } else {
                    atomicAdd(reinterpret_cast<float4 *>(out + col), lo);
                    atomicAdd(reinterpret_cast<float4 *>(out + col + 4), hi);
                }
            }
        }
    }
}

// Instantiations for the nvcc compile check; NVRTC builds the ones named by the launcher.
#define TRAIN_BWD_SDDMM(KV, KEY)                                                                                 \
    template __global__ void train_bwd_sddmm<KV, KEY>(const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,  \
                                                      const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,  \
                                                      const bool *, const float *, __nv_bfloat16 *,               \
                                                      __nv_bfloat16 *, __nv_bfloat16 *, KEY *, int, int, int, int);
#define TRAIN_BWD_DX(KV)                                                                                           \
    template __global__ void train_bwd_dx<KV>(const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,          \
                                              const __nv_bfloat16 *, const __nv_bfloat16 *, const int *,          \
                                              const bool *, __nv_bfloat16 *, int, int, int);
#define TRAIN_CSC_WGRAD(KW, NV)                                                                                  \
    template __global__ void train_csc_wgrad<KW, NV>(const long long *, const long long *, const long long *, \
                                                     const int *, const __nv_bfloat16 *, const __nv_bfloat16 *, \
                                                     const __nv_bfloat16 *, float *, float *,                 \
                                                     unsigned long long *, int, int, int, int, int);
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
TRAIN_CSC_WGRAD(1, 1)
TRAIN_CSC_WGRAD(1, 2)
TRAIN_CSC_WGRAD(4, 1)
TRAIN_CSC_WGRAD(4, 2)
