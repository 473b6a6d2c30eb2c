// Launch contract
//
// The routed-expert MLP of a prefill-sized step as one grouped GEMM per matrix on tensor cores: every expert's
// group of (token, slot) pairs (moe_align's groups, from moe.cu) is cut into tiles of GEMM_PAIRS pairs, and each
// block multiplies one tile with GEMM_ROWS rows of its expert's weights, both operands staged through shared memory
// (cp.async, GEMM_STAGES k-chunks of GEMM_K columns in flight) and read with ldmatrix into mma.sync.m16n8k16
// (bf16 or fp16 in, float32 accumulation). Each weight is read from memory once per tile of pairs, where
// moe_mma.cu reads it once per 32 pairs and takes float32 activations from global memory in every warp.
//
// Numerics: the activations come as NP parts of the weight type (NP = 1: x rounded, the backend's matmul precision
// medium; NP = 2: the rounding and what it leaves, high, as cublas_gemm.activation_parts cuts them), each part's
// product added into the same float32 accumulator. The intermediate activation is written back as NP parts the
// same way, for the down product.
//
// moe_gemm_tiles: tile_start[g] = the first tile of group g (tiles of GEMM_PAIRS pairs, the last of a group
//   partial), tile_start[num_groups] the total; at most 1024 groups. grid: 1, block: 1024.
//
// moe_gemm_gate_up<W, NP>: act[s, i] = activation(gate_e[i] . x[t], up_e[i] . x[t]) for every sorted position s of
//   a group of expert e, t = sorted_pairs[s] / top_k; x_parts: [NP, T, H] W (part p of token t at (p * T + t) * H),
//   act_parts: [NP, P, I] W in sorted order. Arguments as moe_gate_up's (moe.cu), with x_parts and act_parts for
//   x and act, then tile_start, T and P; scales must be null (bf16 / fp16 experts). grid: (ceil(I / 64),
//   ceil(P / GEMM_PAIRS) + min(E, P)), block: GEMM_THREADS; a block takes 64 gate rows and the same 64 up rows
//   (its shared rows interleave them 16 at a time, so each warp holds a gate row and its up row in one thread).
//
// moe_gemm_down<W, NP>: y[p, h] = route_weight[p] * (down_e[h] . act[s] + down_bias_e[h]), p = sorted_pairs[s].
//   Arguments as moe_down's with act_parts for act, then tile_start and P. grid: (ceil(H / GEMM_ROWS),
//   ceil(P / GEMM_PAIRS) + min(E, P)), block: GEMM_THREADS.
//
// Blocks past the step's tiles exit; a group whose slot is negative (slot_of) is skipped and its pairs' outputs are
// left untouched. W: __nv_bfloat16 or __half; H and I multiples of 8 (16-byte rows); any number of rows and pairs.
// Shared memory: GEMM_STAGES * (GEMM_ROWS + NP * GEMM_PAIRS) * GEMM_K * 2 bytes (48 KiB, static).
#include "mma.cuh"

constexpr int GEMM_ROWS = 128;   // weight rows per block (gate/up: 64 gate + 64 up)
constexpr int GEMM_PAIRS = 64;   // pairs per block (a tile of a group)
constexpr int GEMM_K = 32;       // columns per stage: four 16-byte chunks a row
constexpr int GEMM_WARPS = 4;    // 2 x 2 warps, each 64 rows x 32 pairs
constexpr int GEMM_THREADS = GEMM_WARPS * 32;
constexpr int GEMM_MAX_GROUPS = 1024;

// Stages in flight: as many as 48 KiB of shared memory hold.
template <int NP> constexpr int GEMM_STAGES = NP == 1 ? 4 : 3;

// The shared-memory position of 16-byte chunk c of row r (rows of GEMM_K elements): chunks permuted by row pair,
// so the 8 rows an ldmatrix phase reads (8 consecutive rows, one chunk) fall in 8 different bank groups.
__device__ __forceinline__ int swizzled(int r, int c) { return r * GEMM_K + ((c ^ ((r >> 1) & 3)) << 3); }

template <typename W, int NP>
struct GemmShared {
    W a[GEMM_STAGES<NP>][GEMM_ROWS * GEMM_K];
    W b[GEMM_STAGES<NP>][NP][GEMM_PAIRS * GEMM_K];
};

// The tile a block takes: its group, the group's expert slot, its first sorted position and the group's end.
struct GemmTile {
    int group, first, end;
    long long slot;
};

// This block's tile (blockIdx.y among the step's tiles), or false past them or for a group outside this pass.
__device__ __forceinline__ bool gemm_tile(const int* __restrict__ tile_start, const int* __restrict__ num_groups,
                                          const int* __restrict__ group_start, const int* __restrict__ group_expert,
                                          const int* __restrict__ slot_of, GemmTile& tile) {
    const int groups = num_groups[0];
    const int t = blockIdx.y;
    if (t >= tile_start[groups]) return false;
    int lo = 0, hi = groups - 1;  // the last group whose first tile is at or before t
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    tile.group = lo;
    tile.slot = expert_slot(slot_of, group_expert[lo]);
    tile.first = group_start[lo] + (t - tile_start[lo]) * GEMM_PAIRS;
    tile.end = group_start[lo + 1];
    return tile.slot >= 0;
}

// f(n, c, s) for each of this thread's accumulator columns (n-tile n, column 2q + c of the warp's pairs) whose
// sorted position s is in the tile's group.
template <typename F>
__device__ __forceinline__ void for_each_tile_pair(const GemmTile& tile, F f) {
    const int warp = threadIdx.x / 32, q = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int s = tile.first + (warp / 2) * 32 + 8 * n + 2 * q + c;
            if (s < tile.end) f(n, c, s);
        }
    }
}

// The block's product over K columns: acc[m][n] (this warp's 4 m-tiles of 16 rows x 4 n-tiles of 8 pairs) =
// A rows . B rows^T summed over the NP parts of B. a_rows[i]: the global row of shared row thread / 4 + 32 i (null:
// a row past the matrix, zeros); b_rows[p][i]: part p's row of shared pair row thread / 4 + 32 i (null: past the
// tile's pairs). Each thread copies chunk thread % 4 of those rows; `anywhere` is a readable address the copies of
// zeros name (they read nothing).
template <typename W, int NP>
__device__ __forceinline__ void gemm_block(const W* const (&a_rows)[4], const W* const (&b_rows)[NP][2], int K,
                                           const W* anywhere, GemmShared<W, NP>& shared, float (&acc)[4][4][4]) {
    constexpr int STAGES = GEMM_STAGES<NP>;
    const int thread = threadIdx.x, chunk = thread % 4, row = thread / 4;
    const int warp = thread / 32, lane = thread % 32;
    const int warp_rows = (warp % 2) * 64, warp_pairs = (warp / 2) * 32;
    const int k_tiles = (K + GEMM_K - 1) / GEMM_K;
    auto fetch = [&](int kt) {
        const int stage = kt % STAGES, col = kt * GEMM_K + chunk * 8;
        const bool in = col < K;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const W* src = a_rows[i];
            copy_async(reinterpret_cast<uint4*>(&shared.a[stage][swizzled(row + 32 * i, chunk)]),
                       src != nullptr && in ? src + col : anywhere, src != nullptr && in);
        }
#pragma unroll
        for (int p = 0; p < NP; ++p) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const W* src = b_rows[p][i];
                copy_async(reinterpret_cast<uint4*>(&shared.b[stage][p][swizzled(row + 32 * i, chunk)]),
                           src != nullptr && in ? src + col : anywhere, src != nullptr && in);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) fetch(s);
        copy_commit();  // one group per stage, empty past the end, so wait_group counts stages
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        copy_wait<STAGES - 2>();  // stage kt has landed (this thread's copies) ...
        __syncthreads();          // ... and every thread's; the stage read in iteration kt - 1 is free
        if (kt + STAGES - 1 < k_tiles) fetch(kt + STAGES - 1);
        copy_commit();
        const W* a = shared.a[kt % STAGES];
#pragma unroll
        for (int k16 = 0; k16 < 2; ++k16) {
            unsigned af[4][4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {  // rows lane % 16, chunk 2 k16 + lane / 16
                load_matrices(a + swizzled(warp_rows + 16 * m + lane % 16, 2 * k16 + lane / 16), af[m]);
            }
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                const W* b = shared.b[kt % STAGES][p];
                unsigned bf[4][2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // n-tiles 2h and 2h + 1: pairs lane % 8 (+ 8), chunk 2 k16 + bit 3
                    unsigned r[4];
                    load_matrices(b + swizzled(warp_pairs + 16 * h + lane % 8 + 8 * (lane / 16),
                                               2 * k16 + (lane / 8) % 2), r);
                    bf[2 * h][0] = r[0];
                    bf[2 * h][1] = r[1];
                    bf[2 * h + 1][0] = r[2];
                    bf[2 * h + 1][1] = r[3];
                }
#pragma unroll
                for (int m = 0; m < 4; ++m) {
#pragma unroll
                    for (int n = 0; n < 4; ++n) {
                        Mma<W>::mma(acc[m][n], af[m][0], af[m][1], af[m][2], af[m][3], bf[n][0], bf[n][1]);
                    }
                }
            }
        }
    }
    copy_wait<0>();
}

extern "C" __global__ void __launch_bounds__(GEMM_MAX_GROUPS)
moe_gemm_tiles(const int* __restrict__ group_start, const int* __restrict__ num_groups, int* __restrict__ tile_start) {
    pdl_wait();
    __shared__ int warp_totals[GEMM_MAX_GROUPS / 32];
    const int groups = num_groups[0], g = threadIdx.x, lane = g % 32, warp = g / 32;
    const int tiles = g < groups ? (group_start[g + 1] - group_start[g] + GEMM_PAIRS - 1) / GEMM_PAIRS : 0;
    int sum = tiles;  // inclusive scan within the warp, then over the warps' totals
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const int other = __shfl_up_sync(FULL_MASK, sum, d);
        if (lane >= d) sum += other;
    }
    if (lane == 31) warp_totals[warp] = sum;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_totals[w];
    sum += before;
    if (g == 0) tile_start[0] = 0;
    if (g < groups) tile_start[g + 1] = sum;
}

template <typename W, int NP>
__global__ void __launch_bounds__(GEMM_THREADS)
moe_gemm_gate_up(const W* __restrict__ x_parts, const W* __restrict__ gate, const W* __restrict__ up,
                 long long w_stride, const float* __restrict__ gate_scales, const float* __restrict__ up_scales,
                 long long s_stride, const float* __restrict__ gate_bias, const float* __restrict__ up_bias,
                 long long b_stride, float limit, float alpha, float up_shift, const int* __restrict__ slot_of,
                 const int* __restrict__ group_expert, const int* __restrict__ group_start,
                 const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, W* __restrict__ act_parts,
                 int H, int I, int top_k, const int* __restrict__ tile_start, int T, int P) {
    pdl_wait();
    GemmTile tile;
    if (!gemm_tile(tile_start, num_groups, group_start, group_expert, slot_of, tile)) return;
    __shared__ __align__(128) GemmShared<W, NP> shared;
    const int thread = threadIdx.x, row = thread / 4;
    const int features = blockIdx.x * 64;
    const W* a_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // shared row r: m-tile r / 16 of warp r / 64, gate in even m-tiles, up in odd
        const int r = row + 32 * i, m = (r / 16) % 4;
        const int feature = features + (r / 64) * 32 + (m / 2) * 16 + r % 16;
        const W* matrix = m % 2 == 0 ? gate : up;
        a_rows[i] = feature < I ? matrix + tile.slot * w_stride + static_cast<long long>(feature) * H : nullptr;
    }
    const W* b_rows[NP][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int s = tile.first + row + 32 * i;
        const long long token = s < tile.end ? sorted_pairs[s] / top_k : -1;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            b_rows[p][i] = token >= 0 ? x_parts + (static_cast<long long>(p) * T + token) * H : nullptr;
        }
    }
    float acc[4][4][4] = {};
    gemm_block<W, NP>(a_rows, b_rows, H, gate, shared, acc);
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const int warp = thread / 32, quad = thread % 32 / 4;
    for_each_tile_pair(tile, [&](int n, int c, int s) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {  // gate m-tile 2m, up m-tile 2m + 1
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int feature = features + (warp % 2) * 32 + 16 * m + quad + 8 * h;
                if (feature >= I) continue;
                const float v = activation(tile.slot, feature, acc[2 * m][n][2 * h + c], acc[2 * m + 1][n][2 * h + c]);
                W* out = act_parts + static_cast<long long>(s) * I + feature;
                const W rounded = from_float<W>(v);
                out[0] = rounded;
                if constexpr (NP == 2) out[static_cast<long long>(P) * I] = from_float<W>(v - to_float(rounded));
            }
        }
    });
}

template <typename W, int NP>
__global__ void __launch_bounds__(GEMM_THREADS)
moe_gemm_down(const W* __restrict__ act_parts, const W* __restrict__ down, long long w_stride,
              const float* __restrict__ down_scales, long long s_stride, const float* __restrict__ down_bias,
              long long b_stride, const int* __restrict__ slot_of, const float* __restrict__ route_weights,
              const int* __restrict__ group_expert, const int* __restrict__ group_start,
              const int* __restrict__ sorted_pairs, const int* __restrict__ num_groups, float* __restrict__ y,
              int H, int I, const int* __restrict__ tile_start, int P) {
    pdl_wait();
    GemmTile tile;
    if (!gemm_tile(tile_start, num_groups, group_start, group_expert, slot_of, tile)) return;
    __shared__ __align__(128) GemmShared<W, NP> shared;
    const int thread = threadIdx.x, row = thread / 4;
    const int rows = blockIdx.x * GEMM_ROWS;
    const W* a_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int h = rows + row + 32 * i;
        a_rows[i] = h < H ? down + tile.slot * w_stride + static_cast<long long>(h) * I : nullptr;
    }
    const W* b_rows[NP][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int s = tile.first + row + 32 * i;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
            b_rows[p][i] = s < tile.end ? act_parts + (static_cast<long long>(p) * P + s) * I : nullptr;
        }
    }
    float acc[4][4][4] = {};
    gemm_block<W, NP>(a_rows, b_rows, I, down, shared, acc);
    const float* bias = down_bias != nullptr ? down_bias + tile.slot * b_stride : nullptr;
    const int warp = thread / 32, quad = thread % 32 / 4;
    for_each_tile_pair(tile, [&](int n, int c, int s) {
        const int pair = sorted_pairs[s];
        const float weight = route_weights[pair];
        float* out = y + static_cast<long long>(pair) * H;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = rows + (warp % 2) * 64 + 16 * m + quad + 8 * h;
                if (r < H) out[r] = (acc[m][n][2 * h + c] + (bias != nullptr ? bias[r] : 0.f)) * weight;
            }
        }
    });
}
