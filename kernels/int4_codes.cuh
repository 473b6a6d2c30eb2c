// 4-bit codes as the int4 expert kernels (moe_int4.cu on tensor cores, moe_int4_gemv.cu on CUDA cores) multiply
// them: a format's codes policy, and the activations' int8 parts that quantize_activations (moe_int4.cu) cuts.
//
// A 32-bit word of codes holds 8 columns, the even column of each pair in the low nibble. `columns` turns it into
// two words of 8-bit values: columns 0, 2, 4, 6 and columns 1, 3, 5, 7, byte n the n-th of them. The activations'
// parts are stored in that order (each 8 columns as 0, 2, 4, 6, 1, 3, 5, 7), so a word of codes meets its two words
// of activations as they lie. `scale` is a group's scale in float32, SYMMETRIC_ZERO the zero point of codes without
// zero points, SIGNED whether the values are signed bytes.
#pragma once
#include "common.cuh"

constexpr int QUANT_LO = 254;  // lo's unit: 1 / 254 of hi's (the residual of rounding, in [-1/2, 1/2], in int8)

// prmt.b32 in its default mode: byte n of the result is byte (c >> 4n) & 7 of {b, a}, or, where bit 3 of that
// selector is set, that byte's sign bit copied over all 8 bits.
__device__ __forceinline__ unsigned permute_bytes(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// int4: unsigned codes q, taken as they are (a mask of the word); float32 scales.
struct Int4Codes {
    using Scale = float;
    static constexpr int SYMMETRIC_ZERO = 8;
    static constexpr bool SIGNED = false;
    __device__ __forceinline__ static float scale(Scale s) { return s; }
    __device__ __forceinline__ static void columns(unsigned w, unsigned& even, unsigned& odd) {
        even = w & 0x0F0F0F0Fu;
        odd = (w >> 4) & 0x0F0F0F0Fu;
    }
};

// mxfp4 (OCP microscaling, gpt-oss's experts): e2m1 codes (sign, two exponent bits, one mantissa bit) as twice
// their value, integers in [-12, 12], looked up by byte permutes; signed bytes; an e8m0 exponent byte E per 32
// columns, whose scale 2^(E - 127) is halved for the doubled values.
struct Mxfp4Codes {
    using Scale = unsigned char;
    static constexpr int SYMMETRIC_ZERO = 0;
    static constexpr bool SIGNED = true;
    __device__ __forceinline__ static float scale(Scale e) {  // 2^(e - 128), subnormal below e = 2
        return __uint_as_float(e >= 2 ? static_cast<unsigned>(e - 1) << 23 : 0x00400000u >> (1 - e));
    }
    // The doubled values of the 4 codes in the low 16 bits of `codes` (nibble n: column n), byte n each.
    __device__ __forceinline__ static unsigned values4(unsigned codes) {
        constexpr unsigned POSITIVE_LOW = 0x03020100u, POSITIVE_HIGH = 0x0C080604u;  // 0, 1, 2, 3 | 4, 6, 8, 12
        constexpr unsigned NEGATIVE_LOW = 0xFDFEFF00u, NEGATIVE_HIGH = 0xF4F8FAFCu;  // their negatives
        const unsigned index = codes & 0x7777u;
        const unsigned positive = permute_bytes(POSITIVE_LOW, POSITIVE_HIGH, index);
        const unsigned negative = permute_bytes(NEGATIVE_LOW, NEGATIVE_HIGH, index);
        const unsigned sign = permute_bytes(0x80808080u, 0x80808080u, codes) & 0x7F7F7F7Fu;  // 0x7F where negative
        const unsigned negated = sign | (sign << 1);  // 0xFF where negative
        return (positive & ~negated) | (negative & negated);
    }
    __device__ __forceinline__ static void columns(unsigned w, unsigned& even, unsigned& odd) {
        const unsigned low = values4(w), high = values4(w >> 16);  // columns 0-3, 4-7
        even = permute_bytes(low, high, 0x6420u);
        odd = permute_bytes(low, high, 0x7531u);
    }
};

// A launch's activation rows as quantize_activations left them: hi, lo [rows, W], scale, corr [rows, chunks].
struct QuantActs {
    const signed char* hi;
    const signed char* lo;
    const float* scale;
    const int* corr;
    int W;
    int chunks;
};

// x [rows, W] float32 to int8 high and low parts per chunk of 8 * B columns, with their scale and C.
template <int B>
__global__ void __launch_bounds__(128)
quantize_activations(const float* __restrict__ x, int W, signed char* __restrict__ hi, signed char* __restrict__ lo,
                     float* __restrict__ scale, int* __restrict__ corr) {
    pdl_wait();
    constexpr int LANES = B;  // threads of 8 columns per chunk (CHUNK = 8 * B)
    const long long row = blockIdx.y;
    const int col = (blockIdx.x * 128 + threadIdx.x) * 8;
    const bool in = col < W;
    float v[8];
    if (in) {
        load_floats<8>(x + row * W + col, v);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
    float top = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) top = fmaxf(top, fabsf(v[j]));
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(FULL_MASK, top, offset));
    const float inverse = top > 0.f ? 127.f / top : 0.f;
    unsigned hi_words[2] = {0u, 0u}, lo_words[2] = {0u, 0u};  // columns 0, 2, 4, 6 then 1, 3, 5, 7
    int sum = 0;  // 254 * sum hi + sum lo over this thread's columns
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float u = v[j] * inverse;  // in [-127, 127]
        const float h = rintf(u);
        const int l = __float2int_rn((u - h) * QUANT_LO);  // in [-127, 127]
        const int hv = static_cast<int>(h);
        sum += QUANT_LO * hv + l;
        hi_words[j % 2] |= (static_cast<unsigned>(hv) & 0xffu) << (8 * (j / 2));
        lo_words[j % 2] |= (static_cast<unsigned>(l) & 0xffu) << (8 * (j / 2));
    }
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    if (!in) return;
    *reinterpret_cast<uint2*>(hi + row * W + col) = make_uint2(hi_words[0], hi_words[1]);
    *reinterpret_cast<uint2*>(lo + row * W + col) = make_uint2(lo_words[0], lo_words[1]);
    if (threadIdx.x % LANES == 0) {
        const int chunks = (W + 8 * B - 1) / (8 * B);
        const int chunk = col / (8 * B);
        scale[row * chunks + chunk] = top * (1.f / (127.f * QUANT_LO));  // lo's unit
        corr[row * chunks + chunk] = sum;
    }
}
