// Launch contract
//
// The routed-expert MLP of fp8 experts on tensor cores, at every batch size: e4m3 codes with a float32 scale per
// 128 x 128 tile or per output channel, in expert_codecs.py's layouts (read in place from experts.bin's blocks in
// GPU slots, or from the stacked arrays of resident experts). The same job, routing (moe.cu's moe_align groups),
// grid layout, tiles of pairs (NT n-tiles of 8) and outputs as moe_mma.cu's kernels.
//
// Numerics: codes convert exactly to bf16 in registers (every e4m3 value is a bf16). They multiply the float32
// activations' bf16 high and low parts (moe_mma.cu) on mma.sync.m16n8k16 into a float32 partial sum per chunk of
// columns, and each chunk's partial sum is multiplied by the chunk's scale into the accumulator. A chunk lies inside
// one scale tile, so the result is the dot product with the dequantized weights w = q * s, up to the activations'
// 16 significant bits, as moe_mma.cu's bf16 products.
//
// Chunks: per chunk of FP8_CHUNK (64) columns, lane (quad = lane / 4, q = lane % 4) copies 16 bytes of codes of
// each of its weight rows (rows quad and quad + 8 of each m-tile), columns chunk * 64 + q * 16 onward, into its
// slots of a per-lane cp.async ring (MMA_STAGES chunks, as moe_mma.cu). Each 32-bit word of codes (4 columns) is
// one k16 step of the mma across the quad: the step's k 2q, 2q + 1 and 2q + 8, 2q + 9 are the word's columns 0, 1
// and 2, 3, for the codes and the activations alike, which leaves the dot product unchanged.
//
// Scales: the scale of matrix row r at column c is scales[slot * s_stride + (r / row_block) * scale_cols +
// c / col_block]:
//   128 x 128 tiles:  row_block = col_block = 128, scale_cols ceil(cols / 128)
//   per channel:      row_block 1, col_block >= cols, scale_cols 1
// Rows: row r of a matrix starts r * row_bytes (= cols, a multiple of 16) bytes past its slot's codes; slots are
// w_stride bytes apart.
//
// moe_gate_up_fp8<NT>: act[p, i] = activation(gate_e[i] . x[p / k], up_e[i] . x[p / k]) for every pair p of e.
//   x float32 [T, H]; gate, up codes; w_stride, row_bytes; gate_scales, up_scales float32 at s_stride; row_block,
//   col_block, scale_cols; the activation's six arguments, slot_of, routing as moe_gate_up; act float32 [P, I].
//   grid: (ceil(I / 64), G), block: MMA_THREADS; each warp 16 rows of gate and of up.
//
// moe_down_fp8<NT>: y[p, h] = route_weight[p] * (down_e[h] . act[p] + down_bias_e[h]).
//   act float32 [P, I]; down codes, w_stride, row_bytes, down_scales at s_stride, row_block, col_block, scale_cols;
//   down_bias, b_stride, slot_of, route_weights, routing as moe_down; y float32 [P, H]; span. grid: (ceil(H / 128), G,
//   ceil(I / span)), block: MMA_THREADS; each warp 32 rows; split z adds the columns [z * span, min(I, (z + 1) * span))
//   as moe_down_mma does (span a multiple of FP8_CHUNK; several splits add with atomicAdd into a zeroed y).
//
// As in moe_mma.cu: G = min(E, P); blocks with g >= num_groups[0] exit; a group whose slot is negative is skipped.
// H and I multiples of 16.
#include <cuda_fp8.h>

#include "quant.cuh"

constexpr int FP8_CHUNK = 64;      // columns per chunk: 4 lanes x 16 codes
constexpr int FP8_LANE_COLS = 16;  // codes (bytes) a lane copies per chunk

// The scales of matrix row `row` (clamped to a real row by the caller) of slot `slot`: its row block's entries.
__device__ __forceinline__ const float* scale_row(const float* scales, long long slot, long long s_stride, int row,
                                                  int row_block, int scale_cols) {
    return scales + slot * s_stride + static_cast<long long>(row / row_block) * scale_cols;
}

// Columns 0, 1 and 2, 3 of a word of codes as bf16 pairs: e4m3 -> half (exact) -> bf16 (exact: 4 significant bits,
// exponents in range).
__device__ __forceinline__ void decode_fp8(unsigned word, unsigned (&a)[2]) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>((word >> (16 * p)) & 0xffffu), __NV_E4M3);
        const float2 f = __half22float2(__half2(raw));
        const __nv_bfloat162 value = __floats2bfloat162_rn(f.x, f.y);
        a[p] = *reinterpret_cast<const unsigned*>(&value);
    }
}

// acc[m][t] = dequantized A_m [16 rows, cols] . B_t [8 activation rows, cols]^T over the columns k0 .. k0 + cols
// of the matrix: a[m][h] the codes of row quad + 8h of m-tile m at column k0, b[t] the activation row of pair quad
// of n-tile t at column k0, scales[m][h] the row's scales (entries counted from column 0 of the matrix, one per
// col_block columns).
template <int M, int NT>
__device__ __forceinline__ void fp8_rows(const unsigned char* const (&a)[M][2], const float* const (&b)[NT],
                                         int tiles, int k0, int cols, const float* const (&scales)[M][2],
                                         int col_block, WeightRing<M>& ring, float (&acc)[M][NT][4]) {
    const int chunks = (cols + FP8_CHUNK - 1) / FP8_CHUNK;
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < chunks) fetch_codes_chunk<16, FP8_LANE_COLS, M>(a, s, s, cols, ring);
        copy_commit();  // one group per chunk, empty past the end, so wait_group counts chunks
    }
    const int lane_col = (threadIdx.x % 4) * FP8_LANE_COLS;
    for (int i = 0; i < chunks; ++i) {
        // The chunk's scales, loaded before the wait so their latency overlaps it.
        const int group = (k0 + i * FP8_CHUNK) / col_block;
        float scale[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) scale[m][h] = scales[m][h][group];
        }
        copy_wait<MMA_STAGES - 2>();  // chunk i has landed
        uint4 w[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) w[m][h] = ring[i % MMA_STAGES][m][h][threadIdx.x];
        }
        if (i + MMA_STAGES - 1 < chunks) {
            fetch_codes_chunk<16, FP8_LANE_COLS, M>(a, i + MMA_STAGES - 1, (i + MMA_STAGES - 1) % MMA_STAGES, cols,
                                                    ring);
        }
        copy_commit();
        const int col = i * FP8_CHUNK + lane_col;
        const bool in = col < cols;  // the lane's columns are all in or all out (cols a multiple of 16)
        float part[M][NT][4] = {};
#pragma unroll
        for (int word = 0; word < 4; ++word) {
            unsigned codes[M][2][2];
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h) decode_fp8(reinterpret_cast<const unsigned*>(&w[m][h])[word], codes[m][h]);
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t != 0 && t >= tiles) continue;  // the same for the whole warp
                float v[4];
                if (in) {
                    load_floats<4>(b[t] + col + word * 4, v);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j) v[j] = 0.f;
                }
                unsigned hi[2], lo[2];
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    hi[p] = Mma<__nv_bfloat16>::pack(v[2 * p], v[2 * p + 1]);
                    const float2 rounded = Mma<__nv_bfloat16>::unpack(hi[p]);
                    lo[p] = Mma<__nv_bfloat16>::pack(v[2 * p] - rounded.x, v[2 * p + 1] - rounded.y);
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    Mma<__nv_bfloat16>::mma(part[m][t], codes[m][0][0], codes[m][1][0], codes[m][0][1],
                                            codes[m][1][1], hi[0], hi[1]);
                    Mma<__nv_bfloat16>::mma(part[m][t], codes[m][0][0], codes[m][1][0], codes[m][0][1],
                                            codes[m][1][1], lo[0], lo[1]);
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

template <int NT>
__global__ void __launch_bounds__(MMA_THREADS)
moe_gate_up_fp8(const float* __restrict__ x, const unsigned char* __restrict__ gate,
                const unsigned char* __restrict__ up, long long w_stride, long long row_bytes,
                const float* __restrict__ gate_scales, const float* __restrict__ up_scales, long long s_stride,
                int row_block, int col_block, int scale_cols, const float* __restrict__ gate_bias,
                const float* __restrict__ up_bias, long long b_stride, float limit, float alpha, float up_shift,
                const int* __restrict__ slot_of,
                const int* __restrict__ group_expert, const int* __restrict__ group_start,
                const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, float* __restrict__ act,
                int H, int I, int top_k) {
    pdl_wait();
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * 16;
    if (row0 >= I) return;  // whole warps leave together; no block-wide barrier follows
    __shared__ WeightRing<2> ring;
    int rows[2];
    const unsigned char* a[2][2];  // [gate, up][row quad, row quad + 8], clamped to a real row
    const float* scales[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows[h] = row0 + quad + 8 * h;
        const int row = min(rows[h], I - 1);
        a[0][h] = gate + slot * w_stride + row * row_bytes;
        a[1][h] = up + slot * w_stride + row * row_bytes;
        scales[0][h] = scale_row(gate_scales, slot, s_stride, row, row_block, scale_cols);
        scales[1][h] = scale_row(up_scales, slot, s_stride, row, row_block, scale_cols);
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int tiles = (n + 7) / 8;
        int pairs[NT];
        const float* b[NT];
        tile_pairs<NT>(sorted_pairs, base, n, x, H, top_k, 0, pairs, b);
        float acc[2][NT][4] = {};
        fp8_rows<2, NT>(a, b, tiles, 0, H, scales, col_block, ring, acc);
        const float unscaled[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // fp8_rows applied the scales
        store_gate_up<NT>(acc, unscaled, pairs, rows, n, tiles, activation, slot, act, I);
    }
}

template <int NT>
__global__ void __launch_bounds__(MMA_THREADS)
moe_down_fp8(const float* __restrict__ act, const unsigned char* __restrict__ down, long long w_stride,
             long long row_bytes, const float* __restrict__ down_scales, long long s_stride, int row_block,
             int col_block, int scale_cols, const float* __restrict__ down_bias, long long b_stride,
             const int* __restrict__ slot_of, const float* __restrict__ route_weights,
             const int* __restrict__ group_expert, const int* __restrict__ group_start,
             const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, float* __restrict__ y, int H,
             int I, int span) {
    pdl_wait();
    constexpr int M = 2;  // two 16-row m-tiles: 32 down rows per warp
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    // the down bias, added by the first column split alone (the others add their partial products)
    const float* bias = down_bias != nullptr && blockIdx.z == 0 ? down_bias + slot * b_stride : nullptr;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * 16 * M;
    if (row0 >= H) return;
    const int k0 = blockIdx.z * span;
    const int cols = min(span, I - k0);
    __shared__ WeightRing<M> ring;
    int rows[M][2];
    const unsigned char* a[M][2];
    const float* scales[M][2];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[m][h] = row0 + 16 * m + quad + 8 * h;
            const int row = min(rows[m][h], H - 1);
            a[m][h] = down + slot * w_stride + row * row_bytes + k0;
            scales[m][h] = scale_row(down_scales, slot, s_stride, row, row_block, scale_cols);
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
        fp8_rows<M, NT>(a, b, tiles, k0, cols, scales, col_block, ring, acc);
        const float unscaled[M][2] = {{1.f, 1.f}, {1.f, 1.f}};
        store_down<M, NT>(acc, unscaled, pairs, rows, n, tiles, bias, route_weights, y, H, gridDim.z > 1);
    }
}
