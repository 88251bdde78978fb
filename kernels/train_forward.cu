// Training forward of the gated FFN on the hybrid format (after the TwELL gate GEMM of twell_gate_wgmma.cu
// or twell_pack.cu has packed g = relu(x w_gate^T)). Tested on an H100 (tests/gpu/test_twell_train.py).
//
//   train_ell_from_twell : TwELL words -> ELL rows (light tokens) + a list of backup rows (heavy tokens).
//                          torch reference: formats.pack_hybrid(relu(x w_gate^T), width)
//   train_fwd_light      : per light token, u = x . w_up[n] at the gate's non-zeros, h = g * u,
//                          y = sum h w_down[:, n], |h| and h != 0 statistics.
//                          torch reference: formats.hybrid_sddmm, hybrid_mul, hybrid_matmul, hybrid_abs_sum
// Heavy tokens go through gate_up_down_heavy (twell_direct.cu) from their dense gate rows; their gradients
// through cuBLAS (sparse_llm/twell_train.py).
#include "train_common.cuh"

// One warp per token. A token is heavy (goes whole to the dense backup) when its gate has more than W
// non-zeros or when one of its TwELL tiles overflowed (more than 31 positives: the words hold only 31 of
// them, so only the dense path can be exact). Heavy tokens are flagged (a deterministic output) and also
// appended to a list through an atomic counter, in arbitrary order, for the forward's heavy-token kernel.
extern "C" __global__ void __launch_bounds__(128) train_ell_from_twell(
    const uint32_t *__restrict__ packed,   // [M, T * 32] TwELL words of the gate
    int *__restrict__ ell_cols,            // [M, W] out: column of each ELL entry (light rows, slots < count)
    __nv_bfloat16 *__restrict__ ell_g,     // [M, W] out: gate value of each ELL entry
    __nv_bfloat16 *__restrict__ ell_u,     // [M, W] out here: zero padding only (train_fwd_light fills the rest)
    int *__restrict__ ell_count,           // [M] out: true gate non-zeros of the token
    bool *__restrict__ heavy,              // [M] out: true for a heavy token
    int *__restrict__ heavy_list,          // [M] out: the heavy tokens, any order (first counters[0] valid)
    int *__restrict__ counters,            // [2] zeroed: heavy tokens, tokens with an overflowed tile
    int M, int T, int W) {
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    if (m >= M) return;  // whole warp
    const uint32_t *row = packed + m * T * TWELL_SLOTS;

    int total = 0;
    bool overflow = false;
    for (int t = lane; t < T; t += 32) {
        const int count = static_cast<int>(row[t * TWELL_SLOTS]);
        total += count;
        overflow |= count > TWELL_CAPACITY;
    }
    total = warp_sum_int(total);
    overflow = __any_sync(FULL_MASK, overflow);
    const bool is_heavy = overflow || total > W;
    if (lane == 0) {
        ell_count[m] = total;
        heavy[m] = is_heavy;
        if (is_heavy) {
            heavy_list[atomicAdd(&counters[0], 1)] = static_cast<int>(m);
            if (overflow) atomicAdd(&counters[1], 1);
        }
    }
    // Zero padding (column 0, value 0) past the token's entries, and over the whole row of a heavy token, as
    // formats.py lays it out: the state is deterministic without a separate fill of the three arrays.
    for (int s = is_heavy ? lane : total + lane; s < W; s += 32) {
        ell_cols[m * W + s] = 0;
        ell_g[m * W + s] = __float2bfloat16_rn(0.0f);
        ell_u[m * W + s] = __float2bfloat16_rn(0.0f);
    }
    if (is_heavy) return;

    // Light token: copy the segments in tile order; lane i moves payload word i of each segment.
    int base = 0;
    for (int t = 0; t < T; ++t) {
        const uint32_t word = row[t * TWELL_SLOTS + lane];
        const int count = static_cast<int>(__shfl_sync(FULL_MASK, word, 0));
        if (lane >= 1 && lane <= count) {
            const long long slot = m * W + base + lane - 1;
            ell_cols[slot] = twell_col(word);
            ell_g[slot] = __ushort_as_bfloat16(static_cast<unsigned short>(word >> 16));
        }
        base += count;
    }
}

// One warp per light token (heavy tokens are skipped: the dense backup path writes their rows). For each
// ELL entry (n, g): u = bf16(x[m] . w_up[n]) (fp32 dot), h = bf16(g * u), acc += h * w_down_t[n]. The u
// values are stored for the backward (h is recomputed there); y[m] = bf16(acc). Up to K = 2048 both weight
// rows of an entry are requested together; wider rows load w_down_t[n] after the dot product, to stay
// within the register file.
template <int KV>
__global__ void __launch_bounds__(128, KV <= 8 ? 3 : 1) train_fwd_light(
    const __nv_bfloat16 *__restrict__ x,         // [M, K]
    const __nv_bfloat16 *__restrict__ w_up,      // [N, K]
    const __nv_bfloat16 *__restrict__ w_down_t,  // [N, K] (transpose of down_proj.weight [K, N])
    const int *__restrict__ ell_cols,            // [M, W]
    const __nv_bfloat16 *__restrict__ ell_g,     // [M, W]
    const int *__restrict__ ell_count,           // [M]
    const bool *__restrict__ heavy,              // [M] heavy tokens are skipped
    __nv_bfloat16 *__restrict__ ell_u,           // [M, W] out: u at the ELL entries
    __nv_bfloat16 *__restrict__ y,               // [M, K] out (light rows)
    float *__restrict__ l1,                      // [M] out (light rows): sum |h|
    int *__restrict__ l0,                        // [M] out (light rows): #(h != 0)
    int *__restrict__ fired,                     // [N] zeroed; set to 1 where h != 0
    int M, int K, int W) {
    constexpr bool kBothRows = KV <= 8;
    const int lane = threadIdx.x & 31;
    const long long m = static_cast<long long>(blockIdx.x) * 4 + threadIdx.x / 32;
    if (m >= M || heavy[m]) return;  // whole warp
    extern __shared__ uint4 smem[];
    uint4 *x_row = smem + (threadIdx.x / 32) * KV * 32;
    stage_row<KV>(x_row, x + m * K, lane, K);
    __syncwarp();

    float acc[KV][8];
    zero_acc<KV>(acc);
    float l1_sum = 0.0f;
    int l0_sum = 0;
    float my_g = 0.0f, my_u = 0.0f;
    const long long row0 = m * W;
    const uint64_t keep = l2_keep_policy();
    const __nv_bfloat16 *const both[2] = {w_up, w_down_t};
    const __nv_bfloat16 *const up_only[1] = {w_up};
    auto begin = [&](int base, int here) {
        my_g = lane < here ? bf16_load(ell_g + row0 + base + lane) : 0.0f;
        my_u = 0.0f;
    };
    auto step = [&](int j, long long n, const uint4 (&rows)[kBothRows ? 2 : 1][KV]) {
        const float g = __shfl_sync(FULL_MASK, my_g, j);
        const float u = bf16_round(warp_sum(lane_dot<KV>(x_row, rows[0], lane)));
        const float h = bf16_round(g * u);
        if constexpr (kBothRows) {
            axpy<KV>(acc, h, rows[1]);
        } else {
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
    const int *cols = ell_cols + row0;
    if constexpr (kBothRows) {
        walk_entries<KV, 2>(cols, ell_count[m], both, lane, K, begin, step, finish);
    } else {
        walk_entries<KV, 1>(cols, ell_count[m], up_only, lane, K, begin, step, finish);
    }
    store_row_bf16<KV>(y + m * K, acc, lane, K);
    if (lane == 0) {
        l1[m] = l1_sum;
        l0[m] = l0_sum;
    }
}

// Instantiations for the nvcc compile check; NVRTC builds the one named by the launcher (KV = ceil(K/256)).
#define TRAIN_FWD_LIGHT(KV)                                                                                      \
    template __global__ void train_fwd_light<KV>(const __nv_bfloat16 *, const __nv_bfloat16 *,                \
                                                 const __nv_bfloat16 *, const int *, const __nv_bfloat16 *,   \
                                                 const int *, const bool *, __nv_bfloat16 *, __nv_bfloat16 *, \
                                                 float *, int *, int *, int, int, int);
TRAIN_FWD_LIGHT(1)
TRAIN_FWD_LIGHT(8)
TRAIN_FWD_LIGHT(16)
