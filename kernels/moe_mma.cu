// Launch contract
//
// The routed-expert MLP on tensor cores, for steps whose expert groups hold several (token, slot) pairs: the same
// job, arguments, routing (moe_align's groups, from moe.cu) and grid layout as moe_gate_up / moe_down, with the
// products on warp-level mma.sync.m16n8k16 (bf16 or fp16 in, float32 accumulation) instead of CUDA-core FMAs.
//
// Numerics: the weights are the A operand as stored. The float32 activations (x, act) are split in registers into
// a high and a low part of the weight type, hi = round(v), lo = round(v - hi), and both are multiplied into the
// same float32 accumulator, so the activations keep about 16 significant bits (within about 1e-5 of float32), as in
// the backend's cuBLAS path.
//
// Tiles: a warp owns 16 weight rows per matrix (two m-tiles: 16 gate + the same 16 up rows, or 32 down rows) and
// multiplies them with every pair of its group, 8 pairs (one n-tile) per mma, NT n-tiles per pass over the weights,
// so each weight is read from HBM once per NT * 8 pairs (a group never holds more pairs than tokens: the backend
// picks NT from T). Per 32 columns, lane (quad = lane / 4, q = lane % 4) copies 16 bytes (columns 8q .. 8q + 7) of
// weight rows quad and quad + 8 of each m-tile into its own slots of a shared-memory ring with cp.async,
// MMA_STAGES - 1 chunks ahead of the mma (5 x 4 x 16 bytes in flight per lane, whatever the warp waits on), and
// loads the same 8 columns of the float32 activations of pair quad of each n-tile from global memory (L1/L2: all
// warps of a block share them). Inside an mma the k order is permuted the same way for A and B (a lane's 8
// contiguous columns feed two k16 steps), which leaves the dot products unchanged and keeps every load 16 bytes
// wide. Shared memory: MMA_STAGES * 4 * 16 bytes per thread, 48 KiB per block (static).
//
// moe_gate_up_mma<W, NT>: act[p, i] = silu(gate_e[i] . x[p / k]) * (up_e[i] . x[p / k]) for every pair p of expert e.
//   Arguments as moe_gate_up. grid: (ceil(I / (16 * MMA_WARPS)), G), block: MMA_WARPS * 32 threads; each warp 16
//   rows of gate and the same 16 rows of up (both in registers before SiLU-mul).
//
// moe_down_mma<W, NT>: y[p, h] = route_weight[p] * (down_e[h] . act[p]).
//   Arguments as moe_down. grid: (ceil(H / (32 * MMA_WARPS)), G), block: MMA_WARPS * 32 threads; each warp 32 rows.
//
// As in moe.cu: G = min(E, P); blocks with g >= num_groups[0] exit; a group whose slot is negative is skipped and
// its pairs' outputs are left untouched; per-row scales are applied when given (null for bf16/fp16 weights).
// W: __nv_bfloat16 or __half; H and I multiples of 8 (16-byte rows); any number of rows and pairs.
#include "common.cuh"

constexpr int MMA_WARPS = 4;                // warps per block
constexpr int MMA_THREADS = MMA_WARPS * 32;
constexpr int MMA_STAGES = 6;               // 32-column chunks of weights per lane in shared memory (5 in flight)
constexpr int MMA_ROWS_UP = 16;             // gate rows (and the same up rows) per warp of moe_gate_up_mma
constexpr int MMA_ROWS_DOWN = 32;           // down rows per warp of moe_down_mma
constexpr int MMA_TILES_M = 2;              // 16-row m-tiles per warp in both kernels (gate + up; 2 x 16 down rows)

// The slot holding expert e: slot_of[e] with a slot table (negative: not in a slot for this pass), else e.
__device__ __forceinline__ long long mma_expert_slot(const int* slot_of, int e) {
    return slot_of != nullptr ? slot_of[e] : e;
}

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

// One 32-column chunk: acc[m][t] += A_m . B_t for the n-tiles t < tiles.
//
// w[m][h]: this lane's 8 weights (columns col .. col + 7) of row quad + 8h of m-tile m. b[t]: the activation row of
// pair quad of n-tile t; the lane reads its columns col .. col + 7 (zeros where `in` is false: past the row's end).
// mma fragments (PTX ISA, m16n8k16, quad = lane / 4, q = lane % 4): A registers {row quad, k 2q..2q+1},
// {row quad + 8, k 2q..}, {row quad, k 2q+8..}, {row quad + 8, k 2q+8..}; B {k 2q..2q+1}, {k 2q+8..2q+9} of column
// quad; C {row quad, columns 2q, 2q+1}, {row quad + 8, columns 2q, 2q+1}. Step s of the chunk maps mma k 2q, 2q+1,
// 2q+8, 2q+9 to the lane's columns 4s .. 4s + 3, for A and B alike.
template <typename W, int M, int NT>
__device__ __forceinline__ void mma_chunk(const uint4 (&w)[M][2], const float* const (&b)[NT], int col, bool in,
                                          int tiles, float (&acc)[M][NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t == 0 || t < tiles) {  // the same for the whole warp; a pass has at least one pair
            float v[8];
            if (in) {
                load_floats<8>(b[t] + col, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[j] = 0.f;
            }
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
                    Mma<W>::mma(acc[m][t], r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1], hi[2 * s],
                                hi[2 * s + 1]);
                    Mma<W>::mma(acc[m][t], r0[2 * s], r1[2 * s], r0[2 * s + 1], r1[2 * s + 1], lo[2 * s],
                                lo[2 * s + 1]);
                }
            }
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
        mma_chunk<W, M, NT>(w, b, col, col < cols, tiles, acc);
    }
    copy_wait<0>();  // nothing in flight when the caller's next pass refills the ring
}

template <typename W, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
moe_gate_up_mma(const float* __restrict__ x, const W* __restrict__ gate, const W* __restrict__ up,
                long long w_stride, const float* __restrict__ gate_scales, const float* __restrict__ up_scales,
                long long s_stride, const int* __restrict__ slot_of, const int* __restrict__ group_expert,
                const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
                const int* __restrict__ num_groups, float* __restrict__ act, int H, int I, int top_k) {
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = mma_expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, q = lane % 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * MMA_ROWS_UP;
    if (row0 >= I) return;  // whole warps leave together; no block-wide barrier follows
    __shared__ WeightRing<MMA_TILES_M> ring;
    int rows[2];  // this lane's rows of the accumulators: row0 + quad, row0 + quad + 8
    const W* a[2][2];  // [gate, up][row quad, row quad + 8], clamped to a real row (rows past I are not stored)
    float scale[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows[h] = row0 + quad + 8 * h;
        const long long row = min(rows[h], I - 1);
        a[0][h] = gate + slot * w_stride + row * H;
        a[1][h] = up + slot * w_stride + row * H;
        scale[0][h] = gate_scales != nullptr ? gate_scales[slot * s_stride + row] : 1.f;
        scale[1][h] = up_scales != nullptr ? up_scales[slot * s_stride + row] : 1.f;
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int tiles = (n + 7) / 8;
        int pairs[NT];  // pair quad of each n-tile (the last pair repeated past n)
        const float* b[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            pairs[t] = sorted_pairs[base + min(8 * t + quad, n - 1)];
            b[t] = x + static_cast<long long>(pairs[t] / top_k) * H;
        }
        float acc[2][NT][4] = {};
        mma_rows<W, 2, NT>(a, b, tiles, H, ring, acc);
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
                        act[static_cast<long long>(p) * I + rows[h]] = gv / (1.f + expf(-gv)) * uv;
                    }
                }
            }
        }
    }
}

template <typename W, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
moe_down_mma(const float* __restrict__ act, const W* __restrict__ down, long long w_stride,
             const float* __restrict__ down_scales, long long s_stride, const int* __restrict__ slot_of,
             const float* __restrict__ route_weights, const int* __restrict__ group_expert,
             const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
             const int* __restrict__ num_groups, float* __restrict__ y, int H, int I) {
    constexpr int M = MMA_TILES_M;
    static_assert(MMA_ROWS_DOWN == 16 * M, "a warp's down rows are its m-tiles");
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = mma_expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, q = lane % 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * MMA_ROWS_DOWN;
    if (row0 >= H) return;
    __shared__ WeightRing<M> ring;
    int rows[M][2];
    const W* a[M][2];
    float scale[M][2];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[m][h] = row0 + 16 * m + quad + 8 * h;
            const long long row = min(rows[m][h], H - 1);
            a[m][h] = down + slot * w_stride + row * I;
            scale[m][h] = down_scales != nullptr ? down_scales[slot * s_stride + row] : 1.f;
        }
    }
    const int end = group_start[g + 1];
    for (int base = group_start[g]; base < end; base += 8 * NT) {
        const int n = min(8 * NT, end - base);
        const int tiles = (n + 7) / 8;
        int pairs[NT];
        const float* b[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            pairs[t] = sorted_pairs[base + min(8 * t + quad, n - 1)];
            b[t] = act + static_cast<long long>(pairs[t]) * I;
        }
        float acc[M][NT][4] = {};
        mma_rows<W, M, NT>(a, b, tiles, I, ring, acc);
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
                            y[static_cast<long long>(p) * H + rows[m][h]] = acc[m][t][2 * h + c] * scale[m][h] * weight;
                        }
                    }
                }
            }
        }
    }
}
