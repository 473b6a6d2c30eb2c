// Launch contract
//
// The routed-expert MLP of quantized experts on tensor cores, at every batch size: int4 codes with a float32 scale
// (and, asymmetric, a uint8 zero point) per group of input channels, or fp8 e4m3 codes with a float32 scale per
// 128 x 128 tile or per output channel, in expert_codecs.py's layouts (read in place from experts.bin's blocks in
// GPU slots, or from the stacked arrays of resident experts). The same job, routing (moe.cu's moe_align groups),
// grid layout, tiles of pairs (NT n-tiles of 8) and outputs as moe_mma.cu's kernels.
//
// Numerics: codes convert exactly to bf16 in registers (int4: q - z, an integer in [-15, 15]; e4m3: every value is a
// bf16). They multiply the float32 activations' bf16 high and low parts (moe_mma.cu) on mma.sync.m16n8k16 into a
// float32 partial sum per chunk of columns, and each chunk's partial sum is multiplied by the chunk's scale into the
// accumulator. A chunk lies inside one scale group, so the result is the dot product with the dequantized weights
// w = (q - z) * s, up to the activations' 16 significant bits, as moe_mma.cu's bf16 products.
//
// Chunks: per chunk of F::CHUNK columns, lane (quad = lane / 4, q = lane % 4) copies F::BYTES bytes of codes of each
// of its weight rows (rows quad and quad + 8 of each m-tile), columns chunk * F::CHUNK + q * F::LANE_COLS onward,
// into its slots of a per-lane cp.async ring (MMA_STAGES chunks, as moe_mma.cu). Each 32-bit word of codes feeds
// F::STEPS k16 steps of the mma; inside a step the k order is permuted the same way for the codes and the
// activations (F::column), which leaves the dot product unchanged. int4 chunks are 128, 64 or 32 columns (16, 8 or
// 4 bytes a lane), the largest that divides the group width; fp8 chunks 64 columns (16 bytes a lane).
//
// Scales: the scale of matrix row r at column c is scales[slot * s_stride + (r / row_block) * scale_cols +
// c / col_block]; the same index into zeros (at z_stride per slot) gives an asymmetric int4 group's zero point.
//   int4:             row_block 1, col_block the group width, scale_cols the groups of a row; zeros null when
//                     symmetric (every zero point 8)
//   fp8, 128 x 128:   row_block = col_block = 128, scale_cols ceil(cols / 128); zeros null
//   fp8, per channel: row_block 1, col_block >= cols, scale_cols 1; zeros null
// Rows: row r of a matrix starts r * row_bytes bytes past its slot's codes (int4: groups * width / 2; fp8: cols),
// a multiple of 16; slots are w_stride bytes apart.
//
// moe_gate_up_quant<F, NT>: act[p, i] = silu(gate_e[i] . x[p / k]) * (up_e[i] . x[p / k]) for every pair p of e.
//   x float32 [T, H]; gate, up codes; w_stride, row_bytes; gate_scales, up_scales float32 at s_stride; gate_zeros,
//   up_zeros uint8 at z_stride or null; row_block, col_block, scale_cols; slot_of, routing as moe_gate_up;
//   act float32 [P, I]. grid: (ceil(I / 64), G), block: MMA_THREADS; each warp 16 rows of gate and of up.
//
// moe_down_quant<F, NT>: y[p, h] = route_weight[p] * (down_e[h] . act[p]).
//   act float32 [P, I]; down codes, w_stride, row_bytes, down_scales at s_stride, down_zeros at z_stride or null,
//   row_block, col_block, scale_cols; slot_of, route_weights, routing as moe_down; y float32 [P, H]; span.
//   grid: (ceil(H / 128), G, ceil(I / span)), block: MMA_THREADS; each warp 32 rows; split z adds the columns
//   [z * span, min(I, (z + 1) * span)) as moe_down_mma does (span a multiple of F::CHUNK; several splits add with
//   atomicAdd into a zeroed y).
//
// As in moe_mma.cu: G = min(E, P); blocks with g >= num_groups[0] exit; a group whose slot is negative is skipped.
// H and I multiples of F::LANE_COLS; an int4 group width a multiple of F::CHUNK.
#include <cuda_fp8.h>

#include "mma.cuh"

// int4 codes, two a byte (the even column in the low nibble), read B bytes (2 * B columns) a lane per chunk.
template <int B>
struct Int4Codes {
    static constexpr int BYTES = B;
    static constexpr int LANE_COLS = 2 * B;
    static constexpr int CHUNK = 4 * LANE_COLS;  // a quad's lanes side by side
    static constexpr int WORD_COLS = 8;
    static constexpr int STEPS = 2;  // k16 steps per word
    static constexpr int BITS = 4;

    // bf16 bits of 128 + zero, twice: subtracted from 128 + q, it leaves q - zero exactly.
    __device__ __forceinline__ static unsigned offset(const unsigned char* zeros, long long index) {
        const unsigned zero = zeros != nullptr ? zeros[index] : 8u;
        return (0x4300u | zero) * 0x10001u;
    }

    // A registers of a word's steps: a[s][p] holds columns column(s, p, 0) and column(s, p, 1) of the word, pair p
    // the mma's k 2q, 2q + 1 (p = 0) or 2q + 8, 2q + 9 (p = 1). Nibble n of the word is column n, so a mask of
    // nibbles k and k + 4 under 0x4300 (bf16 128) is a bf16 pair 128 + q.
    __device__ __forceinline__ static void decode(unsigned word, unsigned offset, unsigned (&a)[STEPS][2]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned biased = ((word >> (4 * k)) & 0x000F000Fu) | 0x43004300u;
            const __nv_bfloat162 value = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased),
                                                 *reinterpret_cast<const __nv_bfloat162*>(&offset));
            a[k / 2][k % 2] = *reinterpret_cast<const unsigned*>(&value);
        }
    }
    __device__ __forceinline__ static constexpr int column(int s, int p, int e) { return 2 * s + p + 4 * e; }
};

// fp8 e4m3 codes, a byte each, read 16 bytes a lane per chunk.
struct Fp8Codes {
    static constexpr int BYTES = 16;
    static constexpr int LANE_COLS = 16;
    static constexpr int CHUNK = 64;
    static constexpr int WORD_COLS = 4;
    static constexpr int STEPS = 1;
    static constexpr int BITS = 8;

    __device__ __forceinline__ static unsigned offset(const unsigned char*, long long) { return 0u; }

    // Columns 0, 1 and 2, 3 of the word: e4m3 -> half (exact) -> bf16 (exact: 4 significant bits, exponents in
    // range).
    __device__ __forceinline__ static void decode(unsigned word, unsigned, unsigned (&a)[STEPS][2]) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
                static_cast<__nv_fp8x2_storage_t>((word >> (16 * p)) & 0xffffu), __NV_E4M3);
            const float2 f = __half22float2(__half2(raw));
            const __nv_bfloat162 value = __floats2bfloat162_rn(f.x, f.y);
            a[0][p] = *reinterpret_cast<const unsigned*>(&value);
        }
    }
    __device__ __forceinline__ static constexpr int column(int, int p, int e) { return 2 * p + e; }
};

// B bytes from global to shared memory, asynchronously; zero-filled where `in` is false.
template <int B>
__device__ __forceinline__ void copy_async_bytes(uint4* dst, const void* src, bool in) {
    if constexpr (B == 16) {
        copy_async(dst, src, in);
    } else {
        const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(address), "l"(src), "n"(B),
                     "r"(in ? B : 0)
                     : "memory");
    }
}

// Where a lane finds the scales and zero points of its rows: scale_row[m][h] points at the scales of row quad + 8h
// of m-tile m (its row block), zero_row[m][h] at its zero points (null: symmetric or fp8); the chunk at column c
// takes entry c / col_block of both.
template <int M>
struct RowScales {
    const float* scale_row[M][2];
    const unsigned char* zero_row[M][2];
    int col_block;
};

// Start copying chunk `chunk` of this lane's weight rows (a[m][h]: the row's codes at the first column) into its
// ring slot.
template <typename F, int M>
__device__ __forceinline__ void fetch_quant_chunk(const unsigned char* const (&a)[M][2], int chunk, int cols,
                                                  WeightRing<M>& ring) {
    const int col = chunk * F::CHUNK + (threadIdx.x % 4) * F::LANE_COLS;
    const bool in = col < cols;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned char* src = in ? a[m][h] + col * F::BITS / 8 : a[m][h];
            copy_async_bytes<F::BYTES>(&ring[chunk % MMA_STAGES][m][h][threadIdx.x], src, in);
        }
    }
}

// acc[m][t] = dequantized A_m [16 rows, cols] . B_t [8 activation rows, cols]^T over the columns k0 .. k0 + cols
// of the matrix: a[m][h] the codes of row quad + 8h of m-tile m at column k0, b[t] the activation row of pair quad
// of n-tile t at column k0, `scales` the rows' scales (entries counted from column 0 of the matrix).
template <typename F, int M, int NT>
__device__ __forceinline__ void quant_rows(const unsigned char* const (&a)[M][2], const float* const (&b)[NT],
                                           int tiles, int k0, int cols, const RowScales<M>& scales,
                                           WeightRing<M>& ring, float (&acc)[M][NT][4]) {
    constexpr int WORDS = F::BYTES / 4;
    const int chunks = (cols + F::CHUNK - 1) / F::CHUNK;
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < chunks) fetch_quant_chunk<F, M>(a, s, cols, ring);
        copy_commit();  // one group per chunk, empty past the end, so wait_group counts chunks
    }
    const int lane_col = (threadIdx.x % 4) * F::LANE_COLS;
    for (int i = 0; i < chunks; ++i) {
        // The chunk's scales and zero-point offsets, loaded before the wait so their latency overlaps it.
        const int group = (k0 + i * F::CHUNK) / scales.col_block;
        float scale[M][2];
        unsigned offset[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                scale[m][h] = scales.scale_row[m][h][group];
                offset[m][h] = F::offset(scales.zero_row[m][h], group);
            }
        }
        copy_wait<MMA_STAGES - 2>();  // chunk i has landed
        uint4 w[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) w[m][h] = ring[i % MMA_STAGES][m][h][threadIdx.x];
        }
        if (i + MMA_STAGES - 1 < chunks) fetch_quant_chunk<F, M>(a, i + MMA_STAGES - 1, cols, ring);
        copy_commit();
        const int col = i * F::CHUNK + lane_col;
        const bool in = col < cols;  // the lane's columns are all in or all out (cols a multiple of LANE_COLS)
        float part[M][NT][4] = {};
#pragma unroll
        for (int word = 0; word < WORDS; ++word) {
            unsigned codes[M][2][F::STEPS][2];
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    F::decode(reinterpret_cast<const unsigned*>(&w[m][h])[word], offset[m][h], codes[m][h]);
                }
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t != 0 && t >= tiles) continue;  // the same for the whole warp
                float v[F::WORD_COLS];
                if (in) {
                    load_floats<F::WORD_COLS>(b[t] + col + word * F::WORD_COLS, v);
                } else {
#pragma unroll
                    for (int j = 0; j < F::WORD_COLS; ++j) v[j] = 0.f;
                }
#pragma unroll
                for (int s = 0; s < F::STEPS; ++s) {
                    unsigned hi[2], lo[2];
#pragma unroll
                    for (int p = 0; p < 2; ++p) {
                        const float x0 = v[F::column(s, p, 0)], x1 = v[F::column(s, p, 1)];
                        hi[p] = Mma<__nv_bfloat16>::pack(x0, x1);
                        const float2 rounded = Mma<__nv_bfloat16>::unpack(hi[p]);
                        lo[p] = Mma<__nv_bfloat16>::pack(x0 - rounded.x, x1 - rounded.y);
                    }
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        Mma<__nv_bfloat16>::mma(part[m][t], codes[m][0][s][0], codes[m][1][s][0], codes[m][0][s][1],
                                                codes[m][1][s][1], hi[0], hi[1]);
                        Mma<__nv_bfloat16>::mma(part[m][t], codes[m][0][s][0], codes[m][1][s][0], codes[m][0][s][1],
                                                codes[m][1][s][1], lo[0], lo[1]);
                    }
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[m][t][j] += part[m][t][j] * scale[m][j / 2];
            }
        }
    }
    copy_wait<0>();  // nothing in flight when the caller's next pass refills the ring
}

// The scales of matrix row `row` (clamped to a real row by the caller) of slot `slot`.
__device__ __forceinline__ const float* scale_row(const float* scales, long long slot, long long s_stride, int row,
                                                  int row_block, int scale_cols) {
    return scales + slot * s_stride + static_cast<long long>(row / row_block) * scale_cols;
}

__device__ __forceinline__ const unsigned char* zero_row(const unsigned char* zeros, long long slot,
                                                         long long z_stride, int row, int scale_cols) {
    return zeros != nullptr ? zeros + slot * z_stride + static_cast<long long>(row) * scale_cols : nullptr;
}

template <typename F, int NT>
__global__ void __launch_bounds__(MMA_THREADS)
moe_gate_up_quant(const float* __restrict__ x, const unsigned char* __restrict__ gate,
                  const unsigned char* __restrict__ up, long long w_stride, long long row_bytes,
                  const float* __restrict__ gate_scales, const float* __restrict__ up_scales, long long s_stride,
                  const unsigned char* __restrict__ gate_zeros, const unsigned char* __restrict__ up_zeros,
                  long long z_stride, int row_block, int col_block, int scale_cols, const int* __restrict__ slot_of,
                  const int* __restrict__ group_expert, const int* __restrict__ group_start,
                  const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, float* __restrict__ act,
                  int H, int I, int top_k) {
    pdl_wait();
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = mma_expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * 16;
    if (row0 >= I) return;  // whole warps leave together; no block-wide barrier follows
    __shared__ WeightRing<2> ring;
    int rows[2];
    const unsigned char* a[2][2];  // [gate, up][row quad, row quad + 8], clamped to a real row
    RowScales<2> scales;
    scales.col_block = col_block;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows[h] = row0 + quad + 8 * h;
        const int row = min(rows[h], I - 1);
        a[0][h] = gate + slot * w_stride + row * row_bytes;
        a[1][h] = up + slot * w_stride + row * row_bytes;
        scales.scale_row[0][h] = scale_row(gate_scales, slot, s_stride, row, row_block, scale_cols);
        scales.scale_row[1][h] = scale_row(up_scales, slot, s_stride, row, row_block, scale_cols);
        scales.zero_row[0][h] = zero_row(gate_zeros, slot, z_stride, row, scale_cols);
        scales.zero_row[1][h] = zero_row(up_zeros, slot, z_stride, row, scale_cols);
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int tiles = (n + 7) / 8;
        int pairs[NT];
        const float* b[NT];
        tile_pairs<NT>(sorted_pairs, base, n, x, H, top_k, 0, pairs, b);
        float acc[2][NT][4] = {};
        quant_rows<F, 2, NT>(a, b, tiles, 0, H, scales, ring, acc);
        const float unscaled[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // quant_rows applied the scales
        store_gate_up<NT>(acc, unscaled, pairs, rows, n, tiles, act, I);
    }
}

template <typename F, int NT>
__global__ void __launch_bounds__(MMA_THREADS)
moe_down_quant(const float* __restrict__ act, const unsigned char* __restrict__ down, long long w_stride,
               long long row_bytes, const float* __restrict__ down_scales, long long s_stride,
               const unsigned char* __restrict__ down_zeros, long long z_stride, int row_block, int col_block,
               int scale_cols, const int* __restrict__ slot_of, const float* __restrict__ route_weights,
               const int* __restrict__ group_expert, const int* __restrict__ group_start,
               const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, float* __restrict__ y, int H,
               int I, int span) {
    pdl_wait();
    constexpr int M = 2;  // two 16-row m-tiles: 32 down rows per warp
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = mma_expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * 16 * M;
    if (row0 >= H) return;
    const int k0 = blockIdx.z * span;
    const int cols = min(span, I - k0);
    __shared__ WeightRing<M> ring;
    int rows[M][2];
    const unsigned char* a[M][2];
    RowScales<M> scales;
    scales.col_block = col_block;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[m][h] = row0 + 16 * m + quad + 8 * h;
            const int row = min(rows[m][h], H - 1);
            a[m][h] = down + slot * w_stride + row * row_bytes + static_cast<long long>(k0) * F::BITS / 8;
            scales.scale_row[m][h] = scale_row(down_scales, slot, s_stride, row, row_block, scale_cols);
            scales.zero_row[m][h] = zero_row(down_zeros, slot, z_stride, row, scale_cols);
        }
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int tiles = (n + 7) / 8;
        int pairs[NT];
        const float* b[NT];
        tile_pairs<NT>(sorted_pairs, base, n, act, I, 1, k0, pairs, b);
        float acc[M][NT][4] = {};
        quant_rows<F, M, NT>(a, b, tiles, k0, cols, scales, ring, acc);
        const float unscaled[M][2] = {{1.f, 1.f}, {1.f, 1.f}};
        store_down<M, NT>(acc, unscaled, pairs, rows, n, tiles, route_weights, y, H, gridDim.z > 1);
    }
}
