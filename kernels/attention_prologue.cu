// Launch contract
//
// qk_norm_rope_write<KV>: what a layer does between the q/k/v projections and attention, in one launch: optional
// RMSNorm of q and k, optional clamp of q, k and v, the rotary embedding of q and k (as NumpyBackend.rotary), k and
// v stored in the paged caches (as NumpyBackend.write_kv), the rotated q written out. In the model's order:
// full norm, clamp, per-head norm, rotary.
//   q          float32 [T, Q*D] contiguous; k, v float32 [T, K*D] contiguous; D = 2 * half
//   norm       0: none; 1: per head, RMSNorm over each head's D; 2: full, RMSNorm over each token's Q*D of q and
//              K*D of k
//   q_weight   float32 [D] (norm 1), [Q*D] (norm 2), unused (may be null) for norm 0; k_weight: [D], [K*D]
//   eps        RMSNorm epsilon: x / sqrt(mean(x^2) + eps) * weight
//   clip       > 0: q, k, v clamped to [-clip, clip] (after a full norm, before a per-head one); 0: no clamp
//   cos, sin   float32 [P, R/2] tables for the first R = 2 * rot_half dimensions of each head (rot_half <= D/2:
//              pairs i, i + R/2 rotated for i < R/2, dimensions R .. D - 1 as they are); positions int64 [T], each
//              below P
//   slots      int64 [T]; a negative slot stores nothing (padding rows of a captured batch), q is still written
//   q_out      float32 [T, Q, D] (not aliasing q)
//   key_cache, value_cache KV [num_blocks, block_size, K, D]: slot s owns the K*D elements at s * K * D; KV is
//              float, __nv_bfloat16, __half or __nv_fp8_e4m3 (the KV cache's dtype); each key is divided by
//              k_scale, each value by v_scale (1 but for fp8 caches with scales), then rounded to nearest (fp8
//              saturated at +-448)
//   grid: (T, G), block: a multiple of 32 threads (at most 1024). Each warp takes one of the token's Q + 2K heads
//   at a time (q heads, then k heads, then v heads), striding by G * warps per block.
//   norm 2 needs G = 1: the block sums each token's squares of q and of k before any head is written.
#include "kv_types.cuh"

__device__ __forceinline__ float clamp_to(float v, float clip) {
    return clip > 0.f ? fminf(fmaxf(v, -clip), clip) : v;
}

template <typename KV>
__global__ void __launch_bounds__(1024)
qk_norm_rope_write(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ q_weight, const float* __restrict__ k_weight,
                   const float* __restrict__ cos, const float* __restrict__ sin,
                   const long long* __restrict__ positions, const long long* __restrict__ slots,
                   float* __restrict__ q_out, KV* __restrict__ key_cache, KV* __restrict__ value_cache,
                   int Q, int K, int half, int rot_half, int norm, float eps, float clip, float k_scale,
                   float v_scale) {
    pdl_wait();
    const long long t = blockIdx.x;
    const int D = 2 * half;
    const long long p = positions[t], slot = slots[t];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

    float q_inv = 1.f, k_inv = 1.f;  // full norm: 1 / rms of the token's whole q, and of its k
    if (norm == 2) {
        float squares = 0.f;
        for (int i = threadIdx.x; i < Q * D; i += blockDim.x) {
            const float x = q[t * Q * D + i];
            squares = fmaf(x, x, squares);
        }
        q_inv = rsqrtf(block_sum(squares) / (Q * D) + eps);
        __syncthreads();  // every thread has read block_sum's result before its shared memory is reused
        squares = 0.f;
        for (int i = threadIdx.x; i < K * D; i += blockDim.x) {
            const float x = k[t * K * D + i];
            squares = fmaf(x, x, squares);
        }
        k_inv = rsqrtf(block_sum(squares) / (K * D) + eps);
    }

    for (int h = blockIdx.y * warps + warp; h < Q + 2 * K; h += gridDim.y * warps) {
        if (h >= Q + K) {  // a v head: clamped and stored
            if (slot < 0) continue;
            const int head = h - Q - K;
            const float* src = v + (t * K + head) * D;
            KV* dst = value_cache + (slot * K + head) * D;
            for (int i = lane; i < D; i += 32) dst[i] = from_float<KV>(clamp_to(src[i], clip) / v_scale);
            continue;
        }
        const bool is_q = h < Q;
        if (!is_q && slot < 0) continue;
        const int head = is_q ? h : h - Q;
        const float* src = is_q ? q + (t * Q + head) * D : k + (t * K + head) * D;
        float* q_dst = q_out + (t * Q + head) * D;  // used when is_q
        KV* k_dst = key_cache + (slot * K + head) * D;  // used when !is_q
        const float* weight = is_q ? q_weight : k_weight;
        float scale = 1.f;
        if (norm == 1) {
            float squares = 0.f;
            for (int i = lane; i < D; i += 32) {
                const float x = clamp_to(src[i], clip);
                squares = fmaf(x, x, squares);
            }
            scale = rsqrtf(warp_sum(squares) / D + eps);
        } else if (norm == 2) {
            scale = is_q ? q_inv : k_inv;
            weight += head * D;
        }
        // element i of the head after its norm and clamp, in the model's order
        const auto normed = [&](int i) {
            if (norm == 2) return clamp_to(src[i] * scale * weight[i], clip);
            const float x = clamp_to(src[i], clip);
            return norm == 1 ? x * scale * weight[i] : x;
        };
        const auto store = [&](int i, float y) {
            if (is_q) q_dst[i] = y;
            else k_dst[i] = from_float<KV>(y / k_scale);
        };
        for (int i = lane; i < rot_half; i += 32) {
            const float x1 = normed(i), x2 = normed(i + rot_half);
            const float c = cos[p * rot_half + i], s = sin[p * rot_half + i];
            store(i, x1 * c - x2 * s);
            store(i + rot_half, x2 * c + x1 * s);
        }
        for (int i = 2 * rot_half + lane; i < D; i += 32) store(i, normed(i));  // past the rotated dimensions
    }
}
