// Launch contract
//
// linear_rows<W, TT>: out[T, Out] = x[T, In] @ w[Out, In]^T (+ bias[Out]), accumulated in float32.
//   x    float32 [T, In] contiguous, 16-byte aligned
//   w    W [Out, In] contiguous (W: float, __nv_bfloat16, __half), In a multiple of Vec<W>::N
//   bias float32 [Out] or null
//   out  float32 [T, Out]
//   block: LINEAR_WARPS * 32 threads; each warp computes LINEAR_ROWS output rows for a tile of TT tokens.
//   grid.x: ceil(T / TT) * ceil(Out / (LINEAR_WARPS * LINEAR_ROWS)), the token tile varying fastest so the blocks
//   that read the same weight rows run together and re-reads of a row come from L2.
//   For decode-sized T (the backend uses it up to 64 tokens; cuBLAS above).
//
// to_storage<W>: y[i] = W(x[i]) (round to nearest even), x float32 [n], y W [n].
//   grid.x: ceil(n / 256), block: 256.
#include "common.cuh"

constexpr int LINEAR_WARPS = 4;
constexpr int LINEAR_ROWS = 2;

template <typename W, int TT>
__global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear_rows(const float* __restrict__ x, const W* __restrict__ w, const float* __restrict__ bias,
            float* __restrict__ out, int T, int In, int Out) {
    const int tiles = (T + TT - 1) / TT;
    const int tile = blockIdx.x % tiles, row_block = blockIdx.x / tiles;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (row_block * LINEAR_WARPS + warp) * LINEAR_ROWS;
    if (row0 >= Out) return;  // whole warps leave together
    const int t0 = tile * TT, n = min(TT, T - t0);
    const W* rows[LINEAR_ROWS];
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) rows[r] = w + static_cast<long long>(min(row0 + r, Out - 1)) * In;
    const float* xs[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) xs[j] = x + static_cast<long long>(t0 + min(j, n - 1)) * In;
    float acc[LINEAR_ROWS][TT] = {};
    dot_tile<W, LINEAR_ROWS, TT>(rows, xs, n, In, lane, acc);
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) {
        const int row = row0 + r;
        const float b = (bias != nullptr && row < Out) ? bias[row] : 0.f;
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j < n) {  // n is the same for the whole warp
                const float s = warp_sum(acc[r][j]);
                if (lane == 0 && row < Out) out[static_cast<long long>(t0 + j) * Out + row] = s + b;
            }
        }
    }
}

template <typename W>
__global__ void to_storage(const float* __restrict__ x, W* __restrict__ y, long long n) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_float<W>(x[i]);
}
