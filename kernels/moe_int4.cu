// Launch contract
//
// The routed-expert MLP of int4 experts on tensor cores, at every batch size: codes two a byte (the even column in
// the low nibble) with a float32 scale (and, asymmetric, a uint8 zero point) per group of input channels, in
// expert_codecs.py's layout (read in place from experts.bin's blocks in GPU slots, or from the stacked arrays of
// resident experts). The same job, routing (moe.cu's moe_align groups), tiles of pairs (NT n-tiles of 8) and
// outputs as moe_mma.cu's kernels.
//
// Numerics: the activations are first cut into chunks of CHUNK columns (quantize_activations): each chunk of a row
// has a scale a = max |x| / 127 and two int8 parts, x = a * (hi + lo / 254) up to a / 508; the scale is stored as
// a / 254 (lo's unit), so x = scale * (254 * hi + lo). The codes enter the
// tensor cores as they are, unsigned 4-bit values q in bytes (a mask of the word: 8 codes in 3 instructions), on
// mma.sync.m16n8k32 u8 x s8 into int32: per chunk Ih = sum q * hi and Il = sum q * lo, exactly. With the chunk's
// C = 254 * sum hi + sum lo, the zero point z (8 when symmetric) and the weight scale s of the chunk's group,
//   sum over the chunk of (q - z) * s * x  =  s * scale * (254 * Ih + Il - z * C),
// the integer part exact and one float32 product per chunk added into the accumulator. So the result is the dot
// product with the dequantized weights w = (q - z) * s up to the activations' 16 bits per chunk's largest value.
//
// Fragments (PTX ISA, m16n8k32 with 8-bit operands, quad = lane / 4, q = lane % 4): A registers {row quad, k 4q ..
// 4q+3}, {row quad + 8, k 4q ..}, {row quad, k 16+4q ..}, {row quad + 8, k 16+4q ..}; B {k 4q .. 4q+3}, {k 16+4q ..}
// of column quad; C as m16n8k16's. Lane q holds, per chunk, B bytes of each of its rows: columns chunk * CHUNK +
// q * 2B onward, word w of them columns +8w .. +8w+7. Masking the word gives nibbles 0, 2, 4, 6 (its columns 0, 2,
// 4, 6) as the A register at k 4q .., and shifted by 4 nibbles 1, 3, 5, 7 at k 16+4q ..; quantize_activations
// stores each 8 columns of hi and lo in the order 0, 2, 4, 6, 1, 3, 5, 7, so the B registers of word w are the
// lane's words 2w and 2w + 1 of them, loaded as they lie.
//
// quantize_activations<B> (int4_codes.cuh, compiled with this file): x float32 [rows, W] -> hi, lo int8 [rows, W] (each 8 columns permuted as above), scale
//   float32 [rows, chunks] (a / 254), corr int32 [rows, chunks] (C above), chunks = ceil(W / CHUNK), CHUNK = 8 * B;
//   columns past W count as zeros. W a multiple of 8. grid: (ceil(W / 1024), rows), block: 128 threads of 8
//   columns each.
//
// moe_gate_up_int4<B, NT, KW>: act[p, i] = activation(gate_e[i] . x[p / k], up_e[i] . x[p / k]) for every pair p of e.
//   x quantized (x_hi, x_lo [T, H], x_scale, x_corr [T, ceil(H / CHUNK)]); gate, up codes, w_stride, row_bytes;
//   gate_scales, up_scales float32 at s_stride; gate_zeros, up_zeros uint8 at z_stride or null; col_block (the
//   group width), scale_cols (groups a row); the activation's six arguments, slot_of, routing as moe_gate_up; act
//   float32 [P, I].
//   grid: (ceil(I / (64 / KW)), G), block: MMA_THREADS; each warp 16 rows of gate and of up. KW = 1: the block's
//   warps take 64 rows; KW = MMA_WARPS: they share 16 rows, each a quarter of the columns, and add their sums in
//   shared memory (grids too small to keep every multiprocessor reading).
//
// moe_down_int4<B, NT>: y[p, h] = route_weight[p] * (down_e[h] . act[p] + down_bias_e[h]).
//   act quantized (a_hi, a_lo [P, I], a_scale, a_corr [P, ceil(I / CHUNK)]); down codes, w_stride, row_bytes,
//   down_scales at s_stride, down_zeros at z_stride or null, col_block, scale_cols; down_bias, b_stride, slot_of,
//   route_weights, routing as moe_down; y float32 [P, H]; span. grid: (ceil(H / 128), G, ceil(I / span)), block:
//   MMA_THREADS; each warp 32 rows; split z adds the columns [z * span, min(I, (z + 1) * span)) as moe_down_mma does
//   (span a multiple of CHUNK; several splits add with atomicAdd into a zeroed y).
//
// As in moe_mma.cu: G = min(E, P); blocks with g >= num_groups[0] exit; a group whose slot is negative is skipped.
// Rows start row_bytes (= groups * width / 2, a multiple of B) apart; H and I multiples of 32; the group width a
// multiple of CHUNK (B = 16, 8 or 4: CHUNK 128, 64 or 32, the largest that divides it).
#include "int4_codes.cuh"
#include "quant.cuh"

// Blocks a multiprocessor holds at once: as many as the weight rings' shared memory allows (4 x 48 KiB), so the
// registers of a thread are held to 128.
constexpr int INT4_BLOCKS_PER_SM = 4;

// D (s32) += A (16 x 32: u8, or s8 where SIGNED) . B (s8, 32 x 8).
#define MMA_M16N8K32(A_TYPE)                                                                                   \
    asm("mma.sync.aligned.m16n8k32.row.col.s32." A_TYPE ".s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
        "{%0, %1, %2, %3};"                                                                                    \
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])                                                       \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool SIGNED>
__device__ __forceinline__ void mma_8bit(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    if constexpr (SIGNED) {
        MMA_M16N8K32("s8");
    } else {
        MMA_M16N8K32("u8");
    }
}
#undef MMA_M16N8K32

// The activation rows of a pass's n-tiles for this lane: b_row[t] the B operand's (pair quad of tile t), c_row[t][c]
// its accumulator column 2q + c's (whose chunk scales and C it applies).
template <int NT>
struct TileRows {
    int b_row[NT];
    int c_row[NT][2];
};

// The tiles of the pass at sorted position `base` (n pairs): pairs[t] as tile_pair_ids gives them, their activation
// rows pair / per_row.
template <int NT>
__device__ __forceinline__ TileRows<NT> tile_rows(const int* __restrict__ sorted_pairs, int base, int n,
                                                  int per_row, int (&pairs)[NT]) {
    tile_pair_ids<NT>(sorted_pairs, base, n, pairs);
    TileRows<NT> rows;
    const int q = threadIdx.x % 4;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        rows.b_row[t] = pairs[t] / per_row;
#pragma unroll
        for (int c = 0; c < 2; ++c) rows.c_row[t][c] = __shfl_sync(FULL_MASK, pairs[t], 4 * (2 * q + c)) / per_row;
    }
    return rows;
}

// This lane's 2B bytes of a quantized activation row from p: zeros where `in` is false.
template <int B>
__device__ __forceinline__ void load_quant_acts(const signed char* p, bool in, unsigned (&v)[B / 2]) {
    if constexpr (B >= 8) {
#pragma unroll
        for (int i = 0; i < B / 8; ++i) {
            const uint4 word = in ? *reinterpret_cast<const uint4*>(p + 16 * i) : make_uint4(0, 0, 0, 0);
            v[4 * i] = word.x; v[4 * i + 1] = word.y; v[4 * i + 2] = word.z; v[4 * i + 3] = word.w;
        }
    } else {
        const uint2 word = in ? *reinterpret_cast<const uint2*>(p) : make_uint2(0, 0);
        v[0] = word.x; v[1] = word.y;
    }
}

// Where a lane finds the groups of its rows: scales[m], zeros[m] (null: symmetric) the slot's arrays of m-tile
// m's matrix, entry[m][h] the first entry of row quad + 8h (row * groups); the group at column c is entry c /
// col_block past it.
template <int M, typename Scale>
struct GroupScales {
    const Scale* scales[M];
    const unsigned char* zeros[M];
    int entry[M][2];
    int col_block;
};

// acc[m][t] = dequantized A_m [16 rows, cols] . B_t [8 activation rows, cols]^T over the columns k0 .. k0 + cols
// of the matrix: a[m][h] the codes of row quad + 8h of m-tile m at column k0, `tiles` the pass's activation rows of
// `acts` (columns and chunk entries counted from column 0), `groups` the rows' scales and zero points.
//
// The loop keeps its indices as running counters (ring slots, the group and the chunks left in it, the lane's
// offsets into the activations), so an iteration spends its instructions on the codes' masks, the mma and the
// chunk's scaling, not on divisions and 64-bit address arithmetic.
template <typename Codes, int B, int M, int NT>
__device__ __forceinline__ void int4_rows(const unsigned char* const (&a)[M][2], const QuantActs& acts,
                                          const TileRows<NT>& tiles, int n_tiles, int k0, int cols,
                                          const GroupScales<M, typename Codes::Scale>& groups, WeightRing<M>& ring,
                                          float (&acc)[M][NT][4]) {
    constexpr int CHUNK = 8 * B, LANE_COLS = 2 * B, WORDS = B / 4;
    const int chunks = (cols + CHUNK - 1) / CHUNK;
    if (chunks == 0) return;
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < chunks) fetch_codes_chunk<B, LANE_COLS, M>(a, s, s, cols, ring);
        copy_commit();  // one group per chunk, empty past the end, so wait_group counts chunks
    }
    const int lane_col = (threadIdx.x % 4) * LANE_COLS;  // the lane's first column in a chunk
    const bool symmetric = groups.zeros[0] == nullptr;  // the same for every m-tile of a launch
    const int chunks_per_group = groups.col_block / CHUNK;
    int group = k0 / groups.col_block;
    int group_left = chunks_per_group - (k0 / CHUNK) % chunks_per_group;  // chunks of `group` still to come
    int act_entry[NT][2];  // the accumulator columns' activation rows at the current chunk
    int act_col[NT];  // the B operand row at the lane's columns of the current chunk
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        act_col[t] = tiles.b_row[t] * acts.W + k0 + lane_col;
#pragma unroll
        for (int c = 0; c < 2; ++c) act_entry[t][c] = tiles.c_row[t][c] * acts.chunks + k0 / CHUNK;
    }
    int read_slot = 0, fetch_slot = MMA_STAGES - 1;
    for (int i = 0; i < chunks; ++i) {
        // The chunk's scales (lo's unit: the activation scales carry the 1 / 254) and zero points, loaded before
        // the wait so their latency overlaps it.
        float s[M][2];
        int z[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                s[m][h] = Codes::scale(groups.scales[m][groups.entry[m][h] + group]);
                z[m][h] = symmetric ? Codes::SYMMETRIC_ZERO : groups.zeros[m][groups.entry[m][h] + group];
            }
        }
        copy_wait<MMA_STAGES - 2>();  // chunk i has landed
        uint4 w[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) w[m][h] = ring[read_slot][m][h][threadIdx.x];
        }
        if (i + MMA_STAGES - 1 < chunks) {
            fetch_codes_chunk<B, LANE_COLS, M>(a, i + MMA_STAGES - 1, fetch_slot, cols, ring);
        }
        copy_commit();
        read_slot = read_slot == MMA_STAGES - 1 ? 0 : read_slot + 1;
        fetch_slot = fetch_slot == MMA_STAGES - 1 ? 0 : fetch_slot + 1;
        const bool in = i * CHUNK + lane_col < cols;  // the lane's columns are all in or all out (cols: 32s)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t != 0 && t >= n_tiles) continue;  // the same for the whole warp; a pass has at least one pair
            unsigned xh[B / 2], xl[B / 2];
            load_quant_acts<B>(acts.hi + act_col[t], in, xh);
            load_quant_acts<B>(acts.lo + act_col[t], in, xl);
            float act_scale[2];
            int c_sum[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                act_scale[c] = acts.scale[act_entry[t][c]];
                c_sum[c] = acts.corr[act_entry[t][c]];
            }
#pragma unroll
            for (int m = 0; m < M; ++m) {
                int ih[4] = {0, 0, 0, 0}, il[4] = {0, 0, 0, 0};
#pragma unroll
                for (int k = 0; k < WORDS; ++k) {
                    // A registers of word k: columns 0, 2, 4, 6 (k 4q ..) and 1, 3, 5, 7 (k 16 + 4q ..) of both rows
                    unsigned a0, a1, a2, a3;
                    Codes::columns(reinterpret_cast<const unsigned*>(&w[m][0])[k], a0, a2);
                    Codes::columns(reinterpret_cast<const unsigned*>(&w[m][1])[k], a1, a3);
                    mma_8bit<Codes::SIGNED>(ih, a0, a1, a2, a3, xh[2 * k], xh[2 * k + 1]);
                    mma_8bit<Codes::SIGNED>(il, a0, a1, a2, a3, xl[2 * k], xl[2 * k + 1]);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {  // row quad + 8 * (j / 2), accumulator column 2q + j % 2
                    const int d = QUANT_LO * ih[j] + il[j] - z[m][j / 2] * c_sum[j % 2];
                    acc[m][t][j] = fmaf(s[m][j / 2] * act_scale[j % 2], static_cast<float>(d), acc[m][t][j]);
                }
            }
            act_col[t] += CHUNK;
            act_entry[t][0] += 1;
            act_entry[t][1] += 1;
        }
        if (--group_left == 0) {
            ++group;
            group_left = chunks_per_group;
        }
    }
    copy_wait<0>();  // nothing in flight when the caller's next pass refills the ring
}

template <int B, int NT, int KW, typename Codes = Int4Codes>
__global__ void __launch_bounds__(MMA_THREADS, INT4_BLOCKS_PER_SM)
moe_gate_up_int4(const signed char* __restrict__ x_hi, const signed char* __restrict__ x_lo,
                 const float* __restrict__ x_scale, const int* __restrict__ x_corr,
                 const unsigned char* __restrict__ gate, const unsigned char* __restrict__ up, long long w_stride,
                 long long row_bytes, const typename Codes::Scale* __restrict__ gate_scales,
                 const typename Codes::Scale* __restrict__ up_scales, long long s_stride,
                 const unsigned char* __restrict__ gate_zeros,
                 const unsigned char* __restrict__ up_zeros, long long z_stride, int col_block, int scale_cols,
                 const float* __restrict__ gate_bias, const float* __restrict__ up_bias, long long b_stride,
                 float limit, float alpha, float up_shift, const int* __restrict__ slot_of,
                 const int* __restrict__ group_expert,
                 const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
                 const int* __restrict__ num_groups, float* __restrict__ act, int H, int I, int top_k) {
    static_assert(KW == 1 || KW == MMA_WARPS, "a block's warps take rows of their own, or share 16");
    constexpr int CHUNK = 8 * B, ROW_WARPS = MMA_WARPS / KW;
    pdl_wait();
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * ROW_WARPS + warp % ROW_WARPS) * 16;
    if (row0 >= I) return;  // whole warps leave together (with KW > 1, the whole block): no barrier waits on them
    const QuantActs acts{x_hi, x_lo, x_scale, x_corr, H, (H + CHUNK - 1) / CHUNK};
    const int part_span = CHUNK * ((acts.chunks + KW - 1) / KW);  // columns of each warp's part (KW > 1)
    const int k0 = (warp / ROW_WARPS) * part_span;
    const int cols = max(0, min(part_span, H - k0));
    __shared__ WeightRing<2> ring;
    int rows[2];
    const unsigned char* a[2][2];  // [gate, up][row quad, row quad + 8], clamped to a real row, at column k0
    GroupScales<2, typename Codes::Scale> groups{{gate_scales + slot * s_stride, up_scales + slot * s_stride},
                          {gate_zeros != nullptr ? gate_zeros + slot * z_stride : nullptr,
                           up_zeros != nullptr ? up_zeros + slot * z_stride : nullptr},
                          {}, col_block};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows[h] = row0 + quad + 8 * h;
        const long long row = min(rows[h], I - 1);
        a[0][h] = gate + slot * w_stride + row * row_bytes + k0 / 2;
        a[1][h] = up + slot * w_stride + row * row_bytes + k0 / 2;
        groups.entry[0][h] = groups.entry[1][h] = static_cast<int>(row) * scale_cols;
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int n_tiles = (n + 7) / 8;
        int pairs[NT];
        const TileRows<NT> tiles = tile_rows<NT>(sorted_pairs, base, n, top_k, pairs);
        float acc[2][NT][4] = {};
        int4_rows<Codes, B, 2, NT>(a, acts, tiles, n_tiles, k0, cols, groups, ring, acc);
        if constexpr (KW > 1) {
            // The parts' sums through the ring's memory: warps 1 .. KW - 1 leave theirs, warp 0 adds them.
            float* partial = reinterpret_cast<float*>(&ring);  // [KW - 1][2 * NT * 4][32]
            constexpr int VALUES = 2 * NT * 4;
            static_assert((KW - 1) * VALUES * 32 * sizeof(float) <= sizeof(WeightRing<2>), "the ring holds them");
            __syncthreads();  // every warp is done with its ring slots
            if (warp > 0) {
#pragma unroll
                for (int v = 0; v < VALUES; ++v) {
                    partial[((warp - 1) * VALUES + v) * 32 + lane] = (&acc[0][0][0])[v];
                }
            }
            __syncthreads();
            if (warp == 0) {
#pragma unroll
                for (int other = 0; other < KW - 1; ++other) {
#pragma unroll
                    for (int v = 0; v < VALUES; ++v) (&acc[0][0][0])[v] += partial[(other * VALUES + v) * 32 + lane];
                }
            }
            __syncthreads();  // warp 0 has read them before the next pass refills the ring
            if (warp > 0) continue;
        }
        const float unscaled[2][2] = {{1.f, 1.f}, {1.f, 1.f}};  // int4_rows applied the scales
        store_gate_up<NT>(acc, unscaled, pairs, rows, n, n_tiles, activation, slot, act, I);
    }
}

template <int B, int NT, typename Codes = Int4Codes>
__global__ void __launch_bounds__(MMA_THREADS, INT4_BLOCKS_PER_SM)
moe_down_int4(const signed char* __restrict__ a_hi, const signed char* __restrict__ a_lo,
              const float* __restrict__ a_scale, const int* __restrict__ a_corr,
              const unsigned char* __restrict__ down, long long w_stride, long long row_bytes,
              const typename Codes::Scale* __restrict__ down_scales, long long s_stride,
              const unsigned char* __restrict__ down_zeros,
              long long z_stride, int col_block, int scale_cols, const float* __restrict__ down_bias,
              long long b_stride, const int* __restrict__ slot_of,
              const float* __restrict__ route_weights, const int* __restrict__ group_expert,
              const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
              const int* __restrict__ num_groups, float* __restrict__ y, int H, int I, int span) {
    constexpr int M = 2;  // two 16-row m-tiles: 32 down rows per warp
    constexpr int CHUNK = 8 * B;
    pdl_wait();
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
    const QuantActs acts{a_hi, a_lo, a_scale, a_corr, I, (I + CHUNK - 1) / CHUNK};
    __shared__ WeightRing<M> ring;
    int rows[M][2];
    const unsigned char* a[M][2];
    const typename Codes::Scale* slot_scales = down_scales + slot * s_stride;
    const unsigned char* slot_zeros = down_zeros != nullptr ? down_zeros + slot * z_stride : nullptr;
    GroupScales<M, typename Codes::Scale> groups{{slot_scales, slot_scales}, {slot_zeros, slot_zeros}, {}, col_block};
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[m][h] = row0 + 16 * m + quad + 8 * h;
            const long long row = min(rows[m][h], H - 1);
            a[m][h] = down + slot * w_stride + row * row_bytes + k0 / 2;
            groups.entry[m][h] = static_cast<int>(row) * scale_cols;
        }
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int n_tiles = (n + 7) / 8;
        int pairs[NT];
        const TileRows<NT> tiles = tile_rows<NT>(sorted_pairs, base, n, 1, pairs);
        float acc[M][NT][4] = {};
        int4_rows<Codes, B, M, NT>(a, acts, tiles, n_tiles, k0, cols, groups, ring, acc);
        const float unscaled[M][2] = {{1.f, 1.f}, {1.f, 1.f}};
        store_down<M, NT>(acc, unscaled, pairs, rows, n, n_tiles, bias, route_weights, y, H, gridDim.z > 1);
    }
}
