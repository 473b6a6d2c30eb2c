// Launch contract
//
// Both kernels: router logits in float32, softmax over all experts, the top k and optional renormalisation.
//   x       float32 [T, H] contiguous; router W [E, H] (W: float, __nv_bfloat16, __half), H a multiple of Vec<W>::N
//   weights float32 [T, k]: the k largest softmax probabilities, largest first (ties: lower expert id first),
//           divided by their sum when renormalize != 0
//   ids     int32 [T, k]: their expert ids
//
// route_topk<W>: one block per token (for many tokens: each block reads the whole router, mostly from L2).
//   grid.x: T, block: 1024 threads (32 warps: one expert logit per warp at a time, then warp 0 selects),
//   dynamic shared memory: E floats.
//
// route_split<W, TT>: few tokens, the router's rows spread over the GPU (at T = 1 one block reading every row
//   gets about 32 GB/s); each block computes one expert's logits for a tile of TT tokens, the last block of a tile
//   to finish selects for the tile's tokens.
//   logits   float32 [T, E] scratch: written by every block, read by the tile's last one
//   counters uint32 [>= ceil(T / TT)]: zero before the launch, left zero after it (the last block of tile j counts
//            blocks in counters[j], then resets it), so one array serves every launch on a stream, graphs included
//   grid: (E, ceil(T / TT)), block: ROUTER_WARPS * 32 threads splitting the row's columns,
//   dynamic shared memory: ROUTER_WARPS * E floats.
#include "common.cuh"
#include "topk.cuh"

constexpr int ROUTER_WARPS = 4;

template <typename W>
__global__ void __launch_bounds__(1024)
route_topk(const float* __restrict__ x, const W* __restrict__ router, float* __restrict__ weights,
           int* __restrict__ ids, int H, int E, int k, int renormalize) {
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
    if (warp == 0) softmax_topk(probs, E, k, renormalize, weights + t * k, ids + t * k);
}

template <typename W, int TT>
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
route_split(const float* __restrict__ x, const W* __restrict__ router, float* __restrict__ weights,
            int* __restrict__ ids, int H, int E, int k, int renormalize, float* __restrict__ logits,
            unsigned int* __restrict__ counters, int T) {
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
        softmax_topk(mine, E, k, renormalize, weights + t * k, ids + t * k);
    }
    if (threadIdx.x == 0) counters[tile] = 0;
}
