// Launch contract
//
// route_topk<W>: router logits, softmax over all experts, top-k and optional renormalisation in one kernel.
//   x       float32 [T, H] contiguous; router W [E, H] (W: float, __nv_bfloat16, __half), H a multiple of Vec<W>::N
//   weights float32 [T, k]: the k largest softmax probabilities, largest first (ties: lower expert id first),
//           divided by their sum when renormalize != 0
//   ids     int32 [T, k]: their expert ids
//   grid.x: T, block: 1024 threads (32 warps: one expert logit per warp at a time, then warp 0 selects),
//   dynamic shared memory: E floats.
#include "common.cuh"

template <typename W>
__global__ void __launch_bounds__(1024)
route_topk(const float* __restrict__ x, const W* __restrict__ router, float* __restrict__ weights,
           int* __restrict__ ids, int H, int E, int k, int renormalize) {
    extern __shared__ float probs[];  // [E]: logits, then probabilities; -1 marks a chosen expert
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
    if (warp != 0) return;

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
    for (int e = lane; e < E; e += 32) probs[e] /= total;  // each lane touches only its own experts below too

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
            weights[t * k + j] = best;
            ids[t * k + j] = best_e;
        }
        if (lane == (best_e & 31)) probs[best_e] = -1.f;
        picked += best;
    }
    if (renormalize && lane == 0) {
        for (int j = 0; j < k; ++j) weights[t * k + j] /= picked;
    }
}
