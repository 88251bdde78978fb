// Training forward of the gated FFN on the hybrid format, straight from the bf16 gate pre-activation of the
// cuBLAS gate GEMM (no packing pass). Tested on an H100 (tests/gpu/test_twell_train.py).
//
//   train_fwd_gate : one warp per token. One pass over the token's gate row lists its positives in ascending
//                    column order (list_gate_row). A token with at most W of them is light: its ELL row
//                    (column, g, then zero padding) is written and, for each entry, u = bf16(x[m] . w_up[n])
//                    (fp32 dot), h = bf16(g * u), y[m] += h * w_down_t[n], with the |h| and h != 0 statistics.
//                    A token with more is heavy: flagged, its ELL row all padding, and appended to a list for
//                    gate_up_down_heavy (gate_up_down.cu), which computes its y and statistics from the same
//                    gate row; the backward recomputes its gradients densely (sparse_llm/ffn/twell/train_op.py).
//                    torch reference: formats.pack_hybrid(relu(gate), W), hybrid_sddmm, hybrid_mul,
//                    hybrid_matmul, hybrid_abs_sum.
//                    Column parts (a block whose w_up + w_down rows outgrow L2): one launch per range of columns
//                    [col_begin, col_end). The first lists the row, writes the whole ELL row and walks its range's
//                    entries; later parts read the ELL row back and walk theirs, the y, |h| and h != 0 sums carried
//                    in `partial`, l1[m] and l0[m] (the one-pass steps, so the same bits).
#include "train_common.cuh"

// Up to K = 2048 both weight rows of an entry are requested together; wider rows load w_down_t[n] after the
// dot product, to stay within the register file. Shared memory per warp: the x row (KV * 32 uint4), then the
// list of the token's entries (W uint32, bf16 value << 16 | column). Without DOWN (one column part only) the kernel
// stops at h and the statistics: w_down_t, y and partial are unused, and y comes from the slices walk
// (ell_to_slots, entries_down in gate_up_then_down.cu).
template <int KV, bool DOWN>
__global__ void __launch_bounds__(128, KV <= 8 ? 3 : 1) train_fwd_gate(
    const __nv_bfloat16 *__restrict__ gate,      // [M, N] pre-activation x w_gate^T
    const __nv_bfloat16 *__restrict__ x,         // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of down_proj.weight [K, N])
    int *__restrict__ ell_cols,                  // [M, W] out: entry columns, then zero padding
    __nv_bfloat16 *__restrict__ ell_g,           // [M, W] out: gate values, then zero padding
    __nv_bfloat16 *__restrict__ ell_u,           // [M, W] out: up values, then zero padding
    int *__restrict__ ell_count,                 // [M] out: the token's gate positives
    bool *__restrict__ heavy,                    // [M] out: more than W positives
    int *__restrict__ heavy_list,                // [M] out: heavy tokens in arrival order (first heavy_count[0])
    int *__restrict__ heavy_count,               // [1] zeroed
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (light rows)
    float *__restrict__ l1,                      // [M] out (light rows): sum |h|
    int *__restrict__ l0,                        // [M] out (light rows): #(h != 0)
    int *__restrict__ fired,                     // [N] zeroed; set to 1 where h != 0
    float *__restrict__ partial,                 // [M, K] fp32 running y sums between column parts, or null
    int M, int K, int N, int W, int col_begin, int col_end, int part) {
    constexpr bool kBothRows = DOWN && KV <= 8;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const long long m = static_cast<long long>(blockIdx.x) * warps + warp;
    if (m >= M) return;  // whole warp; no block-wide barrier below
    extern __shared__ uint4 smem[];
    uint4 *x_row = smem + warp * KV * 32;
    uint32_t *list = reinterpret_cast<uint32_t *>(smem + warps * KV * 32) + static_cast<long long>(warp) * W;

    const long long row0 = m * W;
    const bool first_part = part & FIRST_PART;
    // The first part lists the whole gate row and writes the token's ELL row; later parts read it back.
    int total;
    if (first_part) {
        total = list_gate_row(gate + m * N, N / 256, list, W, lane);
        const bool is_heavy = total > W;
        if (lane == 0) {
            ell_count[m] = total;
            heavy[m] = is_heavy;
            if (is_heavy) heavy_list[atomicAdd(heavy_count, 1)] = static_cast<int>(m);
        }
        // Zero padding (column 0, value 0) past the entries, over the whole row of a heavy token, as sparse_llm/formats
        // lays it out: the saved state is deterministic without a separate fill.
        for (int s = is_heavy ? lane : total + lane; s < W; s += 32) {
            ell_cols[row0 + s] = 0;
            ell_g[row0 + s] = __float2bfloat16_rn(0.0f);
            ell_u[row0 + s] = __float2bfloat16_rn(0.0f);
        }
        if (is_heavy) return;  // whole warp
        __syncwarp();  // the list is written by all lanes and read by all
    } else {
        if (heavy[m]) return;  // whole warp
        total = ell_count[m];
    }
    // This part's entries (all of them in one pass). The first part also writes the columns and values of the
    // later parts' entries.
    auto column = [&](int s) { return first_part ? twell_col(list[s]) : ell_cols[row0 + s]; };
    const EntryRange range = entries_in(column, total, col_begin, col_end, N, lane);
    if (first_part) {
        for (int s = range.end + lane; s < total; s += 32) {
            ell_cols[row0 + s] = twell_col(list[s]);
            ell_g[row0 + s] = __ushort_as_bfloat16(static_cast<unsigned short>(list[s] >> 16));
        }
    }
    stage_row<KV>(x_row, x + m * K, lane, K);
    __syncwarp();  // the x row is written by all lanes and read by all

    float acc[KV][8];
    float l1_sum = 0.0f;
    int l0_sum = 0;
    if (first_part) {
        zero_acc<KV>(acc);
    } else {
        load_partial<KV>(acc, partial + m * K, lane, K);
        l1_sum = l1[m];
        l0_sum = l0[m];
    }
    float my_g = 0.0f, my_u = 0.0f;
    const uint64_t keep = l2_keep_policy();
    const __nv_bfloat16 *const both[2] = {w_up, w_down_t};
    const __nv_bfloat16 *const up_only[1] = {w_up};
    auto begin = [&](int base, int here) {
        my_g = 0.0f;
        my_u = 0.0f;
        if (lane < here) {
            if (first_part) {
                const uint32_t entry = list[base + lane];
                my_g = twell_value(entry);
                ell_cols[row0 + base + lane] = twell_col(entry);
                ell_g[row0 + base + lane] = __ushort_as_bfloat16(static_cast<unsigned short>(entry >> 16));
            } else {
                my_g = bf16_load(ell_g + row0 + base + lane);
            }
        }
    };
    auto step = [&](int j, long long n, const uint4 (&rows)[kBothRows ? 2 : 1][KV]) {
        const float g = __shfl_sync(FULL_MASK, my_g, j);
        const float u = bf16_round(warp_sum(lane_dot<KV>(x_row, rows[0], lane)));
        const float h = bf16_round(g * u);
        if constexpr (kBothRows) {
            axpy<KV>(acc, h, rows[1]);
        } else if constexpr (DOWN) {
            uint4 down[KV];
            load_weight_row<KV>(down, w_down_t + n * K, lane, K, keep);
            axpy<KV>(acc, h, down);
        }
        if (lane == j) my_u = u;
        l1_sum += fabsf(h);
        if (h != 0.0f) {
            ++l0_sum;
            if (lane == 0 && fired[n] == 0) fired[n] = 1;  // read first: no write traffic once set
        }
    };
    auto finish = [&](int base, int here) {
        if (lane < here) ell_u[row0 + base + lane] = __float2bfloat16_rn(my_u);
    };
    if constexpr (kBothRows) {
        walk_entries<KV, 2>(column, range.first, range.end, both, lane, K, begin, step, finish);
    } else {
        walk_entries<KV, 1>(column, range.first, range.end, up_only, lane, K, begin, step, finish);
    }
    if constexpr (DOWN) {
        if (part & LAST_PART) {
            store_row_bf16<KV>(y + m * K, acc, lane, K);
        } else {
            store_partial<KV>(partial + m * K, acc, lane, K);
        }
    }
    __syncwarp();  // every lane has read l1[m] and l0[m] before lane 0 overwrites them
    if (lane == 0) {
        l1[m] = l1_sum;
        l0[m] = l0_sum;
    }
}

// Instantiations for the nvcc compile check; NVRTC builds the one named by the launcher (KV = ceil(K/256)).
#define TRAIN_FWD_GATE(KV, DOWN)                                                                                 \
    template __global__ void train_fwd_gate<KV, DOWN>(const __nv_bfloat16 *, const __nv_bfloat16 *,               \
                                                      const __nv_bfloat16 *, const __nv_bfloat16 *, int *,        \
                                                      __nv_bfloat16 *, __nv_bfloat16 *, int *, bool *, int *,     \
                                                      int *, __nv_bfloat16 *, float *, int *, int *, float *, int, \
                                                      int, int, int, int, int, int);
TRAIN_FWD_GATE(1, true)
TRAIN_FWD_GATE(8, true)
TRAIN_FWD_GATE(16, true)
TRAIN_FWD_GATE(8, false)
