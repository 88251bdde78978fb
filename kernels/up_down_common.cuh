// The per-entry step shared by the inference up + down kernels (gate_up_down.cu and gate_up_then_down.cu).
#ifndef UP_DOWN_COMMON_CUH
#define UP_DOWN_COMMON_CUH
#include "twell_common.cuh"

// A warp's ring of SLOTS shared-memory slots of KV * 512 bytes (one K-wide bf16 row each, K <= 256 * KV), filled by
// bulk copies that lane 0 starts, each slot with its own mbarrier: SLOTS rows in flight without holding registers.
// The warp reads a slot after wait() and refills it after a __syncwarp() that follows its last read. Slots placed
// 128-byte aligned: bulk copies into 16-byte aligned ones land much slower (docs/kernels.md, measured choices).
template <int KV, int SLOTS>
struct RowRing {
    uint4 *data;      // [SLOTS][KV * 32]
    uint32_t bars;    // shared address of SLOTS mbarriers, 8 bytes apart
    uint32_t parity;  // bit s: the parity of slot s's next phase

    // Lane 0 initialises the barriers (and fences every barrier it initialised before); the other lanes may use the
    // ring after the caller's __syncwarp().
    __device__ __forceinline__ RowRing(uint4 *slots, uint64_t *barriers, int lane)
        : data(slots), bars(static_cast<uint32_t>(__cvta_generic_to_shared(barriers))), parity(0) {
        if (lane == 0) {
            for (int s = 0; s < SLOTS; ++s) mbarrier_init(bars + 8 * s);
            mbarrier_init_fence();
        }
    }
    // Lane 0 only: bytes (<= KV * 512) from src into slot s.
    __device__ __forceinline__ void fill(int s, const void *src, uint32_t bytes, uint64_t policy) const {
        bulk_copy_to_smem(static_cast<uint32_t>(__cvta_generic_to_shared(data + s * KV * 32)), src, bytes, bars + 8 * s,
                          policy);
    }
    // Every lane: zeros its pieces past column K in every slot (rows copy only K columns; lane_dot reads all KV).
    __device__ __forceinline__ void clear_past(int K, int lane) {
#pragma unroll
        for (int v = 0; v < KV; ++v)
            if (v * 256 + lane * 8 >= K)
                for (int s = 0; s < SLOTS; ++s) data[s * KV * 32 + v * 32 + lane] = make_uint4(0, 0, 0, 0);
    }
    // Every lane: waits for slot s's copy and returns its contents.
    __device__ __forceinline__ const uint4 *wait(int s) {
        mbarrier_wait(bars + 8 * s, (parity >> s) & 1u);
        parity ^= 1u << s;
        return data + s * KV * 32;
    }
    // Every lane: this lane's pieces of slot s (after wait(s)), as load_weight_row would give them.
    __device__ __forceinline__ void read(int s, int lane, uint4 (&w)[KV]) const {
#pragma unroll
        for (int v = 0; v < KV; ++v) w[v] = data[s * KV * 32 + v * 32 + lane];
    }
};

// One warp lists the positives of its token's bf16 gate row (N columns, a multiple of 256) into `list` (`cap` slots),
// as list_gate_row does, with the row brought through the ring in pieces of KV * 256 columns, every slot in flight.
template <int KV, int SLOTS>
__device__ __forceinline__ int list_gate_row_ring(const __nv_bfloat16 *__restrict__ row, int N,
                                                  RowRing<KV, SLOTS> &ring, uint32_t *list, int cap, int lane) {
    constexpr int PIECE = KV * 256;
    const int pieces = (N + PIECE - 1) / PIECE;
    const uint64_t stream = l2_stream_policy();
    const auto fill = [&](int p) { ring.fill(p % SLOTS, row + p * PIECE, min(PIECE, N - p * PIECE) * 2, stream); };
    if (lane == 0)
        for (int p = 0; p < SLOTS && p < pieces; ++p) fill(p);
    int total = 0;
    for (int p = 0; p < pieces; ++p) {
        const uint4 *piece = ring.wait(p % SLOTS);
        const int chunks = min(PIECE, N - p * PIECE) / 256;
        for (int c = 0; c < chunks; ++c)
            total += list_positives(piece[c * 32 + lane], p * PIECE + c * 256 + lane * 8, list, total, cap, lane);
        __syncwarp();  // every lane has read the slot before it is refilled
        if (lane == 0 && p + SLOTS < pieces) fill(p + SLOTS);
    }
    return total;
}

// Lane 0's read of neuron n's fired flag (1 on the other lanes), for count_h. The rows walk and the slices up walk
// issue it as they start an entry, so its L2 round trip overlaps the entry's rows: read where count_h needs it, it
// stalls the warp once per entry (docs/kernels.md, measured choices). up_down_entry (the split walk of heavy tokens)
// still reads it just before count_h.
__device__ __forceinline__ int fired_flag(const int *__restrict__ fired, long long n, int lane) {
    return lane == 0 ? __ldcg(fired + n) : 1;
}

// The statistics of one h = g * u of a token (every lane holds the same h): its |h| sum, its h != 0 count, and the
// fired flag of neuron n, set by lane 0 where its `fired_flag` read found it unset. Read before write: once the flag
// is set, later tokens only read (no L2 write traffic).
__device__ __forceinline__ void count_h(float h, long long n, int flag, float &l1_sum, int &l0_sum,
                                        int *__restrict__ fired) {
    l1_sum += fabsf(h);
    if (h != 0.0f) {
        ++l0_sum;
        if (flag == 0) fired[n] = 1;
    }
}

// One gate non-zero (column n, value g) of a token whose x row is staged in x_smem (piece v of lane l at
// x_smem[v * 32 + l]): u = x . w_up[n] (fp32), h = g * u, acc += h * w_down_t[n], and the token's |h| sum,
// non-zero count and the neuron's fired flag. Both weight rows are requested before any use so they are
// in flight together; above K = 2048 the down row waits for the dot product, to stay within the register
// file. Every lane ends with the same h, l1_sum and l0_sum.
template <int KV>
__device__ __forceinline__ void up_down_entry(long long n, float g, const uint4 *x_smem, float (&acc)[KV][8],
                                              float &l1_sum, int &l0_sum, const __nv_bfloat16 *__restrict__ w_up,
                                              const __nv_bfloat16 *__restrict__ w_down_t, int *__restrict__ fired,
                                              int lane, int K, uint64_t keep) {
    uint4 up_raw[KV], down_raw[KV];
    load_weight_row<KV>(up_raw, w_up + n * K, lane, K, keep);
    if (KV <= 8) load_weight_row<KV>(down_raw, w_down_t + n * K, lane, K, keep);
    const float h = g * warp_sum(lane_dot<KV>(x_smem, up_raw, lane));
    if (KV > 8) load_weight_row<KV>(down_raw, w_down_t + n * K, lane, K, keep);
    axpy<KV>(acc, h, down_raw);
    count_h(h, n, fired_flag(fired, n, lane), l1_sum, l0_sum, fired);
}

#endif  // UP_DOWN_COMMON_CUH
