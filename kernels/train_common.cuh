// Shared helpers of the training kernels (hybrid format: ELL rows + dense backup rows; the torch specification is
// sparse_llm/formats/hybrid.py, the op is sparse_llm/ffn/twell/train_op.py). The warp-row convention and its helpers
// (stage_row, lane_dot, axpy, ...) are in twell_common.cuh.
// Rounding points follow sparse_llm/formats: every stored or multiplied value is rounded to bf16 where the torch
// reference holds a bf16 tensor; sums are fp32.
#ifndef TRAIN_COMMON_CUH
#define TRAIN_COMMON_CUH
#include "twell_common.cuh"

__device__ __forceinline__ float bf16_load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
    return v;
}

// Walks one token's ELL entries first .. end - 1 (col_at(s) is the column of entry s) 32 at a time.
// begin(base, here) lets lane j load what it needs of entry base + j; then for each entry j of the batch the
// R weight rows of its column n (row n of mats[0 .. R), evict_last in L2) are requested together and
// step(j, n, rows) runs on the whole warp; finish(base, here) lets lane j store its results. Rows in flight
// come from many resident warps rather than from prefetching within one: a second set of rows in registers
// costs more warps than it adds.
template <int KV, int R, typename ColAt, typename Begin, typename Step, typename Finish>
__device__ __forceinline__ void walk_entries(ColAt &&col_at, int first, int end, const __nv_bfloat16 *const (&mats)[R],
                                             int lane, int K, Begin &&begin, Step &&step, Finish &&finish) {
    const uint64_t keep = l2_keep_policy();
    for (int base = first; base < end; base += 32) {
        const int here = min(32, end - base);
        const int my_col = lane < here ? col_at(base + lane) : 0;
        begin(base, here);
        for (int j = 0; j < here; ++j) {
            const long long n = __shfl_sync(FULL_MASK, my_col, j);
            uint4 rows[R][KV];
#pragma unroll
            for (int r = 0; r < R; ++r) load_weight_row<KV>(rows[r], mats[r] + n * K, lane, K, keep);
            step(j, n, rows);
        }
        finish(base, here);
    }
}

// Column s of a token's ELL row (streaming load: each entry is read once per kernel).
struct EllColumn {
    const int *__restrict__ cols;
    __device__ __forceinline__ int operator()(int s) const { return __ldcs(cols + s); }
};

// Column parts: a walk over weights that outgrow L2 runs once per range of columns [col_begin, col_end), so each pass
// draws on that range's rows only. A token's entries ascend by column, so a part's are a contiguous run of them:
// entries [first, end) of the `count` (col_at(s) is the column of entry s; all of them when the range is every column).
struct EntryRange {
    int first, end;
};
template <typename ColAt>
__device__ __forceinline__ EntryRange entries_in(ColAt &&col_at, int count, int col_begin, int col_end, int N,
                                                 int lane) {
    if (col_begin == 0 && col_end == N) return {0, count};
    int before = 0, inside = 0;
    for (int s = lane; s < count; s += 32) {
        const int c = col_at(s);
        before += c < col_begin;
        inside += c >= col_begin && c < col_end;
    }
    before = warp_sum_int(before);
    return {before, before + warp_sum_int(inside)};
}

#endif  // TRAIN_COMMON_CUH
