// Launch contract
//
// paged_attention<DPL>: causal attention of every query token over its own sequence's cached keys and values, with
// grouped-query heads, computed flash-style (online softmax per warp, merged at the end): no score matrix is
// stored, for one decode token or a long prompt alike.
//   q            float32 [T, Q, D] contiguous, out float32 [T, Q, D]
//   key_cache,
//   value_cache  float32 [num_blocks, block_size, K, D]
//   block_tables int64 [B, max_blocks]: KV blocks of each sequence
//   query_start  int64 [B + 1]: sequence b owns tokens query_start[b] .. query_start[b + 1] - 1
//   positions    int64 [T]
//   Token t of sequence b at position p, head h, reads KV head h / (Q / K) at cached positions j <= p, and only
//   j > p - window when window > 0; scores are scaled by `scale`.
//   grid: (T, Q), block: ATTN_WARPS * 32 threads, dynamic shared memory: ATTN_WARPS * D floats.
//   DPL = ceil(D / 32) rounded up to 1, 2, 4 or 8 (D <= 256): head dims per lane. Each warp takes ATTN_UNROLL
//   keys per step, so several loads are in flight.
#include "common.cuh"

constexpr int ATTN_WARPS = 16;
constexpr int ATTN_UNROLL = 8;

template <int DPL>
__global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention(const float* __restrict__ q, const float* __restrict__ key_cache,
                const float* __restrict__ value_cache, const long long* __restrict__ block_tables,
                const long long* __restrict__ query_start, const long long* __restrict__ positions,
                float* __restrict__ out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                int block_size, int max_blocks, float scale, int window) {
    pdl_wait();
    extern __shared__ float merged[];  // [ATTN_WARPS, head_dim]
    __shared__ float warp_max_s[ATTN_WARPS], warp_sum_s[ATTN_WARPS];
    const int t = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    int lo = 0, hi = num_seqs - 1;  // the sequence of token t: the last b with query_start[b] <= t
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const long long* table = block_tables + static_cast<long long>(lo) * max_blocks;
    const int pos = static_cast<int>(positions[t]);
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int kv_head = h / (num_heads / num_kv_heads);
    const long long slot_stride = static_cast<long long>(num_kv_heads) * head_dim;

    float qv[DPL];
    const float* q_row = q + (static_cast<long long>(t) * num_heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? q_row[d] * scale : 0.f;
    }
    float m = neg_inf(), l = 0.f, acc[DPL] = {};
    for (int j0 = first + warp * ATTN_UNROLL; j0 <= pos; j0 += ATTN_WARPS * ATTN_UNROLL) {
        const float* k_rows[ATTN_UNROLL];
        const float* v_rows[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int j = j0 + u <= pos ? j0 + u : j0;  // past the end: re-read a valid row, masked below
            const long long slot = table[j / block_size] * block_size + j % block_size;
            k_rows[u] = key_cache + slot * slot_stride + kv_head * head_dim;
            v_rows[u] = value_cache + slot * slot_stride + kv_head * head_dim;
        }
        float s[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) dot = fmaf(qv[i], k_rows[u][d], dot);
            }
            s[u] = dot;
        }
        float m_new = m;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            s[u] = j0 + u <= pos ? warp_sum(s[u]) : neg_inf();
            m_new = fmaxf(m_new, s[u]);
        }
        const float correction = expf(m - m_new);  // m_new is finite: key j0 is always valid
        l *= correction;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= correction;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const float p = expf(s[u] - m_new);
            l += p;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < head_dim) acc[i] = fmaf(p, v_rows[u][d], acc[i]);
            }
        }
        m = m_new;
    }

    if (lane == 0) { warp_max_s[warp] = m; warp_sum_s[warp] = l; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) merged[warp * head_dim + d] = acc[i];
    }
    __syncthreads();
    float total_max = neg_inf();
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) total_max = fmaxf(total_max, warp_max_s[w]);
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) total += warp_sum_s[w] * expf(warp_max_s[w] - total_max);
    float* out_row = out + (static_cast<long long>(t) * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) a += merged[w * head_dim + d] * expf(warp_max_s[w] - total_max);
        out_row[d] = a / total;
    }
}
