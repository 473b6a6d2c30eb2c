// Launch contract
//
// Both kernels: router logits in float32, scores over all experts, the top k by their choice values, the chosen
// scores as weights (as NumpyBackend.route):
//   x       float32 [T, H] contiguous; router W [E, H] (W: float, __nv_bfloat16, __half), H a multiple of Vec<W>::N
//   scoring 0: softmax of the logits, 1: sigmoid of each; logit_bias float32 [E] added to the logits first (null:
//           none)
//   choice_bias float32 [E] added to the scores to choose experts only (null: none); n_group > 1 (at most 32,
//           dividing E): only experts of the topk_group best groups of E / n_group consecutive experts are chosen
//           before the others, a group ranked by the sum of its two largest choice values (ties: lower group first)
//   weights float32 [T, k]: the chosen experts' scores, largest choice first (ties: lower expert id first),
//           divided by their sum when renormalize != 0, then times scaling
//   ids     int32 [T, k]: their expert ids
//   E at most 1024.
//
// route_topk<W>: one block per token (for many tokens: each block reads the whole router, mostly from L2).
//   grid.x: T, block: 1024 threads (32 warps: one expert logit per warp at a time, then warp 0 selects),
//   dynamic shared memory: E floats.
//
// route_split<W, TT>: few tokens, the router's rows spread over the GPU (at T = 1 one block reading every row
//   would use one multiprocessor's share of the bandwidth); each block computes one expert's logits for a tile
//   of TT tokens, the last block of a tile to finish selects for the tile's tokens.
//   logits   float32 [T, E] scratch: written by every block, read by the tile's last one
//   counters uint32 [>= ceil(T / TT)]: zero before the launch, left zero after it (the last block of tile j counts
//            blocks in counters[j], then resets it), so one array serves every launch on a stream, graphs included
//   grid: (E, ceil(T / TT)), block: ROUTER_WARPS * 32 threads splitting the row's columns,
//   dynamic shared memory: ROUTER_WARPS * E floats.
#include "common.cuh"

constexpr int ROUTER_WARPS = 4;

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

// Softmax of the E values in v (shared memory), in place: called by all 32 lanes of one warp, lane l touching only
// v[l], v[l + 32], ...
__device__ __forceinline__ void warp_softmax(float* v, int E) {
    const int lane = threadIdx.x % 32;
    float top = neg_inf();
    for (int e = lane; e < E; e += 32) top = fmaxf(top, v[e]);
    top = warp_max(top);
    float total = 0.f;
    for (int e = lane; e < E; e += 32) {
        const float p = expf(v[e] - top);
        v[e] = p;
        total += p;
    }
    total = warp_sum(total);
    for (int e = lane; e < E; e += 32) v[e] /= total;
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
    warp_softmax(probs, E);

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

// What a route launch does beyond a softmax top-k of the logits (the launch contract's options).
struct Routing {
    int scoring;  // 0: softmax, 1: sigmoid
    const float* logit_bias;  // [E] or null
    const float* choice_bias;  // [E] or null
    int n_group, topk_group;
    float scaling;
    int renormalize;

    __device__ bool plain_softmax() const {
        return scoring == 0 && logit_bias == nullptr && choice_bias == nullptr && n_group <= 1 && scaling == 1.f;
    }
    __device__ float choice(const float* scores, int e) const {
        return choice_bias == nullptr ? scores[e] : scores[e] + choice_bias[e];
    }
};

// Any float as an unsigned key ordered like it (-inf above 0, which marks nothing to choose).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned bits = __float_as_uint(v);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The top k of E logits in scores (shared memory, overwritten with the scores) under `routing`, into weights[0..k)
// and ids[0..k) (written by lane 0). Called by all 32 lanes of one warp; lane l holds experts l, l + 32, ...
// (bit i of `taken`: expert l + 32 i chosen), and lane g ranks group g.
__device__ void scored_topk(float* scores, int E, int k, const Routing& routing, float* weights, int* ids) {
    const int lane = threadIdx.x % 32;
    if (routing.scoring == 0) {
        if (routing.logit_bias != nullptr) {
            for (int e = lane; e < E; e += 32) scores[e] += routing.logit_bias[e];
        }
        warp_softmax(scores, E);
    } else {
        for (int e = lane; e < E; e += 32) {
            const float logit = routing.logit_bias == nullptr ? scores[e] : scores[e] + routing.logit_bias[e];
            scores[e] = 1.f / (1.f + expf(-logit));
        }
    }
    __syncwarp();  // below, lanes read each other's scores

    const int group_size = routing.n_group > 1 ? E / routing.n_group : E;
    unsigned kept = 0xFFFFFFFFu;  // bit g: experts of group g may be chosen first
    if (routing.n_group > 1) {
        unsigned key = 0u;
        if (lane < routing.n_group) {
            float first = neg_inf(), second = neg_inf();
            for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
                const float c = routing.choice(scores, e);
                if (c > first) {
                    second = first;
                    first = c;
                } else if (c > second) {
                    second = c;
                }
            }
            key = order_key(group_size > 1 ? second + first : first);
        }
        kept = 0u;
        for (int j = 0; j < routing.topk_group; ++j) {
            const unsigned best = warp_max_u32(key);
            if (best == 0u) break;
            const unsigned group = warp_min_u32(key == best ? static_cast<unsigned>(lane) : 32u);
            kept |= 1u << group;
            if (lane == static_cast<int>(group)) key = 0u;
        }
    }

    unsigned taken = 0u;
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        unsigned best = 0u;
        int best_e = E;
        for (int i = 0, e = lane; e < E; ++i, e += 32) {
            if ((taken >> i) & 1u) continue;
            const bool first_groups = (kept >> (e / group_size)) & 1u;
            const unsigned key = order_key(first_groups ? routing.choice(scores, e) : neg_inf());
            if (key > best) {  // strictly: a lane's lower expert id wins its ties
                best = key;
                best_e = e;
            }
        }
        const unsigned top = warp_max_u32(best);
        const int chosen = static_cast<int>(warp_min_u32(best == top ? static_cast<unsigned>(best_e) : E));
        if (lane == (chosen & 31)) taken |= 1u << (chosen / 32);
        const float w = scores[chosen];
        if (lane == 0) {
            weights[j] = w;
            ids[j] = chosen;
        }
        picked += w;
    }
    if (lane == 0) {
        for (int j = 0; j < k; ++j) {
            const float w = routing.renormalize ? weights[j] / picked : weights[j];
            weights[j] = w * routing.scaling;
        }
    }
    __syncwarp();  // every lane has read the scores before the caller reuses them
}

// The top k of the E logits in probs (shared memory) under `routing`: softmax_topk where it is a plain softmax top-k,
// else scored_topk.
__device__ __forceinline__ void select_topk(float* probs, int E, int k, const Routing& routing, float* weights,
                                            int* ids) {
    if (routing.plain_softmax()) softmax_topk(probs, E, k, routing.renormalize, weights, ids);
    else scored_topk(probs, E, k, routing, weights, ids);
}

template <typename W>
__global__ void __launch_bounds__(1024)
route_topk(const float* __restrict__ x, const W* __restrict__ router, float* __restrict__ weights,
           int* __restrict__ ids, int H, int E, int k, int renormalize, int scoring, const float* logit_bias,
           const float* choice_bias, int n_group, int topk_group, float scaling) {
    const Routing routing{scoring, logit_bias, choice_bias, n_group, topk_group, scaling, renormalize};
    pdl_wait();
    extern __shared__ float probs[];  // [E]
    const int t = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    const float* xs[1] = {x + static_cast<long long>(t) * H};
    for (int e = warp; e < E; e += num_warps) {
        const W* rows[1] = {router + static_cast<long long>(e) * H};
        float acc[1][1] = {};
        dot_tile<W, 1, 1>(rows, xs, 1, H, lane * Vec<W>::N, 32 * Vec<W>::N, acc);
        const float logit = warp_sum(acc[0][0]);
        if (lane == 0) probs[e] = logit;
    }
    __syncthreads();
    if (warp == 0) select_topk(probs, E, k, routing, weights + t * k, ids + t * k);
}

template <typename W, int TT>
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
route_split(const float* __restrict__ x, const W* __restrict__ router, float* __restrict__ weights,
            int* __restrict__ ids, int H, int E, int k, int renormalize, int scoring, const float* logit_bias,
            const float* choice_bias, int n_group, int topk_group, float scaling, float* __restrict__ logits,
            unsigned int* __restrict__ counters, int T) {
    const Routing routing{scoring, logit_bias, choice_bias, n_group, topk_group, scaling, renormalize};
    extern __shared__ float probs[];  // [ROUTER_WARPS, E]: one token's logits per warp (the selecting block)
    __shared__ float partial[ROUTER_WARPS][TT];
    __shared__ bool last;
    const int e = blockIdx.x, tile = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t0 = tile * TT, n = min(TT, T - t0);
    const W* rows[1] = {router + static_cast<long long>(e) * H};
    if (tile == 0 && threadIdx.x == 0) prefetch_l2(rows[0], H * sizeof(W));
    pdl_wait();  // before it, only the router's weights are read
    const float* xs[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) xs[j] = x + static_cast<long long>(t0 + min(j, n - 1)) * H;
    float acc[1][TT] = {};
    dot_tile<W, 1, TT>(rows, xs, n, H, threadIdx.x * Vec<W>::N, ROUTER_WARPS * 32 * Vec<W>::N, acc);
#pragma unroll
    for (int j = 0; j < TT; ++j) {
        const float s = warp_sum(acc[0][j]);
        if (lane == 0) partial[warp][j] = s;
    }
    __syncthreads();
    if (threadIdx.x < n) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < ROUTER_WARPS; ++w) s += partial[w][threadIdx.x];
        logits[static_cast<long long>(t0 + threadIdx.x) * E + e] = s;
        __threadfence();  // the logit is visible to every block before this block is counted
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[tile], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;

    float* mine = probs + warp * E;  // [E]
    for (int j = warp; j < n; j += ROUTER_WARPS) {
        const long long t = t0 + j;
        for (int i = lane; i < E; i += 32) mine[i] = __ldcg(logits + t * E + i);  // from L2: other blocks wrote it
        select_topk(mine, E, k, routing, weights + t * k, ids + t * k);
    }
    if (threadIdx.x == 0) counters[tile] = 0;
}
