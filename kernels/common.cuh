// Helpers shared by the kernels: 16-byte weight loads widened to float, scalar conversions, warp and block sums.
//
// Storage types W of weights: float, __nv_bfloat16, __half, signed char (int8, scaled per row by the caller).
// Vec<W>::N elements fill one 16-byte load, so a row read with Vec<W> must start 16-byte aligned: its length in
// elements is a multiple of Vec<W>::N (the backend checks this before launching).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A routed expert's gated activation (experts/jit.py's `gated`): the gate and up biases of the expert's slot added
// (null: none), the gate clamped above at limit and up to +-limit, then gate * sigmoid(alpha * gate) * (up +
// up_shift). silu(gate) * up is limit = inf, alpha = 1, up_shift = 0; gpt-oss's clamped SwiGLU is (swiglu_limit,
// swiglu_alpha, 1). The MoE kernels take it as six arguments: gate_bias, up_bias (float32 [slots, I] at bias_stride,
// or null), bias_stride, limit, alpha, up_shift.
struct GatedActivation {
    const float* gate_bias;
    const float* up_bias;
    long long bias_stride;
    float limit, alpha, up_shift;

    __device__ __forceinline__ float operator()(long long slot, int row, float gate, float up) const {
        if (gate_bias != nullptr) {
            gate += gate_bias[slot * bias_stride + row];
            up += up_bias[slot * bias_stride + row];
        }
        gate = fminf(gate, limit);
        up = fmaxf(fminf(up, limit), -limit);
        return gate / (1.f + expf(-alpha * gate)) * (up + up_shift);
    }
};

// Programmatic dependent launch (colibri_stream/backends/launch.py): inside a captured decode step a kernel may be
// launched while the kernel before it still runs. pdl_wait() returns once that kernel has completed and its writes
// are visible, then lets the next kernel launch; every kernel calls it, in every thread, before it reads anything an
// earlier kernel wrote or writes anything (an earlier kernel may still read it). Before it, a kernel only reads
// weights. For a kernel launched normally both instructions do nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The slot holding expert e: slot_of[e] with a slot table (negative: not in a slot for this pass), else e.
__device__ __forceinline__ long long expert_slot(const int* slot_of, int e) {
    return slot_of != nullptr ? slot_of[e] : e;
}

// Group g of a routed-expert launch (moe.cu's moe_align): its pairs sorted_pairs[begin .. end) and its expert's
// slot; slot < 0 where the block has nothing to do (g past the step's groups, or the expert not in a slot for
// this pass). The four indices are loaded together, so their latencies overlap (g < E: in bounds even past the
// last group).
struct ExpertGroup {
    long long slot;
    int begin, end;
};
__device__ __forceinline__ ExpertGroup expert_group(int g, const int* num_groups, const int* group_expert,
                                                    const int* group_start, const int* slot_of) {
    const int groups = num_groups[0], expert = group_expert[g], begin = group_start[g], end = group_start[g + 1];
    if (g >= groups) return {-1, 0, 0};
    return {expert_slot(slot_of, expert), begin, end};
}

// Ask the L2 to fetch `bytes` (a multiple of 16) of global memory from p (16-byte aligned), without waiting: what a
// kernel does with its weights before pdl_wait(), so they stream in while the kernel before it ends.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The splits a decode token's `keys` keys are cut into (attention.cu's paged_attention_gqa and merge,
// flash_attention.cu's flash_decode): about split_keys keys each, at most max_splits (the launch's), at least 1.
__device__ __forceinline__ int decode_splits(int keys, int split_keys, int max_splits) {
    return max(1, min(max_splits, (keys + split_keys - 1) / split_keys));
}

// Split `split` of a decode token at position pos: the token's number of splits (decode_splits over its
// n = pos - first + 1 keys, first = max(0, pos - window + 1) with a window, else 0) and the split's keys [lo, hi),
// contiguous runs of ceil(n / splits) keys (the last ones may be short or empty).
struct DecodeSplit {
    int splits, lo, hi;
};
__device__ __forceinline__ DecodeSplit decode_split(int pos, int window, int split_keys, int split, int max_splits) {
    const int first = window > 0 ? max(0, pos - window + 1) : 0;
    const int splits = decode_splits(pos - first + 1, split_keys, max_splits);
    const int span = (pos - first + splits) / splits;  // ceil(n / splits) >= 1
    const int lo = first + split * span;
    return {splits, lo, min(pos + 1, lo + span)};
}

// The block table row [max_blocks] of decode token t's sequence: t itself where query_start[t] == t (one token
// per sequence, a decode step's layout), else the last b with query_start[b] <= t.
__device__ __forceinline__ const long long* decode_table(int t, int num_seqs, const long long* __restrict__ query_start,
                                                         const long long* __restrict__ block_tables, int max_blocks) {
    int b = t;
    if (t >= num_seqs || query_start[t] != t) {
        int lo = 0, hi = num_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
        }
        b = lo;
    }
    return block_tables + static_cast<long long>(b) * max_blocks;
}

template <typename W> struct Vec;

template <> struct Vec<float> {
    static constexpr int N = 4;
    using Raw = float4;
    __device__ __forceinline__ static Raw fetch(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
    __device__ __forceinline__ static void widen(const Raw& v, float* out) {
        out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    }
    __device__ __forceinline__ static void load(const float* p, float* out) { widen(fetch(p), out); }
};

template <> struct Vec<__nv_bfloat16> {
    static constexpr int N = 8;
    using Raw = uint4;
    __device__ __forceinline__ static Raw fetch(const __nv_bfloat16* p) {
        return __ldg(reinterpret_cast<const uint4*>(p));
    }
    __device__ __forceinline__ static void widen(const Raw& raw, float* out) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(pairs[i]);
            out[2 * i] = f.x; out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ static void load(const __nv_bfloat16* p, float* out) { widen(fetch(p), out); }
};

template <> struct Vec<__half> {
    static constexpr int N = 8;
    using Raw = uint4;
    __device__ __forceinline__ static Raw fetch(const __half* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
    __device__ __forceinline__ static void widen(const Raw& raw, float* out) {
        const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(pairs[i]);
            out[2 * i] = f.x; out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ static void load(const __half* p, float* out) { widen(fetch(p), out); }
};

template <> struct Vec<signed char> {
    static constexpr int N = 16;
    using Raw = uint4;
    __device__ __forceinline__ static Raw fetch(const signed char* p) {
        return __ldg(reinterpret_cast<const uint4*>(p));
    }
    __device__ __forceinline__ static void widen(const Raw& raw, float* out) {
        const signed char* bytes = reinterpret_cast<const signed char*>(&raw);
#pragma unroll
        for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(bytes[i]);
    }
    __device__ __forceinline__ static void load(const signed char* p, float* out) { widen(fetch(p), out); }
};

// N consecutive float32 activations (16-byte aligned, N a multiple of 4).
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float* out) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        const float4 v = *reinterpret_cast<const float4*>(p + i);
        out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename W> __device__ __forceinline__ W from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// The largest and the smallest of v over the warp (every lane gets it): one redux instruction from sm_80 on.
__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(FULL_MASK, v);
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
#endif
}

__device__ __forceinline__ unsigned warp_min_u32(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_min_sync(FULL_MASK, v);
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
#endif
}

// op(v) over the whole block (blockDim.x a multiple of 32, at most 1024; op associative and commutative, identity
// its neutral value); every thread gets the result. Uses 32 floats of static shared memory per Op: a second call
// with the same Op must come after a __syncthreads() that follows every thread's use of the first call's result.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float identity, Op op) {
    __shared__ float partial[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : identity;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}

struct AddOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Sum (max) of v over the whole block: block_reduce's rules.
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.f, AddOp()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, neg_inf(), MaxOp()); }

// Dot products of R weight rows (length `cols`, storage W) with TT activation rows of float32, accumulated per
// thread: acc[r][j] += sum over this thread's columns of w_r[c] * x_j[c]. The thread takes the 16-byte chunks at
// columns start, start + step, ... (start and step multiples of Vec<W>::N), so the threads sharing a row read it
// once, coalesced; each weight chunk is loaded once per call and each activation chunk once per R rows. The caller
// reduces acc over the threads. Activation rows j >= n are skipped (their acc is left unchanged).
// AHEAD > 1: the weight chunks of AHEAD steps are loaded (R * AHEAD loads in flight) before any is multiplied, for
// kernels whose few rows a thread would otherwise leave too few loads in flight to cover the memory's latency; the
// products are added in the same order either way.
template <typename W, int R, int TT, int AHEAD = 1>
__device__ __forceinline__ void dot_tile(const W* const* w, const float* const* x, int n, int cols, int start,
                                         int step, float (&acc)[R][TT]) {
    constexpr int V = Vec<W>::N;
    constexpr int UNROLL = TT <= 2 ? 4 : 2;  // more loads in flight when few activation rows share a load
    // one step's products: the weight chunks wv[R][V] at column c times each activation row's chunk
    auto multiply = [&](const float (&wv)[R][V], int c) {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j < n) {
                float xv[V];
                load_floats<V>(x[j] + c, xv);
#pragma unroll
                for (int r = 0; r < R; ++r) {
#pragma unroll
                    for (int v = 0; v < V; ++v) acc[r][j] = fmaf(wv[r][v], xv[v], acc[r][j]);
                }
            }
        }
    };
    int c = start;
    if constexpr (AHEAD > 1) {
        for (; c + (AHEAD - 1) * step < cols; c += AHEAD * step) {
            typename Vec<W>::Raw raw[AHEAD][R];
#pragma unroll
            for (int a = 0; a < AHEAD; ++a) {
#pragma unroll
                for (int r = 0; r < R; ++r) raw[a][r] = Vec<W>::fetch(w[r] + c + a * step);
            }
#pragma unroll
            for (int a = 0; a < AHEAD; ++a) {
                float wv[R][V];
#pragma unroll
                for (int r = 0; r < R; ++r) Vec<W>::widen(raw[a][r], wv[r]);
                multiply(wv, c + a * step);
            }
        }
    }
#pragma unroll UNROLL
    for (; c < cols; c += step) {
        float wv[R][V];
#pragma unroll
        for (int r = 0; r < R; ++r) Vec<W>::load(w[r] + c, wv[r]);
        multiply(wv, c);
    }
}
