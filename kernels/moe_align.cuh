// Grouping a step's (token, slot) pairs by expert: the first launch of the routed experts (moe.cu's moe_align), or
// the end of the router's (router.cu's route_split, whose last block groups the pairs once every token is routed).
#pragma once
#include "common.cuh"

// ids int32 [P] (expert of pair p = t * k + s, read through L2: another block of the same launch may have written
// them); outputs: group_expert int32 [E] (expert of group g, increasing), group_start int32 [E + 1] (pairs of group
// g: sorted_pairs[group_start[g] .. group_start[g + 1] - 1]), sorted_pairs int32 [P] (within a group in no fixed
// order), num_groups int32 [1].
// Called by every thread of one block (a multiple of 32 threads); counts: 2 * E ints of shared memory.
__device__ __forceinline__ void align_pairs(const int* ids, int num_pairs, int num_experts, int* counts,
                                            int* __restrict__ group_expert, int* __restrict__ group_start,
                                            int* __restrict__ sorted_pairs, int* __restrict__ num_groups) {
    int* cursor = counts + num_experts;  // [E] write cursors
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) atomicAdd(&counts[__ldcg(ids + p)], 1);
    __syncthreads();
    if (threadIdx.x < 32) {  // one warp scans: each lane a contiguous run of experts
        const int lane = threadIdx.x;
        const int per_lane = (num_experts + 31) / 32;
        const int begin = min(lane * per_lane, num_experts), end = min(begin + per_lane, num_experts);
        int pairs = 0, groups = 0;
        for (int e = begin; e < end; ++e) {
            pairs += counts[e];
            groups += counts[e] > 0;
        }
        int pairs_before = pairs, groups_before = groups;  // inclusive scan, made exclusive below
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int p = __shfl_up_sync(FULL_MASK, pairs_before, offset);
            const int g = __shfl_up_sync(FULL_MASK, groups_before, offset);
            if (lane >= offset) { pairs_before += p; groups_before += g; }
        }
        pairs_before -= pairs;
        groups_before -= groups;
        for (int e = begin; e < end; ++e) {
            cursor[e] = pairs_before;
            if (counts[e] > 0) {
                group_expert[groups_before] = e;
                group_start[groups_before] = pairs_before;
                ++groups_before;
            }
            pairs_before += counts[e];
        }
        if (lane == 31) {
            num_groups[0] = groups_before;
            group_start[groups_before] = pairs_before;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        sorted_pairs[atomicAdd(&cursor[__ldcg(ids + p)], 1)] = p;
    }
}
