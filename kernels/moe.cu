// Launch contract
//
// The routed-expert MLP of a step, reading the routing from device memory (no host sync): P = T * k (token, slot)
// pairs are grouped by expert, each active expert's weights are read once per group of up to TT pairs, and every
// launch has a grid fixed by the shapes alone (G = min(E, P) groups at most; blocks past the number of active
// experts exit), so the sequence can be captured in a CUDA graph. TT (1, 2, 4, 8) is the smallest tile that holds
// min(T, 8) pairs: a group never has more pairs than tokens, so decode of one sequence runs with TT = 1.
//
// moe_align: group the pairs by expert.
//   ids int32 [P] (expert of pair p = t * k + s); outputs: group_expert int32 [E] (expert of group g, increasing),
//   group_start int32 [E + 1] (pairs of group g: sorted_pairs[group_start[g] .. group_start[g + 1] - 1]),
//   sorted_pairs int32 [P], num_groups int32 [1].
//   grid: 1, block: 1024 threads, dynamic shared memory: 2 * E ints.
//
// Weights are addressed per slot: expert e's matrices start `slot * w_stride` elements (and its scales `slot *
// s_stride` floats) past the given pointers, where slot = slot_of[e] when a slot table is given (experts held in a
// bounded set of GPU slots, experts.bin's block layout) and slot = e otherwise (every expert resident, stacked).
// A group whose slot is negative is skipped: its pairs' outputs are left as they are (another pass or the CPU
// fills them), so the caller zeroes y first when it skips any.
//
// moe_gate_up<W, TT, R>: act[p, i] = activation(gate_e[i] . x[p / k], up_e[i] . x[p / k]) for every pair p of expert e
//   (common.cuh's GatedActivation: biases, then silu(gate) * up or the clamped SwiGLU).
//   x float32 [T, H]; gate, up W [slots, I, H] at stride w_stride; gate_scale, up_scale float32 [slots, I] at
//   stride s_stride (int8 weights) or null; the activation's six arguments; slot_of int32 [E] or null; act float32
//   [P, I].
//   grid: (ceil(I / (MOE_WARPS * R)), G), block: MOE_WARPS * 32 threads; each warp R rows of gate and of up.
//
// moe_down<W, TT, R>: y[p, h] = route_weight[p] * (down_e[h] . act[p] + down_bias_e[h]).
//   act float32 [P, I]; down W [slots, H, I] at stride w_stride; down_scale float32 [slots, H] at stride s_stride
//   or null; down_bias float32 [slots, H] at stride b_stride or null (no bias); slot_of as above; route_weights
//   float32 [P]; y float32 [P, H].
//   grid: (ceil(H / (MOE_WARPS * R)), G), block: MOE_WARPS * 32 threads; each warp R rows.
//
// R (1, 2, 4): rows per warp. A warp reads each activation chunk once for its R rows, and short rows (Qwen3's 768
// columns of down: 1.5 KB in bf16) give each warp more bytes in flight.
//
// moe_sum: out[t, h] = sum over s < k of y[t * k + s, h], in slot order (deterministic, no atomics).
//   y float32 [T * k, H], out float32 [T, H]; grid.x: ceil(T * H / 256), block: 256.
//
// W: float, __nv_bfloat16, __half or signed char (int8, multiplied by the row's scale after the dot product);
// H and I multiples of Vec<W>::N.
#include "common.cuh"

constexpr int MOE_WARPS = 4;

extern "C" __global__ void moe_align(const int* __restrict__ ids, int num_pairs, int num_experts,
                                     int* __restrict__ group_expert, int* __restrict__ group_start,
                                     int* __restrict__ sorted_pairs, int* __restrict__ num_groups) {
    pdl_wait();
    extern __shared__ int counts[];  // [E] pairs per expert, then [E] write cursors
    int* cursor = counts + num_experts;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) atomicAdd(&counts[ids[p]], 1);
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
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) sorted_pairs[atomicAdd(&cursor[ids[p]], 1)] = p;
}

template <typename W, int TT, int R>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_gate_up(const float* __restrict__ x, const W* __restrict__ gate, const W* __restrict__ up, long long w_stride,
            const float* __restrict__ gate_scales, const float* __restrict__ up_scales, long long s_stride,
            const float* __restrict__ gate_bias, const float* __restrict__ up_bias, long long b_stride, float limit,
            float alpha, float up_shift, const int* __restrict__ slot_of, const int* __restrict__ group_expert,
            const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
            const int* __restrict__ num_groups, float* __restrict__ act, int H, int I, int top_k) {
    pdl_wait();
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const ExpertGroup group = expert_group(blockIdx.y, num_groups, group_expert, group_start, slot_of);
    if (group.slot < 0) return;
    const long long slot = group.slot;
    const int begin = group.begin, end = group.end;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * MOE_WARPS + warp) * R;
    if (row0 >= I) return;  // whole warps leave together
    const W* rows[2 * R];  // gate rows row0 .. row0 + R - 1, then the same rows of up (the last real row past I)
    float gate_scale[R], up_scale[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long row = min(row0 + r, I - 1);
        rows[r] = gate + slot * w_stride + row * H;
        rows[R + r] = up + slot * w_stride + row * H;
        gate_scale[r] = gate_scales != nullptr ? gate_scales[slot * s_stride + row] : 1.f;
        up_scale[r] = up_scales != nullptr ? up_scales[slot * s_stride + row] : 1.f;
    }
    for (int base = begin; base < end; base += TT) {
        const int n = min(TT, end - base);
        int pairs[TT];
        const float* xs[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            pairs[j] = sorted_pairs[base + min(j, n - 1)];
            xs[j] = x + static_cast<long long>(pairs[j] / top_k) * H;
        }
        float acc[2 * R][TT] = {};
        dot_tile<W, 2 * R, TT>(rows, xs, n, H, lane * Vec<W>::N, 32 * Vec<W>::N, acc);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j < n) {  // n is the same for the whole warp
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float gate_value = warp_sum(acc[r][j]) * gate_scale[r];
                    const float up_value = warp_sum(acc[R + r][j]) * up_scale[r];
                    if (lane == 0 && row0 + r < I) {
                        act[static_cast<long long>(pairs[j]) * I + row0 + r] =
                            activation(slot, row0 + r, gate_value, up_value);
                    }
                }
            }
        }
    }
}

template <typename W, int TT, int R>
__global__ void __launch_bounds__(MOE_WARPS * 32)
moe_down(const float* __restrict__ act, const W* __restrict__ down, long long w_stride,
         const float* __restrict__ down_scales, long long s_stride, const float* __restrict__ down_bias,
         long long b_stride, const int* __restrict__ slot_of,
         const float* __restrict__ route_weights, const int* __restrict__ group_expert,
         const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
         const int* __restrict__ num_groups, float* __restrict__ y, int H, int I) {
    pdl_wait();
    const ExpertGroup group = expert_group(blockIdx.y, num_groups, group_expert, group_start, slot_of);
    if (group.slot < 0) return;
    const long long slot = group.slot;
    const int begin = group.begin, end = group.end;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * MOE_WARPS + warp) * R;
    if (row0 >= H) return;
    const W* rows[R];  // rows row0 .. row0 + R - 1 of down (the last real row past H)
    float scale[R], bias[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const long long row = min(row0 + r, H - 1);
        rows[r] = down + slot * w_stride + row * I;
        scale[r] = down_scales != nullptr ? down_scales[slot * s_stride + row] : 1.f;
        bias[r] = down_bias != nullptr ? down_bias[slot * b_stride + row] : 0.f;
    }
    for (int base = begin; base < end; base += TT) {
        const int n = min(TT, end - base);
        int pairs[TT];
        const float* xs[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            pairs[j] = sorted_pairs[base + min(j, n - 1)];
            xs[j] = act + static_cast<long long>(pairs[j]) * I;
        }
        float acc[R][TT] = {};
        dot_tile<W, R, TT>(rows, xs, n, I, lane * Vec<W>::N, 32 * Vec<W>::N, acc);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j < n) {
                const float weight = route_weights[pairs[j]];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float s = warp_sum(acc[r][j]);
                    if (lane == 0 && row0 + r < H) {
                        y[static_cast<long long>(pairs[j]) * H + row0 + r] = (s * scale[r] + bias[r]) * weight;
                    }
                }
            }
        }
    }
}

extern "C" __global__ void moe_sum(const float* __restrict__ y, float* __restrict__ out, int T, int top_k, int H) {
    pdl_wait();
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<long long>(T) * H) return;
    const long long t = i / H, h = i % H;
    float total = 0.f;
    for (int s = 0; s < top_k; ++s) total += y[(t * top_k + s) * H + h];
    out[i] = total;
}
