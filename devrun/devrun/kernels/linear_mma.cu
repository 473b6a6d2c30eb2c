// Launch contract
//
// linear_mma<W, NT>: up to three projections of the same x on tensor cores, split over the columns:
//   out_m[T, Out_m] = x[T, In] @ w_m[Out_m, In]^T (+ bias_m[Out_m]) for m = 0, 1, 2, accumulated in float32.
//   For the dense projections of a captured decode step of several tokens, where cuBLAS cannot be captured.
//   x      float32 [T, In] contiguous, 16-byte aligned
//   w_m    W [Out_m, In] contiguous (W: __nv_bfloat16 or __half), In a multiple of 8
//   bias_m float32 [Out_m] or null
//   out_m  float32 [T, Out_m]. With one split (gridDim.y == 1) it is written; with several, each split adds its
//          partial products with atomicAdd, so the caller zeroes it first (the order of those float32 additions
//          varies from run to run).
//   Out_m = 0: no matrix m (its pointers are not read); matrix 0 is always given.
//   grid.x: the sum over the matrices of ceil(Out_m / LINEAR_MMA_ROWS), matrix 0's blocks first;
//   grid.y: the splits; split s covers columns [s * span, min(In, (s + 1) * span)), span a multiple of 32 and
//   gridDim.y = ceil(In / span), so a matrix of few rows still fills the GPU; split 0 adds the bias.
//   block: MMA_THREADS; each warp 32 output rows (two m-tiles) of one matrix, the tokens in passes of 8 * NT (the
//   weights are read again for each pass).
// Numerics as moe_mma.cu: the activations split into a high and a low part of W, both multiplied (about 1e-5 of
// float32).
#include "mma.cuh"

constexpr int LINEAR_MMA_TILES_M = 2;                                  // 16-row m-tiles per warp
constexpr int LINEAR_MMA_ROWS = MMA_WARPS * 16 * LINEAR_MMA_TILES_M;  // output rows per block

template <typename W, int NT>
__global__ void __launch_bounds__(MMA_THREADS)
linear_mma(const float* __restrict__ x, int T, int In, int span,
           const W* __restrict__ w0, const float* __restrict__ bias0, float* __restrict__ out0, int Out0,
           const W* __restrict__ w1, const float* __restrict__ bias1, float* __restrict__ out1, int Out1,
           const W* __restrict__ w2, const float* __restrict__ bias2, float* __restrict__ out2, int Out2) {
    constexpr int M = LINEAR_MMA_TILES_M;
    const int blocks0 = (Out0 + LINEAR_MMA_ROWS - 1) / LINEAR_MMA_ROWS;
    const int blocks01 = blocks0 + (Out1 + LINEAR_MMA_ROWS - 1) / LINEAR_MMA_ROWS;
    int block = blockIdx.x;
    const W* w = w0;
    const float* bias = bias0;
    float* out = out0;
    int Out = Out0;
    if (block >= blocks01) {
        block -= blocks01; w = w2; bias = bias2; out = out2; Out = Out2;
    } else if (block >= blocks0) {
        block -= blocks0; w = w1; bias = bias1; out = out1; Out = Out1;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane / 4, q = lane % 4;
    const int row0 = (block * MMA_WARPS + warp) * 16 * M;
    const int k0 = blockIdx.y * span;
    const int cols = min(span, In - k0);
    const int own_row = block * LINEAR_MMA_ROWS + threadIdx.x;  // one weight row's span per thread
    if (own_row < Out) prefetch_l2(w + static_cast<long long>(own_row) * In + k0, cols * sizeof(W));
    pdl_wait();  // before it, only the weights are read
    if (row0 >= Out) return;  // whole warps leave together; no block-wide barrier follows
    const bool split = gridDim.y > 1;
    __shared__ WeightRing<M> ring;
    int rows[M][2];
    const W* a[M][2];  // [m-tile][row quad, row quad + 8] from column k0, clamped to a real row
    float add[M][2];   // the bias, added once (by split 0)
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[m][h] = row0 + 16 * m + quad + 8 * h;
            const long long row = min(rows[m][h], Out - 1);
            a[m][h] = w + row * In + k0;
            add[m][h] = bias != nullptr && blockIdx.y == 0 ? bias[row] : 0.f;
        }
    }
    for (int base = 0; base < T; base += 8 * NT) {
        const int n = min(8 * NT, T - base);
        const int tiles = (n + 7) / 8;
        const float* b[NT];  // token quad of each n-tile (the last token repeated past n), from column k0
#pragma unroll
        for (int t = 0; t < NT; ++t) b[t] = x + static_cast<long long>(base + min(8 * t + quad, n - 1)) * In + k0;
        float acc[M][NT][4] = {};
        mma_rows<W, M, NT>(a, b, tiles, cols, ring, acc);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < tiles) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {  // accumulator columns 2q + c: token 8t + 2q + c of the pass
                    const int token = 8 * t + 2 * q + c;
                    if (token >= n) continue;
#pragma unroll
                    for (int m = 0; m < M; ++m) {
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            if (rows[m][h] >= Out) continue;
                            float* target = out + static_cast<long long>(base + token) * Out + rows[m][h];
                            const float value = acc[m][t][2 * h + c] + add[m][h];
                            store_partial(target, value, split);
                        }
                    }
                }
            }
        }
    }
}
