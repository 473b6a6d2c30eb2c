// Launch contract
//
// KV: the element type of the caches, float, __nv_bfloat16, __half or __nv_fp8_e4m3 (the KV cache's dtype); keys
// and values are widened to float32 as they are loaded, and every product and sum is float32. A stored key stands
// for itself times k_scale, a value for itself times v_scale (1 but for fp8 caches with scales): the backend folds
// k_scale into `scale`, and the kernels multiply their output (or split partials) by v_scale.
//
// paged_attention<KV, DPL>: causal attention of every query token over its own sequence's cached keys and values,
// with grouped-query heads, computed flash-style (online softmax per warp, merged at the end): no score matrix is
// stored, for one decode token or a long prompt alike.
//   q            float32 [T, Q, D] contiguous, out float32 [T, Q, D]
//   key_cache,
//   value_cache  KV [num_blocks, block_size, K, D]
//   block_tables int64 [B, max_blocks]: KV blocks of each sequence
//   query_start  int64 [B + 1]: sequence b owns tokens query_start[b] .. query_start[b + 1] - 1
//   positions    int64 [T]
//   Token t of sequence b at position p, head h, reads KV head h / (Q / K) at cached positions j <= p, and only
//   j > p - window when window > 0; scores are scaled by `scale`.
//   sinks        float32 [Q] or null: head h's sink logit (gpt-oss), one more term exp(sinks[h] - M) of the softmax's
//                denominator whose value is zero (every kernel of this file and flash_attention.cu takes it)
//   grid: (T, Q), block: ATTN_WARPS * 32 threads, dynamic shared memory: ATTN_WARPS * D floats.
//   DPL = ceil(D / 32) rounded up to 1, 2, 4 or 8 (D <= 256): head dims per lane. Each warp takes ATTN_UNROLL
//   keys per step, so several loads are in flight.
//
// paged_attention_gqa<KV, DPL, G>: the same attention for decode-like launches (one query token per sequence: T == B,
// so token t is sequence t; query_start is still honoured, read once and searched only if query_start[t] != t).
// One block per (token, KV head, split) computes all group = Q / K query heads of that KV head, so each key and
// value row is read from memory once for the group instead of once per query head.
//   G: group rounded up to 1, 2, 4, 8 or 16 (heads group .. G - 1 are padding: zero q, never written).
//   G * DPL <= 64 floats of q and as many of accumulators per lane (the backend uses paged_attention beyond).
//   VW = min(DPL, 4): D a multiple of VW and key_cache, value_cache aligned to VW elements; lane l holds dims
//   (c * 32 + l) * VW .. + VW - 1 (c < DPL / VW), each row read with VW-element vector loads.
//   grid: (T, K, S), block: GQA_WARPS * 32 threads, dynamic shared memory: GQA_WARPS * G * D floats (at most
//   32 KiB: G * D <= 32 * G * DPL <= 2048), plus under 4 KiB static. ptxas (sm_90): 128 registers at G * DPL = 32
//   (Qwen3 <4, 8>, Mixtral <4, 4>), up to 237 at 64 (<4, 16>, <8, 8>), no spills there (4-24 bytes at
//   <1, 8>, <1, 16>, <2, 2>, <2, 16>).
//   Token t's keys first .. p (first = max(0, p - window + 1) with a window, else 0: n = p - first + 1 keys) are
//   cut into S_t = clamp(ceil(n / split_keys), 1, S) splits (decode_splits): a short context uses few of the launch's
//   S blocks, whose others return at once, so one launch shape (a captured graph's) serves every length.
//   Split z < S_t takes the contiguous keys [lo, hi) = [first + z * span, min(p + 1, first + (z + 1) * span)),
//   span = ceil(n / S_t) (a split may be empty).
//   Inside a split, warp w takes the chunks of U = gqa_unroll(G, DPL) keys starting at lo + (w + GQA_WARPS * i) * U:
//   the U key and value rows are all loaded before use; for each key the lane's G partial dot products are summed
//   over the warp by a reduce-scatter butterfly (G - 1 + log2(32 / G) shuffles), after which the 32 / G lanes
//   l >> (5 - log2 G) == g hold head g's score; each lane keeps head g's online softmax (m, l), and the
//   probabilities and rescale factors reach every lane through a per-warp shared-memory buffer (broadcast reads).
//   The warps' (m, l, acc) are merged per head in shared memory at the end (a warp without keys, m = -inf, gets
//   weight 0, never exp(-inf - -inf)).
//   S_t == 1: the block writes out. S_t > 1: it writes its split's unnormalised partial (m, l, acc) for heads
//   h = k * group + g:
//     partial_acc float32 [T, Q, S, D], partial_ml float32 [T, Q, S, 2] (m = -inf, l = 0, acc = 0 for an empty
//     split; split 0 always holds key `first`; splits z >= S_t are not written)
//   and paged_attention_merge combines them: same math, one more launch. The backend picks S from shapes only
//   (a captured graph replays it for every context length): enough blocks to fill the GPU, capped.
//
// paged_attention_merge: out[t, h] = sum_s acc_s exp(m_s - M) / (sum_s l_s exp(m_s - M) + exp(sinks[h] - M)) (no sink
//   term where sinks is null), M = max_s m_s over the token's S_t splits (empty splits weigh 0; S_t == 1: nothing to
//   do, the GQA block wrote out). grid: (T, Q), block: MERGE_WARPS * 32 threads, static shared memory only; D at most
//   MERGE_MAX_DIM; max_splits = S (at most MERGE_MAX_SPLITS), window and split_keys as the GQA launch's, sinks as
//   paged_attention's. Warp w sums the splits w, w + MERGE_WARPS, ... (lane l dims l, l + 32, ...: each load of a warp
//   is one row segment), the warps' sums are added in shared memory.
#include "kv_types.cuh"

constexpr int ATTN_WARPS = 16;
constexpr int ATTN_UNROLL = 8;
constexpr int MERGE_MAX_SPLITS = 1024;  // splits a merge takes at most
constexpr int MERGE_WARPS = 8;          // warps of a merge block, each summing every MERGE_WARPS-th split
constexpr int MERGE_MAX_DIM = 512;      // head dims a merge takes at most: 16 per lane (latent_attention's 512)

template <typename KV, int DPL>
__global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention(const float* __restrict__ q, const KV* __restrict__ key_cache,
                const KV* __restrict__ value_cache, const long long* __restrict__ block_tables,
                const long long* __restrict__ query_start, const long long* __restrict__ positions,
                float* __restrict__ out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                int block_size, int max_blocks, float scale, int window, float v_scale,
                const float* __restrict__ sinks) {
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
        const KV* k_rows[ATTN_UNROLL];
        const KV* v_rows[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int j = j0 + u <= pos ? j0 + u : j0;  // past the end: re-read a valid row, masked below
            const long long slot = table[j / block_size] * block_size + j % block_size;
            k_rows[u] = key_cache + slot * slot_stride + kv_head * head_dim;
            v_rows[u] = value_cache + slot * slot_stride + kv_head * head_dim;
        }
        // Up to 4 dims a lane, the step's keys and values are all loaded before any is used: one memory round trip
        // a step instead of two (101 registers at DPL = 4); at 8 the values are read after the scores (registers).
        constexpr bool VALUES_AHEAD = DPL <= 4;
        float kv[ATTN_UNROLL][DPL], vv[ATTN_UNROLL][DPL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                kv[u][i] = d < head_dim ? to_float(k_rows[u][d]) : 0.f;
                if constexpr (VALUES_AHEAD) vv[u][i] = d < head_dim ? to_float(v_rows[u][d]) : 0.f;
            }
        }
        float s[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) dot = fmaf(qv[i], kv[u][i], dot);  // qv is 0 past head_dim
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
                if (d < head_dim) acc[i] = fmaf(p, VALUES_AHEAD ? vv[u][i] : to_float(v_rows[u][d]), acc[i]);
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
    float total = sinks != nullptr ? expf(sinks[h] - total_max) : 0.f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) total += warp_sum_s[w] * expf(warp_max_s[w] - total_max);
    float* out_row = out + (static_cast<long long>(t) * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) a += merged[w * head_dim + d] * expf(warp_max_s[w] - total_max);
        out_row[d] = a * v_scale / total;
    }
}

constexpr int GQA_WARPS = 4;

// Keys per warp step of paged_attention_gqa: the U key and value rows (2 * U * DPL floats a lane) are loaded at
// once; fewer when q and the accumulators already hold many registers.
__host__ __device__ constexpr int gqa_unroll(int g, int dpl) {
    int u = 128 / (g * dpl);
    if (u > 32 / dpl) u = 32 / dpl;
    return u < 2 ? 2 : u > 8 ? 8 : u;
}

__host__ __device__ constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }

// Two 16-bit elements (bf16 or fp16) as one 32-bit word -> two floats.
__device__ __forceinline__ void widen_pair(unsigned bits, const __nv_bfloat16*, float* out) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
    out[0] = f.x; out[1] = f.y;
}
__device__ __forceinline__ void widen_pair(unsigned bits, const __half*, float* out) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
    out[0] = f.x; out[1] = f.y;
}

// VW consecutive elements of a key or value row (VW-element aligned) widened to float, through the read-only path:
// one vector load of VW * sizeof(KV) bytes.
template <int VW, typename KV>
__device__ __forceinline__ void load_row_floats(const KV* __restrict__ p, float* out) {
    if constexpr (sizeof(KV) == 1) {  // __nv_fp8_e4m3: VW bytes
        const __nv_fp8_e4m3* e = reinterpret_cast<const __nv_fp8_e4m3*>(p);
        if constexpr (VW == 4) {
            const unsigned bits = __ldg(reinterpret_cast<const unsigned*>(p));
            e = reinterpret_cast<const __nv_fp8_e4m3*>(&bits);
#pragma unroll
            for (int i = 0; i < 4; ++i) out[i] = to_float(e[i]);
        } else if constexpr (VW == 2) {
            const unsigned short bits = __ldg(reinterpret_cast<const unsigned short*>(p));
            e = reinterpret_cast<const __nv_fp8_e4m3*>(&bits);
            out[0] = to_float(e[0]); out[1] = to_float(e[1]);
        } else {
            out[0] = to_float(e[0]);
        }
    } else if constexpr (sizeof(KV) == 4) {  // float
        if constexpr (VW == 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(p));
            out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
        } else if constexpr (VW == 2) {
            const float2 v = __ldg(reinterpret_cast<const float2*>(p));
            out[0] = v.x; out[1] = v.y;
        } else {
            out[0] = __ldg(p);
        }
    } else {  // __nv_bfloat16, __half
        if constexpr (VW == 4) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
            widen_pair(v.x, p, out); widen_pair(v.y, p, out + 2);
        } else if constexpr (VW == 2) {
            widen_pair(__ldg(reinterpret_cast<const unsigned*>(p)), p, out);
        } else {
            out[0] = to_float(p[0]);
        }
    }
}

// w[g] = p[g] for g < G, p in shared memory (16-byte aligned when G >= 4): every lane reads the same address.
template <int G>
__device__ __forceinline__ void read_heads(const float* p, float (&w)[G]) {
    if constexpr (G >= 4) {
#pragma unroll
        for (int k = 0; k < G / 4; ++k) {
            const float4 v = reinterpret_cast<const float4*>(p)[k];
            w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int g = 0; g < G; ++g) w[g] = p[g];
    }
}

// One halving step of reduce_scatter: v[0..N) -> v[0..N/2), the lane keeping the upper half when its bit OFFSET
// is set; each sum is over this lane and the one OFFSET away.
template <int N, int OFFSET, int G>
__device__ __forceinline__ void halve(float (&v)[G], int lane) {
    if constexpr (N > 1) {
        const bool upper = lane & OFFSET;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const float keep = upper ? v[i + N / 2] : v[i];
            const float send = upper ? v[i] : v[i + N / 2];
            v[i] = keep + __shfl_xor_sync(FULL_MASK, send, OFFSET);
        }
        halve<N / 2, OFFSET / 2, G>(v, lane);
    }
}

// Sum each of v[0..G) over the warp's 32 lanes; returns, in lane l, the sum of v[l >> (5 - log2 G)] (the same
// value, bit for bit, in the 32 / G lanes of one head: every addition pairs the same two operands). The halving
// steps take G / 2 + G / 4 + ... + 1 shuffles (offsets 16, 8, ...), then log2(32 / G) more finish the sum.
template <int G>
__device__ __forceinline__ float reduce_scatter(float (&v)[G], int lane) {
    halve<G, 16, G>(v, lane);
    float s = v[0];
#pragma unroll
    for (int offset = 16 / G; offset > 0; offset /= 2) s += __shfl_xor_sync(FULL_MASK, s, offset);
    return s;
}

template <typename KV, int DPL, int G>
__global__ void __launch_bounds__(GQA_WARPS * 32)
paged_attention_gqa(const float* __restrict__ q, const KV* __restrict__ key_cache,
                    const KV* __restrict__ value_cache, const long long* __restrict__ block_tables,
                    const long long* __restrict__ query_start, const long long* __restrict__ positions,
                    float* __restrict__ out, float* __restrict__ partial_acc, float* __restrict__ partial_ml,
                    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                    float scale, int window, float v_scale, const float* __restrict__ sinks, int split_keys) {
    pdl_wait();
    constexpr int VW = DPL < 4 ? DPL : 4;  // elements per vector load
    constexpr int NV = DPL / VW;           // vector loads per row and lane
    constexpr int U = gqa_unroll(G, DPL);
    constexpr int LOG_G = log2_of(G);
    static_assert((1 << LOG_G) == G && G <= 16, "G is a power of two up to 16");
    extern __shared__ float merged[];  // [GQA_WARPS, G, head_dim]: each warp's accumulators
    __shared__ __align__(16) float bcast[GQA_WARPS][U + 1][G];  // per warp: p of each key, then the rescale
    __shared__ float warp_max_s[GQA_WARPS][G], warp_sum_s[GQA_WARPS][G], weight_s[GQA_WARPS][G], total_max_s[G],
        total_s[G];
    const int t = blockIdx.x, kv = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = lane >> (5 - LOG_G);  // the head whose score and softmax state this lane holds
    const int group = num_heads / num_kv_heads;

    const DecodeSplit range = decode_split(static_cast<int>(positions[t]), window, split_keys, split, gridDim.z);
    if (split >= range.splits) return;  // the token's splits are fewer than the launch's: this block is idle
    const int splits = range.splits, lo = range.lo, hi = range.hi;  // this split's keys [lo, hi)
    const long long* table = decode_table(t, num_seqs, query_start, block_tables, max_blocks);
    const long long slot_stride = static_cast<long long>(num_kv_heads) * head_dim;
    const long long kv_offset = static_cast<long long>(kv) * head_dim;

    float qv[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* q_row = q + (static_cast<long long>(t) * num_heads + kv * group + min(g, group - 1)) * head_dim;
#pragma unroll
        for (int c = 0; c < NV; ++c) {
#pragma unroll
            for (int e = 0; e < VW; ++e) {
                const int d = (c * 32 + lane) * VW + e;
                qv[g][c * VW + e] = g < group && d < head_dim ? q_row[d] * scale : 0.f;
            }
        }
    }

    float m = neg_inf(), l = 0.f, acc[G][DPL] = {};
    float* bc = &bcast[warp][0][0];
    for (int j0 = lo + warp * U; j0 < hi; j0 += GQA_WARPS * U) {
        float kr[U][DPL], vr[U][DPL];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u < hi ? j0 + u : j0;  // past the split's end: re-read a valid row, masked below
            const long long slot = table[j / block_size] * block_size + j % block_size;
            const KV* k_row = key_cache + slot * slot_stride + kv_offset;
            const KV* v_row = value_cache + slot * slot_stride + kv_offset;
#pragma unroll
            for (int c = 0; c < NV; ++c) {
                const int d = (c * 32 + lane) * VW;
                if (d < head_dim) {
                    load_row_floats<VW>(k_row + d, &kr[u][c * VW]);
                    load_row_floats<VW>(v_row + d, &vr[u][c * VW]);
                } else {
#pragma unroll
                    for (int e = 0; e < VW; ++e) kr[u][c * VW + e] = vr[u][c * VW + e] = 0.f;
                }
            }
        }
        float s[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                dot[g] = 0.f;
#pragma unroll
                for (int i = 0; i < DPL; ++i) dot[g] = fmaf(qv[g][i], kr[u][i], dot[g]);
            }
            const float score = reduce_scatter<G>(dot, lane);
            s[u] = j0 + u < hi ? score : neg_inf();
        }
        float m_new = m;
#pragma unroll
        for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[u]);
        const float correction = expf(m - m_new);  // m_new is finite: key j0 < hi is valid
        float p[U], p_sum = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            p[u] = expf(s[u] - m_new);
            p_sum += p[u];
        }
        l = l * correction + p_sum;
        m = m_new;
        if (lane % (32 / G) == 0) {  // one lane per head publishes its head's values
#pragma unroll
            for (int u = 0; u < U; ++u) bc[u * G + head] = p[u];
            bc[U * G + head] = correction;
        }
        __syncwarp();
        float w[G];
        read_heads<G>(bc + U * G, w);
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] *= w[g];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            read_heads<G>(bc + u * G, w);
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] = fmaf(w[g], vr[u][i], acc[g][i]);
            }
        }
        __syncwarp();  // every lane has read bc before the next step rewrites it
    }

    // Merge the warps per head: weight exp(m_w - M) for a warp with keys, 0 for one without.
    if (lane % (32 / G) == 0) { warp_max_s[warp][head] = m; warp_sum_s[warp][head] = l; }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int c = 0; c < NV; ++c) {
            const int d = (c * 32 + lane) * VW;
            if (d < head_dim) {
#pragma unroll
                for (int e = 0; e < VW; ++e) merged[(warp * G + g) * head_dim + d + e] = acc[g][c * VW + e];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < G) {
        const int g = threadIdx.x;
        float top = neg_inf();
#pragma unroll
        for (int w = 0; w < GQA_WARPS; ++w) top = fmaxf(top, warp_max_s[w][g]);
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; ++w) {
            const float weight = warp_max_s[w][g] == neg_inf() ? 0.f : expf(warp_max_s[w][g] - top);
            weight_s[w][g] = weight;
            total += warp_sum_s[w][g] * weight;
        }
        total_s[g] = total;
        total_max_s[g] = top;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) {
        const int g = e / head_dim, d = e % head_dim;
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; ++w) a = fmaf(merged[(w * G + g) * head_dim + d], weight_s[w][g], a);
        a *= v_scale;
        const long long row = static_cast<long long>(t) * num_heads + kv * group + g;  // [T, Q]
        if (splits == 1) {  // key `first` is this block's: total_s[g] >= 1
            const float sink = sinks != nullptr ? expf(sinks[kv * group + g] - total_max_s[g]) : 0.f;
            out[row * head_dim + d] = a / (total_s[g] + sink);
        } else {
            const long long part = row * gridDim.z + split;  // [T, Q, S]
            partial_acc[part * head_dim + d] = a;
            if (d == 0) { partial_ml[2 * part] = total_max_s[g]; partial_ml[2 * part + 1] = total_s[g]; }
        }
    }
}

__global__ void __launch_bounds__(MERGE_WARPS * 32)
paged_attention_merge(const float* __restrict__ partial_acc, const float* __restrict__ partial_ml,
                      float* __restrict__ out, const long long* __restrict__ positions, int head_dim,
                      int max_splits, int window, int split_keys, const float* __restrict__ sinks) {
    pdl_wait();
    constexpr int DIMS_PER_LANE = MERGE_MAX_DIM / 32;
    __shared__ float weight_s[MERGE_MAX_SPLITS];  // exp(m_s - M) of each split, 0 for an empty one
    __shared__ float sum_s[MERGE_WARPS][MERGE_MAX_DIM];  // each warp's weighted sum of its splits' partials
    const int splits = decode_split(static_cast<int>(positions[blockIdx.x]), window, split_keys, 0, max_splits).splits;
    if (splits == 1) return;  // paged_attention_gqa wrote out
    const long long row = static_cast<long long>(blockIdx.x) * gridDim.y + blockIdx.y;  // t * Q + h
    const float* ml = partial_ml + row * max_splits * 2;
    // The splits' (m, l) are read once, a split per thread, and reduced over the block.
    float top = neg_inf();
    for (int s = threadIdx.x; s < splits; s += blockDim.x) top = fmaxf(top, ml[2 * s]);
    top = block_max(top);  // finite: split 0 holds key `first`
    float total = 0.f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float m = ml[2 * s], weight = m == neg_inf() ? 0.f : expf(m - top);
        weight_s[s] = weight;
        total += ml[2 * s + 1] * weight;
    }
    total = block_sum(total);  // its barrier also publishes weight_s
    if (sinks != nullptr) total += expf(sinks[blockIdx.y] - top);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* acc = partial_acc + row * max_splits * head_dim;  // [S, D]
    float a[DIMS_PER_LANE] = {};  // dims lane + 32 j
#pragma unroll 4
    for (int s = warp; s < splits; s += MERGE_WARPS) {
        const float weight = weight_s[s];
#pragma unroll
        for (int j = 0; j < DIMS_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            if (d < head_dim) a[j] = fmaf(acc[s * head_dim + d], weight, a[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < DIMS_PER_LANE; ++j) {
        if (lane + 32 * j < head_dim) sum_s[warp][lane + 32 * j] = a[j];
    }
    __syncthreads();
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; ++w) sum += sum_s[w][d];
        out[row * head_dim + d] = sum / total;
    }
}
