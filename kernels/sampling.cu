// Launch contract
//
// argmax_rows: greedy token of each row: the index of the largest logit, the lowest index among equal ones.
//   logits float32 [B, V] contiguous; ids int64 [B].
//   grid.x: B, block: 1024 threads (32 warps).
#include "common.cuh"

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, long long* __restrict__ ids, int V) {
    __shared__ float best_values[32];
    __shared__ int best_indices[32];
    const float* row = logits + static_cast<long long>(blockIdx.x) * V;
    float best = neg_inf();
    int index = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = row[i];
        if (v > best || index == V) { best = v; index = i; }  // indices rise per thread: ties keep the first
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, best, offset);
        const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
        if (other > best || (other == best && other_index < index)) { best = other; index = other_index; }
    }
    if (lane == 0) { best_values[warp] = best; best_indices[warp] = index; }
    __syncthreads();
    if (warp == 0) {
        best = lane < static_cast<int>(blockDim.x / 32) ? best_values[lane] : neg_inf();
        index = lane < static_cast<int>(blockDim.x / 32) ? best_indices[lane] : V;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
            if (other > best || (other == best && other_index < index)) { best = other; index = other_index; }
        }
        if (lane == 0) ids[blockIdx.x] = index;
    }
}
