// Launch contract
//
// linear_rows<W, TT>: up to three projections of the same x in one launch (q, k and v of a layer):
//   out_m[T, Out_m] = x[T, In] @ w_m[Out_m, In]^T (+ bias_m[Out_m]) for m = 0, 1, 2, accumulated in float32.
//   x      float32 [T, In] contiguous, 16-byte aligned
//   w_m    W [Out_m, In] contiguous (W: float, __nv_bfloat16, __half), In a multiple of Vec<W>::N
//   bias_m float32 [Out_m] or null
//   out_m  float32 [T, Out_m]
//   Out_m = 0: no matrix m (its pointers are not read); matrix 0 is always given.
//   block: LINEAR_WARPS * 32 threads, all on the same LINEAR_ROWS output rows and tile of TT tokens: the warps
//   split each row's columns (so even a matrix of few rows spreads over the whole GPU) and add their partial sums
//   in shared memory.
//   grid.x: the sum over the matrices of ceil(T / TT) * ceil(Out_m / LINEAR_ROWS), matrix 0's blocks first, the
//   token tile varying fastest so the blocks that read the same weight rows run together and re-reads of a row come
//   from L2.
//   For decode-sized T (the backend uses it up to SMALL_BATCH tokens, and for every T inside a CUDA graph).
//
// per_head_rows<W, TT>: each head through its own matrix (Multi-head Latent Attention's up-projections):
//   out[t, h, o] = x[t, h, :] . w[h, o, :], accumulated in float32.
//   x      float32, row (t, h) at x + t * x_token + h * x_head (In contiguous floats, 16-byte aligned)
//   w      W [H, Out, In] contiguous, In a multiple of Vec<W>::N
//   out    float32 [T, H, Out]
//   block: LINEAR_WARPS * 32 threads, teams of HEAD_TEAM lanes on HEAD_TEAM_ROWS rows each: HEAD_ROWS rows of head
//   blockIdx.y for a tile of TT tokens; grid: (ceil(T / TT) * ceil(Out / HEAD_ROWS), H), the token tile varying
//   fastest. For decode-sized T (the backend takes it up to SMALL_BATCH tokens, and for every T inside a CUDA graph).
//
// to_storage<W>: y[i] = W(x[i]) (round to nearest even), x float32 [n], y W [n].
//   grid.x: ceil(n / 256), block: 256.
//
// to_storage_split<W>: x = hi + lo to about 16 significant bits: hi_lo[i] = W(x[i]),
//   hi_lo[n + i] = W(x[i] - hi_lo[i]); x float32 [n], hi_lo W [2n]. Lets cuBLAS multiply float32 activations with
//   bf16/fp16 weights on tensor cores as one GEMM of twice the rows.
//   grid.x: ceil(n / 256), block: 256.
// kv_types.cuh: to_storage also rounds to fp8 e4m3 (a KV cache filled from float32)
#include "kv_types.cuh"

constexpr int LINEAR_WARPS = 4;
constexpr int LINEAR_ROWS = 2;

// Steps of dot_tile whose weight loads go out together for a thread on `rows` rows and `tt` tokens: about eight
// 16-byte loads in flight, half as many when many tokens share each load.
__device__ constexpr int ahead_steps(int rows, int tt) {
    const int loads = tt <= 2 ? 8 : 4;
    return loads / rows > 1 ? loads / rows : 1;
}

template <typename W, int TT>
__global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear_rows(const float* __restrict__ x, int T, int In,
            const W* __restrict__ w0, const float* __restrict__ bias0, float* __restrict__ out0, int Out0,
            const W* __restrict__ w1, const float* __restrict__ bias1, float* __restrict__ out1, int Out1,
            const W* __restrict__ w2, const float* __restrict__ bias2, float* __restrict__ out2, int Out2) {
    __shared__ float partial[LINEAR_WARPS][LINEAR_ROWS][TT];
    constexpr int V = Vec<W>::N;
    const int tiles = (T + TT - 1) / TT;
    const int blocks0 = tiles * ((Out0 + LINEAR_ROWS - 1) / LINEAR_ROWS);
    const int blocks01 = blocks0 + tiles * ((Out1 + LINEAR_ROWS - 1) / LINEAR_ROWS);
    int block = blockIdx.x;  // this block's index among its matrix's blocks
    const W* w = w0;
    const float* bias = bias0;
    float* out = out0;
    int Out = Out0;
    if (block >= blocks01) {
        block -= blocks01;
        w = w2, bias = bias2, out = out2, Out = Out2;
    } else if (block >= blocks0) {
        block -= blocks0;
        w = w1, bias = bias1, out = out1, Out = Out1;
    }
    const int tile = block % tiles, row0 = (block / tiles) * LINEAR_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t0 = tile * TT, n = min(TT, T - t0);
    const W* rows[LINEAR_ROWS];
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) rows[r] = w + static_cast<long long>(min(row0 + r, Out - 1)) * In;
    if (tile == 0 && threadIdx.x < LINEAR_ROWS && row0 + threadIdx.x < Out) {
        // the weights only: the kernel before may still run
        prefetch_l2(w + static_cast<long long>(row0 + threadIdx.x) * In, In * sizeof(W));
    }
    pdl_wait();
    const float* xs[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) xs[j] = x + static_cast<long long>(t0 + min(j, n - 1)) * In;
    float acc[LINEAR_ROWS][TT] = {};
    dot_tile<W, LINEAR_ROWS, TT, ahead_steps(LINEAR_ROWS, TT)>(rows, xs, n, In, (warp * 32 + lane) * V,
                                                             LINEAR_WARPS * 32 * V, acc);
#pragma unroll
    for (int r = 0; r < LINEAR_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            const float s = warp_sum(acc[r][j]);
            if (lane == 0) partial[warp][r][j] = s;
        }
    }
    __syncthreads();
    if (threadIdx.x < LINEAR_ROWS * TT) {
        const int r = threadIdx.x / TT, j = threadIdx.x % TT, row = row0 + r;
        if (j < n && row < Out) {
            float s = bias != nullptr ? bias[row] : 0.f;
#pragma unroll
            for (int k = 0; k < LINEAR_WARPS; ++k) s += partial[k][r][j];
            out[static_cast<long long>(t0 + j) * Out + row] = s;
        }
    }
}

constexpr int HEAD_TEAM = 16;      // lanes on one row of per_head_rows
constexpr int HEAD_TEAM_ROWS = 4;  // rows a team of lanes takes, their loads in flight together
constexpr int HEAD_ROWS = LINEAR_WARPS * 32 / HEAD_TEAM * HEAD_TEAM_ROWS;  // rows a block takes

template <typename W, int TT>
__global__ void __launch_bounds__(LINEAR_WARPS * 32)
per_head_rows(const float* __restrict__ x, long long x_token, long long x_head, const W* __restrict__ w,
              float* __restrict__ out, int T, int heads, int In, int Out) {
    constexpr int V = Vec<W>::N;
    const int tiles = (T + TT - 1) / TT;
    const int tile = blockIdx.x % tiles, h = blockIdx.y;
    const int row0 = (blockIdx.x / tiles) * HEAD_ROWS + threadIdx.x / HEAD_TEAM * HEAD_TEAM_ROWS;
    const int member = threadIdx.x % HEAD_TEAM;  // this lane's place on its rows
    const int t0 = tile * TT, n = min(TT, T - t0);
    const W* rows[HEAD_TEAM_ROWS];
#pragma unroll
    for (int r = 0; r < HEAD_TEAM_ROWS; ++r) {
        rows[r] = w + (static_cast<long long>(h) * Out + min(row0 + r, Out - 1)) * In;
    }
    pdl_wait();
    const float* xs[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) xs[j] = x + (t0 + min(j, n - 1)) * x_token + h * x_head;
    float acc[HEAD_TEAM_ROWS][TT] = {};
    dot_tile<W, HEAD_TEAM_ROWS, TT, ahead_steps(HEAD_TEAM_ROWS, TT)>(rows, xs, n, In, member * V, HEAD_TEAM * V, acc);
#pragma unroll
    for (int r = 0; r < HEAD_TEAM_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            float sum = acc[r][j];
#pragma unroll
            for (int offset = HEAD_TEAM / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
            if (member == 0 && j < n && row0 + r < Out) {
                out[(static_cast<long long>(t0 + j) * heads + h) * Out + row0 + r] = sum;
            }
        }
    }
}

template <typename W>
__global__ void to_storage(const float* __restrict__ x, W* __restrict__ y, long long n) {
    pdl_wait();
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_float<W>(x[i]);
}

template <typename W>
__global__ void to_storage_split(const float* __restrict__ x, W* __restrict__ hi_lo, long long n) {
    pdl_wait();
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const W hi = from_float<W>(x[i]);
    hi_lo[i] = hi;
    hi_lo[n + i] = from_float<W>(x[i] - to_float(hi));
}
