// Tensor-core building blocks shared by moe_mma.cu and linear_mma.cu: a warp multiplies rows of bf16/fp16 weights
// (the A operand, streamed from HBM through a per-lane shared-memory ring with cp.async) with up to NT tiles of 8
// float32 activation rows (the B operand, split in registers into a high and a low part of the weight type) on
// mma.sync.m16n8k16, accumulating in float32. See moe_mma.cu's launch contract for the fragment layout and numerics.
#pragma once
#include "common.cuh"

constexpr int MMA_WARPS = 4;                // warps per block
constexpr int MMA_THREADS = MMA_WARPS * 32;
constexpr int MMA_STAGES = 6;               // 32-column chunks of weights per lane in shared memory (5 in flight)

// 16 bytes of weights from global to shared memory, asynchronously (cp.async, bypassing L1: each weight is read
// once per block); the L2 fetches the whole 256-byte segment, which the next chunks of the same row read. With
// `in` false nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void copy_async(uint4* dst, const void* src, bool in) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(address), "l"(src), "r"(in ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <typename W> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    // Two floats rounded to bf16, a in the low half (the lower k index).
    __device__ __forceinline__ static unsigned pack(float a, float b) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<const unsigned*>(&v);
    }
    __device__ __forceinline__ static float2 unpack(unsigned v) {
        return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
    }
    __device__ __forceinline__ static void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

template <> struct Mma<__half> {
    __device__ __forceinline__ static unsigned pack(float a, float b) {
        const __half2 v = __floats2half2_rn(a, b);
        return *reinterpret_cast<const unsigned*>(&v);
    }
    __device__ __forceinline__ static float2 unpack(unsigned v) {
        return __half22float2(*reinterpret_cast<const __half2*>(&v));
    }
    __device__ __forceinline__ static void mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

// The four 8 x 8 16-bit matrices whose rows (in shared memory) start at the addresses lanes 0-7, 8-15, 16-23 and
// 24-31 give: lane l gets row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of each, an mma A or B fragment's layout.
__device__ __forceinline__ void load_matrices(const void* row, unsigned (&r)[4]) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// An output element: written, or added to with atomicAdd when several column spans (`split`) add into it.
__device__ __forceinline__ void store_partial(float* target, float value, bool split) {
    if (split) {
        atomicAdd(target, value);
    } else {
        *target = value;
    }
}

// The pairs this lane feeds to a pass of NT n-tiles from sorted position `base` (n pairs): pair quad of each tile,
// the last pair repeated past n.
template <int NT>
__device__ __forceinline__ void tile_pair_ids(const int* __restrict__ sorted_pairs, int base, int n,
                                              int (&pairs)[NT]) {
    const int quad = threadIdx.x % 32 / 4;
#pragma unroll
    for (int t = 0; t < NT; ++t) pairs[t] = sorted_pairs[base + min(8 * t + quad, n - 1)];
}

// tile_pair_ids, and the pairs' activation rows: row pairs[t] / per_row of `rows` (rows of `width` floats), from
// column `col`.
template <int NT>
__device__ __forceinline__ void tile_pairs(const int* __restrict__ sorted_pairs, int base, int n, const float* rows,
                                           int width, int per_row, int col, int (&pairs)[NT],
                                           const float* (&b)[NT]) {
    tile_pair_ids<NT>(sorted_pairs, base, n, pairs);
#pragma unroll
    for (int t = 0; t < NT; ++t) b[t] = rows + static_cast<long long>(pairs[t] / per_row) * width + col;
}

// The MoE kernels' outputs from a warp's accumulators (C fragments: acc[m][t][2h + c] is row quad + 8h of m-tile m,
// pair 2q + c of n-tile t; pairs[t] is the pair of lane 4 * j's column j; n pairs in this pass), each row's value
// times scale[m][h]. store_gate_up: m-tile 0 is gate and 1 is up, of the rows rows[h] of slot `slot`; act[p, row] =
// activation(gate, up) (common.cuh). store_down: rows[m][h]; y[p, row] = (value + bias[row]) * route_weights[p],
// bias the slot's down bias row (null: none), added when `split` (the caller passes the bias to one split only).
template <int NT>
__device__ __forceinline__ void store_gate_up(const float (&acc)[2][NT][4], const float (&scale)[2][2],
                                              const int (&pairs)[NT], const int (&rows)[2], int n, int tiles,
                                              const GatedActivation& activation, long long slot,
                                              float* __restrict__ act, int I) {
    const int q = threadIdx.x % 4;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < tiles) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {  // accumulator columns 2q + c: pair of lane 4 * (2q + c)
                const int p = __shfl_sync(FULL_MASK, pairs[t], 4 * (2 * q + c));
                if (8 * t + 2 * q + c >= n) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (rows[h] >= I) continue;
                    const float gv = acc[0][t][2 * h + c] * scale[0][h];
                    const float uv = acc[1][t][2 * h + c] * scale[1][h];
                    act[static_cast<long long>(p) * I + rows[h]] = activation(slot, rows[h], gv, uv);
                }
            }
        }
    }
}

template <int M, int NT>
__device__ __forceinline__ void store_down(const float (&acc)[M][NT][4], const float (&scale)[M][2],
                                           const int (&pairs)[NT], const int (&rows)[M][2], int n, int tiles,
                                           const float* __restrict__ bias, const float* __restrict__ route_weights,
                                           float* __restrict__ y, int H, bool split) {
    const int q = threadIdx.x % 4;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < tiles) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int p = __shfl_sync(FULL_MASK, pairs[t], 4 * (2 * q + c));
                if (8 * t + 2 * q + c >= n) continue;
                const float weight = route_weights[p];
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if (rows[m][h] >= H) continue;
                        float* target = y + static_cast<long long>(p) * H + rows[m][h];
                        const float b = bias != nullptr ? bias[rows[m][h]] : 0.f;
                        store_partial(target, (acc[m][t][2 * h + c] * scale[m][h] + b) * weight, split);
                    }
                }
            }
        }
    }
}

// This lane's 8 activations (columns col .. col + 7) of the row b: zeros where `in` is false (past the row's end).
__device__ __forceinline__ void load_activations(const float* b, int col, bool in, float (&v)[8]) {
    if (in) {
        load_floats<8>(b + col, v);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
}

// One 32-column chunk of n-tile t: acc[m][t] += A_m . B_t.
//
// w[m][h]: this lane's 8 weights (columns col .. col + 7) of row quad + 8h of m-tile m; v: the same 8 columns of
// the activation row of pair quad of n-tile t (load_activations).
// mma fragments (PTX ISA, m16n8k16, quad = lane / 4, q = lane % 4): A registers {row quad, k 2q..2q+1},
// {row quad + 8, k 2q..}, {row quad, k 2q+8..}, {row quad + 8, k 2q+8..}; B {k 2q..2q+1}, {k 2q+8..2q+9} of column
// quad; C {row quad, columns 2q, 2q+1}, {row quad + 8, columns 2q, 2q+1}. Step s of the chunk maps mma k 2q, 2q+1,
// 2q+8, 2q+9 to the lane's columns 4s .. 4s + 3, for A and B alike.
template <typename W, int M, int NT>
__device__ __forceinline__ void mma_tile(const uint4 (&w)[M][2], const float (&v)[8], int t, float (&acc)[M][NT][4]) {
    unsigned hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        hi[j] = Mma<W>::pack(v[2 * j], v[2 * j + 1]);
        const float2 rounded = Mma<W>::unpack(hi[j]);
        lo[j] = Mma<W>::pack(v[2 * j] - rounded.x, v[2 * j + 1] - rounded.y);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const unsigned* r0 = reinterpret_cast<const unsigned*>(&w[m][0]);
        const unsigned* r1 = reinterpret_cast<const unsigned*>(&w[m][1]);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            Mma<W>::mma(acc[m][t], r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1], hi[2 * s], hi[2 * s + 1]);
            Mma<W>::mma(acc[m][t], r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1], lo[2 * s], lo[2 * s + 1]);
        }
    }
}

// Shared memory of a block: for each stage (chunk of 32 columns), this lane's 16 bytes of each of its weight rows,
// lane-major so a warp's accesses are contiguous. Each lane reads back only what it copied itself, so the ring needs
// cp.async.wait_group but no barrier.
template <int M> using WeightRing = uint4[MMA_STAGES][M][2][MMA_THREADS];

// Start copying chunk `chunk` (columns 32 * chunk + this lane's 8) of this lane's weight rows into its ring slot.
template <typename W, int M>
__device__ __forceinline__ void fetch_chunk(const W* const (&a)[M][2], int chunk, int cols, WeightRing<M>& ring) {
    const int col = 32 * chunk + (threadIdx.x % 4) * 8;
    const bool in = col < cols;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            copy_async(&ring[chunk % MMA_STAGES][m][h][threadIdx.x], in ? a[m][h] + col : a[m][h], in);
        }
    }
}

// acc[m][t] = A_m [16 rows, cols] . B_t [8 activation rows, cols]^T over all columns. a[m][h]: the start of weight
// row quad + 8h of m-tile m; b[t]: activation row of pair quad of n-tile t; cols a multiple of 8. The weights stream
// through the ring MMA_STAGES - 1 chunks ahead of the mma, whatever the warp waits on meanwhile.
template <typename W, int M, int NT>
__device__ __forceinline__ void mma_rows(const W* const (&a)[M][2], const float* const (&b)[NT], int tiles, int cols,
                                         WeightRing<M>& ring, float (&acc)[M][NT][4]) {
    const int chunks = (cols + 31) / 32;
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < chunks) fetch_chunk<W, M>(a, s, cols, ring);
        copy_commit();  // one group per chunk, empty past the end, so wait_group counts chunks
    }
    const int lane_col = (threadIdx.x % 4) * 8;
    // Each n-tile's activations of the next chunk are loaded just before this chunk's mma of that tile, so their
    // L2 latency is off the loop's path (benchmarks/dense_projection.py and decode.py compare the variants). With
    // two n-tiles loading ahead takes registers enough to cut the blocks per multiprocessor from 4 to 3, so they
    // load each chunk's activations in the iteration that uses them.
    constexpr bool load_ahead = NT != 2;
    float v[NT][8];  // this chunk's activations of each n-tile (t < tiles, and tile 0 always)
    if constexpr (load_ahead) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t == 0 || t < tiles) load_activations(b[t], lane_col, lane_col < cols, v[t]);
        }
    }
    for (int i = 0; i < chunks; ++i) {
        copy_wait<MMA_STAGES - 2>();  // chunk i has landed
        uint4 w[M][2];
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) w[m][h] = ring[i % MMA_STAGES][m][h][threadIdx.x];
        }
        // Refill the slot read in the previous iteration (its values are in registers, consumed by that
        // iteration's mma, which precede this copy in program order).
        if (i + MMA_STAGES - 1 < chunks) fetch_chunk<W, M>(a, i + MMA_STAGES - 1, cols, ring);
        copy_commit();
        const int col = 32 * i + lane_col;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t == 0 || t < tiles) {  // the same for the whole warp; a pass has at least one pair
                if constexpr (load_ahead) {
                    float ahead[8];
                    load_activations(b[t], col + 32, i + 1 < chunks && col + 32 < cols, ahead);
                    mma_tile<W, M, NT>(w, v[t], t, acc);
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[t][j] = ahead[j];
                } else {
                    load_activations(b[t], col, col < cols, v[t]);
                    mma_tile<W, M, NT>(w, v[t], t, acc);
                }
            }
        }
    }
    copy_wait<0>();  // nothing in flight when the caller's next pass refills the ring
}
