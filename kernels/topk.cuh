// softmax_topk: the router's selection, shared by router.cu and moe_decode.cu (see router.cu's launch contract):
// softmax over E logits, the k largest probabilities (ties: lower expert id first), optional renormalisation.
#pragma once
#include "common.cuh"

constexpr int TOPK_LANE_EXPERTS = 8;  // softmax_topk holds up to 32 * this many experts in registers

// A probability p >= 0 as an unsigned key ordered like p (float bits of non-negative values are), 0 for -1 (chosen
// or no expert).
__device__ __forceinline__ unsigned prob_key(float p) { return p >= 0.f ? __float_as_uint(p) + 1u : 0u; }

// softmax_topk (below) for E <= 32 * TOPK_LANE_EXPERTS, with probs read only: lane l holds experts l, l + 32, ... in
// registers (-1: chosen, or past E), with the same arithmetic in the same order; each of the k rounds takes the
// warp's largest key, then the lowest id among the lanes holding it (one redux instruction each), so the choice and
// every value are the shared-memory walk's.
__device__ __forceinline__ void softmax_topk_registers(const float* probs, int E, int k, int renormalize,
                                                       float* weights, int* ids) {
    const int lane = threadIdx.x % 32;
    float p[TOPK_LANE_EXPERTS];
    float top = neg_inf();
#pragma unroll
    for (int i = 0; i < TOPK_LANE_EXPERTS; ++i) {
        p[i] = lane + 32 * i < E ? probs[lane + 32 * i] : neg_inf();
        top = fmaxf(top, p[i]);
    }
    top = warp_max(top);
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < TOPK_LANE_EXPERTS; ++i) {
        if (lane + 32 * i < E) {
            p[i] = expf(p[i] - top);
            total += p[i];
        }
    }
    total = warp_sum(total);
#pragma unroll
    for (int i = 0; i < TOPK_LANE_EXPERTS; ++i) p[i] = lane + 32 * i < E ? p[i] / total : -1.f;

    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        float best = -1.f;
        int best_e = E;
#pragma unroll
        for (int i = 0; i < TOPK_LANE_EXPERTS; ++i) {
            if (p[i] > best) { best = p[i]; best_e = lane + 32 * i; }
        }
        const unsigned key = warp_max_u32(prob_key(best));
        const int chosen = static_cast<int>(warp_min_u32(prob_key(best) == key ? best_e : E));
        best = key == 0u ? -1.f : __uint_as_float(key - 1u);
        if (lane == 0) {
            weights[j] = best;
            ids[j] = chosen;
        }
#pragma unroll
        for (int i = 0; i < TOPK_LANE_EXPERTS; ++i) {
            if (lane + 32 * i == chosen) p[i] = -1.f;
        }
        picked += best;
    }
    if (renormalize && lane == 0) {
        for (int j = 0; j < k; ++j) weights[j] /= picked;
    }
}

// Softmax over the E logits in probs (shared memory), then the k largest probabilities into weights[0..k) and their
// expert ids into ids[0..k) (written by lane 0; ties: lower expert id first), divided by their sum when
// renormalize != 0. Called by all 32 lanes of one warp; each lane only touches experts lane, lane + 32, ..., so no
// synchronisation is needed. Up to 32 * TOPK_LANE_EXPERTS experts, softmax_topk_registers; more, this walk over
// shared memory (overwritten with probabilities; -1 marks a chosen expert).
__device__ __forceinline__ void softmax_topk(float* probs, int E, int k, int renormalize, float* weights,
                                             int* ids) {
    if (E <= 32 * TOPK_LANE_EXPERTS) {
        softmax_topk_registers(probs, E, k, renormalize, weights, ids);
        return;
    }
    const int lane = threadIdx.x % 32;
    float top = neg_inf();
    for (int e = lane; e < E; e += 32) top = fmaxf(top, probs[e]);
    top = warp_max(top);
    float total = 0.f;
    for (int e = lane; e < E; e += 32) {
        const float p = expf(probs[e] - top);
        probs[e] = p;
        total += p;
    }
    total = warp_sum(total);
    for (int e = lane; e < E; e += 32) probs[e] /= total;

    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        float best = -1.f;
        int best_e = E;
        for (int e = lane; e < E; e += 32) {
            if (probs[e] > best) { best = probs[e]; best_e = e; }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(FULL_MASK, best, offset);
            const int other_e = __shfl_xor_sync(FULL_MASK, best_e, offset);
            if (other > best || (other == best && other_e < best_e)) { best = other; best_e = other_e; }
        }
        if (lane == 0) {
            weights[j] = best;
            ids[j] = best_e;
        }
        if (lane == (best_e & 31)) probs[best_e] = -1.f;
        picked += best;
    }
    if (renormalize && lane == 0) {
        for (int j = 0; j < k; ++j) weights[j] /= picked;
    }
}

