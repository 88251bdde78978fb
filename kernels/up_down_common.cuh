// The per-entry step shared by the inference up + down kernels (twell_up_down.cu reads the entries from
// TwELL words, gate_up_down.cu straight from the gate pre-activation).
#ifndef UP_DOWN_COMMON_CUH
#define UP_DOWN_COMMON_CUH
#include "twell_common.cuh"

// The one-warp-per-token kernels' token: this warp's m (blockDim.x / 32 warps per block; m >= M for a warp with no
// token) and its shared memory, the block's staged x rows (KV * 32 uint4 each) followed by their lists of `cap`
// entries.
template <int KV>
__device__ __forceinline__ long long warp_token(uint4 *smem, int cap, uint4 *&x_smem, uint32_t *&list) {
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    x_smem = smem + warp * KV * 32;
    list = reinterpret_cast<uint32_t *>(smem + warps * KV * 32) + warp * cap;
    return static_cast<long long>(blockIdx.x) * warps + warp;
}

// The statistics of one h = g * u of a token (every lane holds the same h): its |h| sum, its h != 0 count, and the
// fired flag of neuron n.
__device__ __forceinline__ void count_h(float h, long long n, float &l1_sum, int &l0_sum, int *__restrict__ fired,
                                        int lane) {
    l1_sum += fabsf(h);
    if (h != 0.0f) {
        ++l0_sum;
        // Read before write: once the flag is set, later tokens only read (cheap, no L2 write traffic).
        if (lane == 0 && fired[n] == 0) fired[n] = 1;
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
    count_h(h, n, l1_sum, l0_sum, fired, lane);
}

#endif  // UP_DOWN_COMMON_CUH
