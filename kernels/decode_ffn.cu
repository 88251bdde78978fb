// The gated FFN for a few tokens at a time (decode steps, small batches):
//   y = (relu(x Wg^T) * (x Wu^T)) Wd^T   for M <= DECODE_MAX_M tokens, in one pass over the neurons per group of
//   up to DECODE_GROUP_M tokens.
//
// A few tokens cannot share weight rows the way a large batch does: every weight byte is read for a handful of
// dot products, so the block is bound by how many weight bytes it reads. The dense block reads all three
// matrices; this kernel reads w_gate whole and, of w_up and w_down, only the rows of neurons that fire for some
// token. Each warp takes whole neurons: it loads the neuron's gate row once, dots it with every token's x
// (staged in shared memory by its block; from 8 tokens, 8 neurons at a time on the tensor cores: gate_tile_mma),
// and only where some token's gate is positive loads the neuron's up row,
// forms h, loads the neuron's row of w_down^T and adds h * that row into the tokens' fp32 output rows. Any density
// is exact (nothing to overflow: a neuron firing for every token costs one more row pair, as in the dense block).
// Where the tokens' rows fit in shared memory (BLOCK_SUMS), the block's warps add into its own copy there and the
// block adds its copy to the output once at the end: a token firing thousands of neurons then queues one global
// atomic per block on each output address, not one per neuron (which took 6x the dense block's time at one token).
// Otherwise the warps add with global vector atomics directly. The atomics make the order of y's fp32 sums vary
// from call to call (last-bit differences after rounding to bf16).
//
// Rounding follows the dense bf16 block: g and u are rounded to bf16 as a bf16 GEMM stores them, h = g * u is
// rounded to bf16, and y is summed in fp32 and rounded once.
//
// Issued from Python, one launch does the whole call: the fp32 sums live in a workspace that the call finds zeroed, and
// the last block of each group of tokens to finish rounds the group's sums into y and zeroes them again
// (`finish_in_last_block`). An eager decoding step pays the host for every op it issues (~20 us each on an H200's
// host), so the call issues one kernel and allocates only its outputs. In a CUDA graph, where no host time is paid per
// call, decode_finish rounds the sums instead, spread over many blocks: the last block alone took 8-18 us longer for
// 8-16 tokens.
#include "twell_common.cuh"

// More tokens than a block stages make groups, one per blockIdx.y, whose blocks run side by side: one group of 16
// tokens keeps only 704 warps busy at N = 5632 (8 neurons a warp), of the 4224 an H200 holds at two blocks an SM.
// Each group reads w_gate for its own tokens.
// DECODE_MAX_M (tokens per call), DECODE_GROUP_M (tokens a block stages in shared memory), DECODE_WARPS (warps per
// block) and DECODE_MMA_NEURONS (neurons per tensor-core gate tile) come from sparse_llm/cuda/kernel_constants.py.

// Adds h * w (this lane's KV pieces of a K-wide bf16 row) into a K-wide fp32 row in global memory, 16 bytes per
// atomic.
template <int KV>
__device__ __forceinline__ void add_scaled_row(float *__restrict__ out, float h, const uint4 (&w)[KV], int lane,
                                               int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        const int col = v * 256 + lane * 8;
        if (col < K) {
            float b[8];
            bf16x8_to_float(w[v], b);
            atomicAdd(reinterpret_cast<float4 *>(out + col), make_float4(h * b[0], h * b[1], h * b[2], h * b[3]));
            atomicAdd(reinterpret_cast<float4 *>(out + col + 4), make_float4(h * b[4], h * b[5], h * b[6], h * b[7]));
        }
    }
}

// The same into a token's row of a block's sums in shared memory, laid out [KV][8][32] (element i of lane l's piece v
// at (v * 8 + i) * 32 + l) so that a warp's 32 lanes add to 32 consecutive words: no bank conflicts.
template <int KV>
__device__ __forceinline__ void add_scaled_row_shared(float *out, float h, const uint4 (&w)[KV], int lane, int K) {
#pragma unroll
    for (int v = 0; v < KV; ++v) {
        if (v * 256 + lane * 8 < K) {
            float b[8];
            bf16x8_to_float(w[v], b);
#pragma unroll
            for (int i = 0; i < 8; ++i) atomicAdd(out + (v * 8 + i) * 32 + lane, h * b[i]);
        }
    }
}

// d += a b for one m16n8k16 tile on the tensor cores: a = 16 x 16 bf16 (row-major fragments a0..a3), b = 16 x 8
// bf16 (column-major fragments b0, b1), d = 16 x 8 fp32.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

constexpr int MMA_LOAD_BATCH = 8;  // 32-column chunks of the tile's gate rows loaded before their products

// The gate values g (bf16-rounded) of neurons n0 .. n0 + 7 for M <= DECODE_GROUP_M tokens on the tensor cores,
// into vals[j * DECODE_GROUP_M + t] (neuron n0 + j, token t). Lane l loads 16 bytes of gate row n0 + l / 4 at columns
// 32c + 8 (l % 4) of each 32-column chunk c, and the same columns of token rows l / 4 and l / 4 + 8 from x_rows:
// each 16 bytes then feed two m16n8k16 products as they are, because both operands take the same order of k within
// the chunk (a dot product does not depend on the order of its terms).
template <int KV>
__device__ __forceinline__ void gate_tile_mma(float *vals, const uint4 *x_rows, const __nv_bfloat16 *w_gate, int n0,
                                              int lane, int M, int K, int N, uint64_t once) {
    const int group = lane / 4, quad = lane % 4;
    const bool row_in = n0 + group < N;
    const __nv_bfloat16 *row = w_gate + static_cast<size_t>(row_in ? n0 + group : 0) * K + quad * 8;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const uint4 *x_lo = x_rows + group * KV * 32 + quad, *x_hi = x_rows + (group + 8) * KV * 32 + quad;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int chunks = (K + 31) / 32;
    for (int c0 = 0; c0 < chunks; c0 += MMA_LOAD_BATCH) {
        uint4 w[MMA_LOAD_BATCH];
#pragma unroll
        for (int b = 0; b < MMA_LOAD_BATCH; ++b) {
            const int col = (c0 + b) * 32 + quad * 8;
            w[b] = row_in && col < K ? load_keep<0>(row + (c0 + b) * 32, once) : zero;
        }
#pragma unroll
        for (int b = 0; b < MMA_LOAD_BATCH; ++b) {
            if (c0 + b < chunks) {
                const uint4 lo = group < M ? x_lo[(c0 + b) * 4] : zero, hi = group + 8 < M ? x_hi[(c0 + b) * 4] : zero;
                mma_16816(d, lo.x, hi.x, lo.y, hi.y, w[b].x, w[b].y);
                mma_16816(d, lo.z, hi.z, lo.w, hi.w, w[b].z, w[b].w);
            }
        }
    }
    // d[0], d[1]: token `group`, neurons 2 quad and 2 quad + 1; d[2], d[3]: token group + 8, the same neurons.
    vals[(2 * quad) * DECODE_GROUP_M + group] = bf16_round(d[0]);
    vals[(2 * quad + 1) * DECODE_GROUP_M + group] = bf16_round(d[1]);
    vals[(2 * quad) * DECODE_GROUP_M + group + 8] = bf16_round(d[2]);
    vals[(2 * quad + 1) * DECODE_GROUP_M + group + 8] = bf16_round(d[3]);
    __syncwarp();
}

// The decode workspace for up to T tokens (fp32, T * K + 2 * T + ceil(T / DECODE_GROUP_M) words;
// `decode_workspace_words` in sparse_llm/ffn/twell/decode.py): token t's fp32 sums of y at [t * K] (y_sum), then l1
// (fp32 [T]), l0 (int32 [T]) and each group's count of blocks done (unsigned), each passed to the kernel as a pointer
// of its own: kernel parameters stay in the constant bank, where pointers computed in the kernel would take registers
// from its loops. All zero between calls.

// y (bf16 [M, K]) = the fp32 sums y_sum [M, K] rounded to bf16, plus residual (bf16 [M, K], or null) added as the
// unfused path adds it (add_residual8); with `zero`, the sums are zeroed as they are read. Piece q = columns 8q ..
// 8q + 7 of the flattened rows, q from `first` in steps of `stride`.
__device__ __forceinline__ void round_sums(float *y_sum, const __nv_bfloat16 *residual, __nv_bfloat16 *y, int pieces,
                                           int first, int stride, bool zero) {
    float4 *sums4 = reinterpret_cast<float4 *>(y_sum);
    for (int q = first; q < pieces; q += stride) {
        const float4 lo = __ldcg(sums4 + 2 * q), hi = __ldcg(sums4 + 2 * q + 1);  // from L2: other SMs' atomics
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (residual != nullptr) add_residual8(v, __ldcs(reinterpret_cast<const uint4 *>(residual) + q));
        __stcs(reinterpret_cast<uint4 *>(y) + q, pack_bf16x8(v));
        if (zero) sums4[2 * q] = sums4[2 * q + 1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// Called by every thread of every block of a group of M tokens once its sums are added: the group's last block to get
// here writes the group's y from its sums (round_sums, residual added when not null) and l1_out / l0_out (fp32 / int32
// [M], each or null), and leaves its part of the workspace zeroed. Spread over the groups, this last step at 64 tokens
// costs what it costs at 16.
__device__ __forceinline__ void finish_in_last_block(float *y_sum, float *l1, int *l0, unsigned *done,
                                                     const __nv_bfloat16 *residual, __nv_bfloat16 *y, float *l1_out,
                                                     int *l0_out, int M, int K) {
    __shared__ bool last;
    __threadfence();  // this thread's atomics reach the device before its block counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // every other block's sums are visible (round_sums reads them from L2)
    round_sums(y_sum, residual, y, M * K / 8, threadIdx.x, blockDim.x, true);
    if (threadIdx.x < M) {
        if (l1_out != nullptr) l1_out[threadIdx.x] = __ldcg(l1 + threadIdx.x);
        if (l0_out != nullptr) l0_out[threadIdx.x] = __ldcg(l0 + threadIdx.x);
        l1[threadIdx.x] = 0.0f, l0[threadIdx.x] = 0;
    }
    if (threadIdx.x == 0) *done = 0;
}

// One pass over the N neurons for each group of up to DECODE_GROUP_M of M <= DECODE_MAX_M tokens. x, w_gate, w_up,
// w_down_t: bf16 [M, K], [N, K], [N, K], [N, K] (w_down_t is w_down transposed: row n = neuron n's output weights).
// y_sum, l1, l0, done: the workspace's, zeroed; y_sum receives h w_down^T, l1 and l0 sum |h| and count h != 0 per
// token; `done` has a count per group. FINISH: each group's last block writes the group's rows of y (plus residual,
// bf16 [M, K] or null), l1_out and l0_out (each or null) from them (finish_in_last_block); else the sums stay for
// decode_finish, l1 and l0 in the workspace, and the kernel is compiled without that code (which took registers from
// its loops: 6-12 us more at 8-16 tokens in CUDA graphs on an H200). fired (int32 [N], or null): 1 where neuron n has
// some h != 0; else 0, written by the kernel for one group of tokens and left as the caller zeroed it for more (another
// group's block may have found the neuron firing). BLOCK_SUMS: sum each block's share in shared memory first. MMA_GATE:
// each warp takes 8 neurons at a time and computes their gates for all tokens on the tensor cores (gate_tile_mma); else
// one neuron at a time, a warp-wide dot product per token (fewer, cheaper steps for one or two tokens). Grid: any
// number of blocks of DECODE_WARPS warps in x (they stride over the neurons) by ceil(M / DECODE_GROUP_M) groups in y (1
// without MMA_GATE); dynamic shared memory, for G = min(M, DECODE_GROUP_M) tokens: G * KV * 512 bytes of x,
// DECODE_WARPS * DECODE_GROUP_M floats of gate values (8 times that with MMA_GATE) and, with BLOCK_SUMS, G * KV * 1024
// bytes of sums.
template <int KV, bool BLOCK_SUMS, bool MMA_GATE, bool FINISH>
__global__ void __launch_bounds__(DECODE_WARPS * 32, KV <= 8 ? 2 : 1) decode_ffn(
    const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w_gate,
    const __nv_bfloat16 *__restrict__ w_up, const __nv_bfloat16 *__restrict__ w_down_t, float *__restrict__ y_sum,
    float *__restrict__ l1, int *__restrict__ l0, unsigned *__restrict__ done, const __nv_bfloat16 *__restrict__ residual,
    __nv_bfloat16 *__restrict__ y, float *__restrict__ l1_out, int *__restrict__ l0_out, int *__restrict__ fired, int M,
    int K, int N) {
    constexpr int TILE = MMA_GATE ? DECODE_MMA_NEURONS : 1;  // neurons a warp takes at a time
    // This block's group: tokens `first` .. first + m - 1 of the call's M (its token t is the call's first + t), whose
    // sums y_sum, l1 and l0 point to from here on. Only MMA_GATE takes groups: the moved pointers hold registers,
    // which made the loops of the one-token variant (no use for groups) spill more.
    const int first = MMA_GATE ? blockIdx.y * DECODE_GROUP_M : 0, m = min(DECODE_GROUP_M, M - first);
    x += static_cast<size_t>(first) * K, y_sum += static_cast<size_t>(first) * K, l1 += first, l0 += first;
    extern __shared__ uint4 smem[];
    uint4 *x_rows = smem;  // token t's row at [t * KV * 32], in stage_row's layout
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's g, then h, of its TILE neurons: neuron j's token t at [j * DECODE_GROUP_M + t].
    float *vals = reinterpret_cast<float *>(smem + m * KV * 32) + warp * TILE * DECODE_GROUP_M;
    // With BLOCK_SUMS, the block's fp32 sums of y: token t's row at [t * KV * 256].
    float *sums = reinterpret_cast<float *>(smem + m * KV * 32) + DECODE_WARPS * TILE * DECODE_GROUP_M;
    __shared__ float block_l1[DECODE_GROUP_M];
    __shared__ int block_l0[DECODE_GROUP_M];
    __shared__ unsigned block_live;  // bit t: token t has some h != 0 in this block
    for (int q = threadIdx.x; q < m * KV * 32; q += blockDim.x) {
        const int t = q / (KV * 32), p = q % (KV * 32);  // piece p of token t holds its columns 8p .. 8p + 7
        x_rows[q] = p * 8 < K ? __ldg(reinterpret_cast<const uint4 *>(x + static_cast<size_t>(t) * K + p * 8))
                              : make_uint4(0, 0, 0, 0);
    }
    if constexpr (BLOCK_SUMS) {
        for (int q = threadIdx.x; q < m * KV * 256; q += blockDim.x) sums[q] = 0.0f;
        if (threadIdx.x < DECODE_GROUP_M) block_l1[threadIdx.x] = 0.0f, block_l0[threadIdx.x] = 0;
        if (threadIdx.x == 0) block_live = 0;
    }
    __syncthreads();
    unsigned warp_live = 0;  // tokens with some h != 0 among this warp's neurons
    const uint64_t once = l2_stream_policy();  // each weight row is read once per call
    // Neuron n, whose gate values are in g_n (token t at g_n[t]) and `live` (bit t: g > 0): its up row only if some
    // token's gate is positive, h = g * u for those, and its w_down^T row only if some h != 0. `live` and the values
    // are the same on all lanes, so lane 0 keeps the values where the other lanes read them after a __syncwarp.
    auto up_down = [&](int n, float *g_n, unsigned live) {
        uint4 w[KV];
        if (live != 0) {
            load_weight_row<KV>(w, w_up + static_cast<size_t>(n) * K, lane, K, once);
            for (unsigned rest = live; rest != 0; rest &= rest - 1) {
                const int t = __ffs(rest) - 1;
                const float u = bf16_round(warp_sum(lane_dot<KV>(x_rows + t * KV * 32, w, lane)));
                const float h = bf16_round(g_n[t] * u);
                __syncwarp();
                if (lane == 0) g_n[t] = h;
                if (h == 0.0f) live &= ~(1u << t);
            }
            __syncwarp();
        }
        if (lane == 0 && fired != nullptr && (live != 0 || gridDim.y == 1)) fired[n] = live != 0;
        if (live == 0) return;
        warp_live |= live;
        load_weight_row<KV>(w, w_down_t + static_cast<size_t>(n) * K, lane, K, once);
        for (unsigned rest = live; rest != 0; rest &= rest - 1) {
            const int t = __ffs(rest) - 1;
            const float h = g_n[t];
            if constexpr (BLOCK_SUMS) {
                add_scaled_row_shared<KV>(sums + t * KV * 256, h, w, lane, K);
                if (lane == 0) atomicAdd(block_l0 + t, 1), atomicAdd(block_l1 + t, fabsf(h));
            } else {
                add_scaled_row<KV>(y_sum + static_cast<size_t>(t) * K, h, w, lane, K);
                if (lane == 0) atomicAdd(l0 + t, 1), atomicAdd(l1 + t, fabsf(h));
            }
        }
        __syncwarp();
    };
    if constexpr (MMA_GATE) {
        // Tiles dealt to the blocks first: the grid has more warps than a layer has 8-neuron tiles.
        for (int tile = blockIdx.x + gridDim.x * warp; tile * TILE < N; tile += gridDim.x * DECODE_WARPS) {
            gate_tile_mma<KV>(vals, x_rows, w_gate, tile * TILE, lane, m, K, N, once);
            for (int j = 0; j < TILE && tile * TILE + j < N; ++j) {
                const unsigned live = __ballot_sync(FULL_MASK, lane < m && vals[j * DECODE_GROUP_M + lane] > 0.0f);
                up_down(tile * TILE + j, vals + j * DECODE_GROUP_M, live);
            }
            __syncwarp();  // the next tile's gate values overwrite these
        }
    } else {
        for (int n = blockIdx.x * DECODE_WARPS + warp; n < N; n += gridDim.x * DECODE_WARPS) {
            uint4 w[KV];
            load_weight_row<KV>(w, w_gate + static_cast<size_t>(n) * K, lane, K, once);
            unsigned live = 0;
            for (int t = 0; t < m; ++t) {
                const float g = bf16_round(warp_sum(lane_dot<KV>(x_rows + t * KV * 32, w, lane)));
                if (lane == 0) vals[t] = g;
                if (g > 0.0f) live |= 1u << t;
            }
            __syncwarp();
            up_down(n, vals, live);
        }
    }
    if constexpr (BLOCK_SUMS) {
        if (lane == 0 && warp_live != 0) atomicOr(&block_live, warp_live);
        __syncthreads();
        const unsigned tokens = block_live;
        if (threadIdx.x < m && (tokens >> threadIdx.x & 1u)) {
            atomicAdd(l0 + threadIdx.x, block_l0[threadIdx.x]);
            atomicAdd(l1 + threadIdx.x, block_l1[threadIdx.x]);
        }
        for (int q = threadIdx.x; q < m * KV * 32; q += blockDim.x) {  // the block's sums into y: 8 columns a thread
            const int t = q / (KV * 32), v = q % (KV * 32) / 32, l = q % 32, col = v * 256 + l * 8;
            if (!(tokens >> t & 1u) || col >= K) continue;
            const float *piece = sums + t * KV * 256 + v * 256 + l;  // element i at piece[i * 32]
            float *out = y_sum + static_cast<size_t>(t) * K + col;
            atomicAdd(reinterpret_cast<float4 *>(out), make_float4(piece[0], piece[32], piece[64], piece[96]));
            atomicAdd(reinterpret_cast<float4 *>(out + 4), make_float4(piece[128], piece[160], piece[192], piece[224]));
        }
    }
    if constexpr (FINISH) {  // the group's tokens, by the group's last block
        const size_t rows = static_cast<size_t>(first) * K;
        finish_in_last_block(y_sum, l1, l0, done + blockIdx.y, residual == nullptr ? nullptr : residual + rows,
                             y + rows, l1_out == nullptr ? nullptr : l1_out + first,
                             l0_out == nullptr ? nullptr : l0_out + first, m, K);
    }
}

// decode_ffn's second half where its y was null: y (bf16 [M, K]) from the workspace's sums y_sum (round_sums).
// `pieces` = M * K / 8; any grid.
extern "C" __global__ void decode_finish(float *__restrict__ y_sum, const __nv_bfloat16 *__restrict__ residual,
                                         __nv_bfloat16 *__restrict__ y, int pieces) {
    round_sums(y_sum, residual, y, pieces, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x, false);
}

// Explicit instantiations, for nvcc compile checks (the doctor's width, K = 2048: KV = 8); few, as NVRTC compiles
// them all with each name expression.
#define DECODE_FFN(KV, BLOCK_SUMS, MMA_GATE, FINISH)                                                                 \
    template __global__ void decode_ffn<KV, BLOCK_SUMS, MMA_GATE, FINISH>(                                          \
        const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *, float *, float *, \
        int *, unsigned *, const __nv_bfloat16 *, __nv_bfloat16 *, float *, int *, int *, int, int, int);
DECODE_FFN(1, false, false, false)
DECODE_FFN(1, false, false, true)
DECODE_FFN(8, false, false, false)
DECODE_FFN(8, false, false, true)
DECODE_FFN(8, false, true, false)
DECODE_FFN(8, false, true, true)
DECODE_FFN(8, true, false, false)
DECODE_FFN(8, true, false, true)
DECODE_FFN(8, true, true, false)
DECODE_FFN(8, true, true, true)
