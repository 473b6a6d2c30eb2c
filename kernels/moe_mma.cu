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
// moe_gate_up_mma<W, NT>: act[p, i] = activation(gate_e[i] . x[p / k], up_e[i] . x[p / k]) for every pair p of e.
//   Arguments as moe_gate_up. grid: (ceil(I / (16 * MMA_WARPS)), G), block: MMA_WARPS * 32 threads; each warp 16
//   rows of gate and the same 16 rows of up (both in registers before the activation).
//
// moe_down_mma<W, NT>: y[p, h] = route_weight[p] * (down_e[h] . act[p] + down_bias_e[h]).
//   Arguments as moe_down, then span. grid: (ceil(H / (32 * MMA_WARPS)), G, splits), block: MMA_WARPS * 32 threads;
//   each warp 32 rows. Split z covers the columns [z * span, min(I, (z + 1) * span)), span a multiple of 32 and
//   splits = ceil(I / span): with one split y is written; with several (when H's row blocks and the groups alone
//   leave multiprocessors idle) each adds its partial products with atomicAdd, so the caller zeroes y first.
//
// As in moe.cu: G = min(E, P); blocks with g >= num_groups[0] exit; a group whose slot is negative is skipped and
// its pairs' outputs are left untouched; per-row scales are applied when given (null for bf16/fp16 weights).
// W: __nv_bfloat16 or __half; H and I multiples of 8 (16-byte rows); any number of rows and pairs.
#include "mma.cuh"

constexpr int MMA_ROWS_UP = 16;             // gate rows (and the same up rows) per warp of moe_gate_up_mma
constexpr int MMA_ROWS_DOWN = 32;           // down rows per warp of moe_down_mma
constexpr int MMA_TILES_M = 2;              // 16-row m-tiles per warp in both kernels (gate + up; 2 x 16 down rows)

template <typename W, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
moe_gate_up_mma(const float* __restrict__ x, const W* __restrict__ gate, const W* __restrict__ up,
                long long w_stride, const float* __restrict__ gate_scales, const float* __restrict__ up_scales,
                long long s_stride, const float* __restrict__ gate_bias, const float* __restrict__ up_bias,
                long long b_stride, float limit, float alpha, float up_shift, const int* __restrict__ slot_of,
                const int* __restrict__ group_expert,
                const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
                const int* __restrict__ num_groups, float* __restrict__ act, int H, int I, int top_k) {
    pdl_wait();
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
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
        int pairs[NT];
        const float* b[NT];
        tile_pairs<NT>(sorted_pairs, base, n, x, H, top_k, 0, pairs, b);
        float acc[2][NT][4] = {};
        mma_rows<W, 2, NT>(a, b, tiles, H, ring, acc);
        store_gate_up<NT>(acc, scale, pairs, rows, n, tiles, activation, slot, act, I);
    }
}

template <typename W, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
moe_down_mma(const float* __restrict__ act, const W* __restrict__ down, long long w_stride,
             const float* __restrict__ down_scales, long long s_stride, const float* __restrict__ down_bias,
             long long b_stride, const int* __restrict__ slot_of,
             const float* __restrict__ route_weights, const int* __restrict__ group_expert,
             const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
             const int* __restrict__ num_groups, float* __restrict__ y, int H, int I, int span) {
    pdl_wait();
    constexpr int M = MMA_TILES_M;
    static_assert(MMA_ROWS_DOWN == 16 * M, "a warp's down rows are its m-tiles");
    const int g = blockIdx.y;
    if (g >= num_groups[0]) return;
    const long long slot = expert_slot(slot_of, group_expert[g]);
    if (slot < 0) return;
    // the down bias, added by the first column split alone (the others add their partial products)
    const float* bias = down_bias != nullptr && blockIdx.z == 0 ? down_bias + slot * b_stride : nullptr;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4;
    const int row0 = (blockIdx.x * MMA_WARPS + warp) * MMA_ROWS_DOWN;
    if (row0 >= H) return;
    const int k0 = blockIdx.z * span;
    const int cols = min(span, I - k0);
    const bool split = gridDim.z > 1;
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
            a[m][h] = down + slot * w_stride + row * I + k0;
            scale[m][h] = down_scales != nullptr ? down_scales[slot * s_stride + row] : 1.f;
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
        mma_rows<W, M, NT>(a, b, tiles, cols, ring, acc);
        store_down<M, NT>(acc, scale, pairs, rows, n, tiles, bias, route_weights, y, H, split);
    }
}
