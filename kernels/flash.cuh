// Building blocks of the flash-style attention kernels (flash_attention.cu's prefill and decode kernels,
// latent_attention.cu's latent decode): float32 operands split into two 16-bit parts, shared-memory fragment loads,
// the online softmax of a warp's C-fragment rows, and fp8 e4m3 cache rows widened to __half for the mma.
#pragma once
#include "kv_types.cuh"
#include "mma.cuh"

constexpr float LOG2_E = 1.4426950408889634f;  // scores in base-2 units: times scale * LOG2_E
constexpr int FLASH_PAD = 8;     // bf16 of padding per shared row (16 bytes)

// Two floats as pairs of T (bf16 or fp16): hi their rounding, lo the rounding of what hi leaves (a + b = hi + lo
// to ~16 bits).
template <typename T>
__device__ __forceinline__ void split_pair_as(float a, float b, unsigned& hi, unsigned& lo) {
    using M = Mma<T>;
    hi = M::pack(a, b);
    const float2 rounded = M::unpack(hi);
    lo = M::pack(a - rounded.x, b - rounded.y);
}
__device__ __forceinline__ void split_pair(float a, float b, unsigned& hi, unsigned& lo) {
    split_pair_as<__nv_bfloat16>(a, b, hi, lo);
}

// The four 8 x 8 bf16 matrices whose rows start at the addresses lanes 0-7, 8-15, 16-23 and 24-31 give, transposed.
__device__ __forceinline__ void load_matrices_transposed(const __nv_bfloat16* row, unsigned (&r)[4]) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ unsigned shared_pair(const __nv_bfloat16* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Max (or sum) over the 4 lanes of a quad: the lanes holding one C-fragment row.
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// One tile's step of the online softmax for a warp's rows r and r + 8 (the two halves of m, l and o): the running
// maxima m (log2 units) raised by the tile's (tile_max, this lane's columns; the quad's maximum is taken here), the
// row sums l and accumulators o rescaled to them; reference: what the tile's probabilities are taken against, the
// new maximum, or 0 for a row with no visible key yet (its p are 0, not NaN).
template <int DTILES>
__device__ __forceinline__ void online_softmax_step(float (&m)[2], float (&l)[2], float (&o)[DTILES][4],
                                                    const float (&tile_max)[2], float (&reference)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], quad_max(tile_max[h]));
        reference[h] = m_new == neg_inf() ? 0.f : m_new;
        const float correction = exp2f(m[h] - reference[h]);  // 0 while m is -inf
        l[h] *= correction;
#pragma unroll
        for (int n = 0; n < DTILES; ++n) {
            o[n][2 * h] *= correction;
            o[n][2 * h + 1] *= correction;
        }
        m[h] = m_new;
    }
}

// The tile's scores s (log2 units) of a warp's rows r (s[n][0], s[n][1]) and r + 8 (s[n][2], s[n][3]) turned into
// their probabilities exp2(s - reference) in place, each added to the lane's row sum l.
template <int NT>
__device__ __forceinline__ void exponentiate(float (&s)[NT][4], const float (&reference)[2], float (&l)[2]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] = exp2f(s[n][e] - reference[e / 2]);
            l[e / 2] += s[n][e];
        }
    }
}

// P's A fragment for the k-step over the tile's keys 16k .. 16k + 15: the C fragments of score n-tiles 2k and
// 2k + 1 as they stand (rows r, r + 8; keys 2c.., 2c + 8..), in high and low parts of T.
template <typename T, int NT>
__device__ __forceinline__ void probability_fragment(const float (&s)[NT][4], int k, unsigned (&ph)[4],
                                                     unsigned (&pl)[4]) {
    split_pair_as<T>(s[2 * k][0], s[2 * k][1], ph[0], pl[0]);
    split_pair_as<T>(s[2 * k][2], s[2 * k][3], ph[1], pl[1]);
    split_pair_as<T>(s[2 * k + 1][0], s[2 * k + 1][1], ph[2], pl[2]);
    split_pair_as<T>(s[2 * k + 1][2], s[2 * k + 1][3], ph[3], pl[3]);
}

// O += P V over a tile of KEYS keys: P the tile's probabilities as C fragments s (rows r, r + 8 of the warp's 16)
// packed to T (with SPLIT their low parts too, the products summed), V's rows [KEYS][...] of T in shared memory at
// `values` with `stride` elements a row, read transposed by ldmatrix from this lane's `value_at` (its row of the 8 x 8
// matrix lane / 8: keys + 8 for bit 0, dims + 8 for bit 1); DTILES n-tiles of 8 output dims.
template <typename T, bool SPLIT, int NT, int DTILES>
__device__ __forceinline__ void add_values(const float (&s)[NT][4], const __nv_bfloat16* values, int value_at,
                                           int stride, float (&o)[DTILES][4]) {
    using M = Mma<T>;
#pragma unroll
    for (int k = 0; k < NT / 2; ++k) {  // k-step over keys 16k .. 16k + 15
        unsigned ph[4], pl[4];
        probability_fragment<T>(s, k, ph, pl);
#pragma unroll
        for (int n = 0; n < DTILES / 2; ++n) {  // dims 16n .. 16n + 15: output n-tiles 2n, 2n + 1
            unsigned b[4];
            load_matrices_transposed(&values[value_at + k * 16 * stride + n * 16], b);
            M::mma(o[2 * n], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
            M::mma(o[2 * n + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
            if constexpr (SPLIT) {
                M::mma(o[2 * n], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
                M::mma(o[2 * n + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
            }
        }
    }
}

// The mma operand type of a decode cache's elements: themselves for the 16-bit types, __half for fp8 e4m3.
template <typename KV> struct DecodeOperand { using type = KV; };
template <> struct DecodeOperand<__nv_fp8_e4m3> { using type = __half; };

// Sixteen fp8 e4m3 codes (one 16-byte load) as sixteen __half values, exactly: out[0] the first eight, out[1] the
// rest, in order.
__device__ __forceinline__ void fp8x16_to_half(const uint4 bytes, uint4 (&out)[2]) {
    const unsigned words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    unsigned halves[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // four e4m3 codes a word, two at a time to __half2
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[w] & 0xffffu),
                                                          __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[w] >> 16),
                                                          __NV_E4M3);
        halves[2 * w] = static_cast<unsigned>(lo.x) | static_cast<unsigned>(lo.y) << 16;
        halves[2 * w + 1] = static_cast<unsigned>(hi.x) | static_cast<unsigned>(hi.y) << 16;
    }
    out[0] = make_uint4(halves[0], halves[1], halves[2], halves[3]);
    out[1] = make_uint4(halves[4], halves[5], halves[6], halves[7]);
}
