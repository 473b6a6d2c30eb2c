// Launch contract
//
// moe_decode<W, K>: the routed experts of one token in one launch, where a step of one sequence spends most of its
// time between kernels (Qwen3-30B-A3B: five launches of 1-19 us each). Phases, separated by grid-wide barriers:
//   1. router logits: logits[e] = router[e] . x, four warps per expert as route_split (the same bits);
//   2. (every block) softmax over the E logits, the top k and optional renormalisation (topk.cuh: the same
//      selection as router.cu);
//   3. act[s, i] = silu(gate_e[i] . x) * (up_e[i] . x) for each chosen expert e = ids[s], a warp per (s, i);
//   4. out[h] = sum over s of weight[s] * (down_e[h] . act[s]), a warp per h over the k experts, the sum in slot
//      order (no atomics: the same bits every run).
//   x float32 [H]; router W [E, H]; gate, up W [E, I, H] at stride w13_stride elements per expert (stacked w13:
//   gate rows, then up rows); down W [E, H, I] at stride w2_stride; out float32 [H]; weights float32 [k], ids int32
//   [k]: the routing (written by block 0). Scratch: logits float32 [E], act float32 [k, I].
//   barrier uint32 [2] (arrivals, generation): arrivals zero before the first launch and after every barrier, so
//   one array serves every launch on a stream, graphs included.
//   W: float, __nv_bfloat16, __half (no per-row scales); H and I multiples of Vec<W>::N; 1 <= k <= K <= 8;
//   E <= 256 (softmax_topk's registers).
//   grid: at most as many blocks as are resident at once (the backend launches one per multiprocessor, and
//   the kernel lets the next one launch only after its last barrier), and at least E / 4; block:
//   MOE_DECODE_THREADS threads; dynamic shared memory: (H + max(k * I, E)) floats (x, then act or the
//   probabilities).
// Every value has the bits of route_split, moe_align, moe_gate_up, moe_down and moe_sum at T = 1: the same dot
// products in the same order, the same selection, the same sum over the experts.
#include "common.cuh"
#include "topk.cuh"

constexpr int MOE_DECODE_THREADS = 512;
constexpr int ROUTER_GROUP = 4;  // ROUTER_WARPS of router.cu

// Every block of the grid waits here until all of them arrived; writes before it are visible after it (read data
// other blocks wrote with __ldcg: L1 is not coherent across blocks).
__device__ __forceinline__ void grid_barrier(unsigned* barrier) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* generation = barrier + 1;
        const unsigned seen = *generation;  // read before arriving: the last arrival changes it
        __threadfence();
        if (atomicAdd(barrier, 1u) == gridDim.x - 1) {
            atomicExch(barrier, 0u);
            __threadfence();
            atomicAdd(barrier + 1, 1u);
        } else {
            while (*generation == seen) __nanosleep(20);
        }
        __threadfence();
    }
    __syncthreads();
}

template <typename W, int K>
__global__ void __launch_bounds__(MOE_DECODE_THREADS, 1)
moe_decode(const float* __restrict__ x, const W* __restrict__ router, const W* __restrict__ gate,
           const W* __restrict__ up, long long w13_stride, const W* __restrict__ down, long long w2_stride,
           float* __restrict__ out, float* __restrict__ weights, int* __restrict__ ids, float* logits, float* act,
           unsigned* barrier, int H, int I, int E, int k, int renormalize) {
    extern __shared__ float shared[];  // [H] x, then [k, I] act
    __shared__ float route_weight[K];
    __shared__ int route_id[K];
    __shared__ float router_partial[MOE_DECODE_THREADS / 32 / ROUTER_GROUP][ROUTER_GROUP];
    constexpr int V = Vec<W>::N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const int global_warp = blockIdx.x * warps + warp, total_warps = gridDim.x * warps;
    float* xs = shared;
    float* acts = shared + H;
    pdl_wait_only();
    for (int c = threadIdx.x * 4; c < H; c += blockDim.x * 4) {
        *reinterpret_cast<float4*>(xs + c) = *reinterpret_cast<const float4*>(x + c);
    }
    __syncthreads();

    // 1. router logits, ROUTER_GROUP warps per expert splitting its columns, their sums added in warp order: the
    //    arithmetic of route_split, so the logits and the routing have its bits (gridDim.x * groups >= E)
    {
        const int group = warp / ROUTER_GROUP, member = warp % ROUTER_GROUP;
        const int e = blockIdx.x * (warps / ROUTER_GROUP) + group;
        if (e < E) {
            const W* rows[1] = {router + static_cast<long long>(e) * H};
            const float* xrow[1] = {xs};
            float acc[1][1] = {};
            dot_tile<W, 1, 1>(rows, xrow, 1, H, (member * 32 + lane) * V, ROUTER_GROUP * 32 * V, acc);
            const float sum = warp_sum(acc[0][0]);
            if (lane == 0) router_partial[group][member] = sum;
        }
        __syncthreads();
        if (e < E && member == 0 && lane == 0) {
            float logit = 0.f;
#pragma unroll
            for (int w = 0; w < ROUTER_GROUP; ++w) logit += router_partial[group][w];
            logits[e] = logit;
        }
    }
    grid_barrier(barrier);

    // 2. the selection, in every block (acts holds the probabilities meanwhile: E <= 256 floats)
    if (warp == 0) {
        for (int e = lane; e < E; e += 32) acts[e] = __ldcg(logits + e);
        __syncwarp();
        softmax_topk(acts, E, k, renormalize, route_weight, route_id);
        __syncwarp();
        if (blockIdx.x == 0 && lane < k) {
            weights[lane] = route_weight[lane];
            ids[lane] = route_id[lane];
        }
    }
    __syncthreads();

    // 3. gate and up of each chosen expert, a warp per (slot, row)
    for (int item = global_warp; item < k * I; item += total_warps) {
        const int s = item / I, i = item % I;
        const long long row = static_cast<long long>(route_id[s]) * w13_stride + static_cast<long long>(i) * H;
        const W* rows[2] = {gate + row, up + row};
        const float* xrow[1] = {xs};
        float acc[2][1] = {};
        dot_tile<W, 2, 1>(rows, xrow, 1, H, lane * V, 32 * V, acc);
        const float g = warp_sum(acc[0][0]), u = warp_sum(acc[1][0]);
        if (lane == 0) act[item] = g / (1.f + expf(-g)) * u;
    }
    grid_barrier(barrier);
    pdl_launch_dependents();

    // 4. down over the k experts, a warp per output row
    for (int c = threadIdx.x * 4; c < k * I; c += blockDim.x * 4) {
        *reinterpret_cast<float4*>(acts + c) = __ldcg(reinterpret_cast<const float4*>(act + c));
    }
    __syncthreads();
    const W* bases[K];
#pragma unroll
    for (int s = 0; s < K; ++s) bases[s] = down + static_cast<long long>(route_id[min(s, k - 1)]) * w2_stride;
    constexpr int UNROLL = K <= 2 ? 4 : (K <= 4 ? 2 : 1);  // about 8 loads in flight per lane
    for (int h = global_warp; h < H; h += total_warps) {
        float acc[K] = {};
#pragma unroll UNROLL
        for (int c = lane * V; c < I; c += 32 * V) {
            float wv[K][V];
#pragma unroll
            for (int s = 0; s < K; ++s) {
                if (s < k) Vec<W>::load(bases[s] + static_cast<long long>(h) * I + c, wv[s]);
            }
#pragma unroll
            for (int s = 0; s < K; ++s) {
                if (s < k) {
                    float av[V];
                    load_floats<V>(acts + s * I + c, av);
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[s] = fmaf(wv[s][v], av[v], acc[s]);
                }
            }
        }
        float total = 0.f;
#pragma unroll
        for (int s = 0; s < K; ++s) {
            if (s < k) total += route_weight[s] * warp_sum(acc[s]);
        }
        if (lane == 0) out[h] = total;
    }
}
