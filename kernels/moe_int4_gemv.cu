// Launch contract
//
// The routed-expert MLP of int4 and mxfp4 experts for a few tokens a step (decode), on CUDA cores: moe_int4.cu's
// job and arguments, where an expert has so few pairs that its tensor-core tiles would be mostly empty. The weights
// are read once per group of up to TT pairs, each warp R rows at a time, each lane 16 bytes of codes (32 columns) of
// every one of its rows per step, so a warp reads 512 contiguous bytes of a row and the lanes keep 2 * R (gate/up)
// or R (down) 16-byte loads in flight per step, two steps ahead.
//
// Numerics as moe_int4.cu's, per chunk of 32 columns: the activations cut by quantize_activations<4>
// (int4_codes.cuh, compiled with this file too) into a scale and int8 parts hi, lo per 32 columns; the codes'
// values (int4_codes.cuh) times those parts summed exactly in int32 by dp4a (Ih, Il); then per chunk one float32
// product s * scale * (254 * Ih + Il - z * C) added into the lane's sum, with s the weight scale and z the zero
// point of the chunk's group and C the chunk's 254 * sum hi + sum lo. A warp's lanes then add their sums.
//
// moe_gate_up_int4_gemv<Codes, TT, R>: act[p, i] = activation(gate_e[i] . x[p / k], up_e[i] . x[p / k]) for every
//   pair p of e. Arguments as moe_gate_up_int4's, with x quantized in chunks of 32 columns.
//   grid: (ceil(I / (GEMV_WARPS * R)), G), block: GEMV_WARPS * 32; each warp R rows of gate and of up.
//
// moe_down_int4_gemv<Codes, TT, R>: y[p, h] = route_weight[p] * (down_e[h] . act[p] + down_bias_e[h]), stored.
//   Arguments as moe_down_int4's without span, with act quantized in chunks of 32 columns.
//   grid: (ceil(H / (GEMV_WARPS * R)), G), block: GEMV_WARPS * 32; each warp R rows.
//
// As in moe.cu: G = min(E, P) groups; blocks with g >= num_groups[0] exit; a group whose slot is negative is
// skipped (its pairs' outputs are left as they are). Rows start row_bytes apart; H and I multiples of 32 (so of R:
// a warp's rows are all real or all past the end); the group width a multiple of 32, so a lane's 32 columns lie in
// one group.
#include "int4_codes.cuh"

constexpr int GEMV_WARPS = 4;
constexpr int GEMV_COLS = 32;  // columns a lane takes per step: 16 bytes of codes, one chunk of the activations
constexpr int GEMV_AHEAD = 2;  // steps whose codes a lane loads before multiplying any
// Blocks a multiprocessor holds at least: registers held to 128 a thread, where every instantiation fits unspilled
constexpr int GEMV_BLOCKS_PER_SM = 4;

// acc[m][r][j] += this lane's share of w_m[r] . x_j over the columns lane * 32, lane * 32 + 1024, ... below
// `cols`: w[m] the codes of matrix m's first row at column 0 (its rows row_bytes apart), scales[m] and zeros[m]
// (null: the format's symmetric zero) its groups' (row r's group of column c at entry r * scale_cols + c /
// col_block), act_rows[j] the quantized activation row of pair j (pairs j >= n are skipped).
template <typename Codes, int M, int R, int TT>
__device__ __forceinline__ void int4_gemv_rows(const unsigned char* const (&w)[M], long long row_bytes,
                                               const typename Codes::Scale* const (&scales)[M],
                                               const unsigned char* const (&zeros)[M], int scale_cols,
                                               int col_block, const QuantActs& acts, const int (&act_rows)[TT], int n,
                                               int cols, float (&acc)[M][R][TT]) {
    constexpr int STEP = 32 * GEMV_COLS;
    const int lane = threadIdx.x % 32;
    for (int c0 = lane * GEMV_COLS; c0 < cols; c0 += GEMV_AHEAD * STEP) {
        uint4 codes[GEMV_AHEAD][M][R];
#pragma unroll
        for (int a = 0; a < GEMV_AHEAD; ++a) {
            const int c = c0 + a * STEP;
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    codes[a][m][r] = c < cols ? __ldg(reinterpret_cast<const uint4*>(w[m] + r * row_bytes + c / 2))
                                              : make_uint4(0, 0, 0, 0);
                }
            }
        }
#pragma unroll
        for (int a = 0; a < GEMV_AHEAD; ++a) {
            const int c = c0 + a * STEP;
            if (c >= cols) break;  // the lane's later steps are past the row too
            const int group = c / col_block, chunk = c / GEMV_COLS;
            float s[M][R];
            int z[M][R];
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    s[m][r] = Codes::scale(scales[m][r * scale_cols + group]);
                    z[m][r] = zeros[m] != nullptr ? zeros[m][r * scale_cols + group] : Codes::SYMMETRIC_ZERO;
                }
            }
#pragma unroll
            for (int j = 0; j < TT; ++j) {
                if (j >= n) continue;  // the same for the whole warp
                const long long offset = static_cast<long long>(act_rows[j]) * acts.W + c;
                const long long entry = static_cast<long long>(act_rows[j]) * acts.chunks + chunk;
                uint4 hi[2], lo[2];
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    hi[v] = *reinterpret_cast<const uint4*>(acts.hi + offset + 16 * v);
                    lo[v] = *reinterpret_cast<const uint4*>(acts.lo + offset + 16 * v);
                }
                const int* xh = reinterpret_cast<const int*>(hi);
                const int* xl = reinterpret_cast<const int*>(lo);
                const float act_scale = acts.scale[entry];
                const int c_sum = acts.corr[entry];
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const unsigned* words = reinterpret_cast<const unsigned*>(&codes[a][m][r]);
                        int ih = 0, il = 0;
#pragma unroll
                        for (int k = 0; k < 4; ++k) {  // columns 8k .. 8k + 7: 0, 2, 4, 6 then 1, 3, 5, 7
                            unsigned even, odd;
                            Codes::columns(words[k], even, odd);
                            ih = __dp4a(static_cast<int>(even), xh[2 * k], ih);
                            ih = __dp4a(static_cast<int>(odd), xh[2 * k + 1], ih);
                            il = __dp4a(static_cast<int>(even), xl[2 * k], il);
                            il = __dp4a(static_cast<int>(odd), xl[2 * k + 1], il);
                        }
                        const int d = QUANT_LO * ih + il - z[m][r] * c_sum;
                        acc[m][r][j] = fmaf(s[m][r] * act_scale, static_cast<float>(d), acc[m][r][j]);
                    }
                }
            }
        }
    }
}

template <typename Codes, int TT, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_PER_SM)
moe_gate_up_int4_gemv(const signed char* __restrict__ x_hi, const signed char* __restrict__ x_lo,
                      const float* __restrict__ x_scale, const int* __restrict__ x_corr,
                      const unsigned char* __restrict__ gate, const unsigned char* __restrict__ up, long long w_stride,
                      long long row_bytes, const typename Codes::Scale* __restrict__ gate_scales,
                      const typename Codes::Scale* __restrict__ up_scales, long long s_stride,
                      const unsigned char* __restrict__ gate_zeros, const unsigned char* __restrict__ up_zeros,
                      long long z_stride, int col_block, int scale_cols, const float* __restrict__ gate_bias,
                      const float* __restrict__ up_bias, long long b_stride, float limit, float alpha,
                      float up_shift, const int* __restrict__ slot_of, const int* __restrict__ group_expert,
                      const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
                      const int* __restrict__ num_groups, float* __restrict__ act, int H, int I, int top_k) {
    pdl_wait();
    const GatedActivation activation{gate_bias, up_bias, b_stride, limit, alpha, up_shift};
    const ExpertGroup group = expert_group(blockIdx.y, num_groups, group_expert, group_start, slot_of);
    if (group.slot < 0) return;
    const long long slot = group.slot;
    const int begin = group.begin, end = group.end;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (row0 >= I) return;  // whole warps leave together
    const QuantActs acts{x_hi, x_lo, x_scale, x_corr, H, H / GEMV_COLS};
    // rows row0 .. row0 + R - 1 of gate and of up (I a multiple of R: all of them real)
    const long long row = slot * w_stride + row0 * row_bytes, entry = slot * s_stride + row0 * scale_cols;
    const unsigned char* const rows[2] = {gate + row, up + row};
    const typename Codes::Scale* const scales[2] = {gate_scales + entry, up_scales + entry};
    const long long zero = slot * z_stride + row0 * scale_cols;
    const unsigned char* const zeros[2] = {gate_zeros != nullptr ? gate_zeros + zero : nullptr,
                                           up_zeros != nullptr ? up_zeros + zero : nullptr};
    for (int base = begin; base < end; base += TT) {
        const int n = min(TT, end - base);
        int pairs[TT], act_rows[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            pairs[j] = sorted_pairs[base + min(j, n - 1)];
            act_rows[j] = pairs[j] / top_k;
        }
        float acc[2][R][TT] = {};
        int4_gemv_rows<Codes, 2, R, TT>(rows, row_bytes, scales, zeros, scale_cols, col_block, acts, act_rows, n, H,
                                        acc);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= n) continue;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float gate_value = warp_sum(acc[0][r][j]), up_value = warp_sum(acc[1][r][j]);
                if (lane == 0) {
                    act[static_cast<long long>(pairs[j]) * I + row0 + r] =
                        activation(slot, row0 + r, gate_value, up_value);
                }
            }
        }
    }
}

template <typename Codes, int TT, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_PER_SM)
moe_down_int4_gemv(const signed char* __restrict__ a_hi, const signed char* __restrict__ a_lo,
                   const float* __restrict__ a_scale, const int* __restrict__ a_corr,
                   const unsigned char* __restrict__ down, long long w_stride, long long row_bytes,
                   const typename Codes::Scale* __restrict__ down_scales, long long s_stride,
                   const unsigned char* __restrict__ down_zeros, long long z_stride, int col_block, int scale_cols,
                   const float* __restrict__ down_bias, long long b_stride, const int* __restrict__ slot_of,
                   const float* __restrict__ route_weights, const int* __restrict__ group_expert,
                   const int* __restrict__ group_start, const int* __restrict__ sorted_pairs,
                   const int* __restrict__ num_groups, float* __restrict__ y, int H, int I) {
    pdl_wait();
    const ExpertGroup group = expert_group(blockIdx.y, num_groups, group_expert, group_start, slot_of);
    if (group.slot < 0) return;
    const long long slot = group.slot;
    const int begin = group.begin, end = group.end;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (row0 >= H) return;
    const QuantActs acts{a_hi, a_lo, a_scale, a_corr, I, I / GEMV_COLS};
    // rows row0 .. row0 + R - 1 of down (H a multiple of R: all of them real)
    const unsigned char* const rows[1] = {down + slot * w_stride + row0 * row_bytes};
    const typename Codes::Scale* const scales[1] = {down_scales + slot * s_stride + row0 * scale_cols};
    const unsigned char* const zeros[1] = {down_zeros != nullptr ? down_zeros + slot * z_stride + row0 * scale_cols
                                                                 : nullptr};
    float bias[R];
#pragma unroll
    for (int r = 0; r < R; ++r) bias[r] = down_bias != nullptr ? down_bias[slot * b_stride + row0 + r] : 0.f;
    for (int base = begin; base < end; base += TT) {
        const int n = min(TT, end - base);
        int pairs[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) pairs[j] = sorted_pairs[base + min(j, n - 1)];
        float acc[1][R][TT] = {};
        int4_gemv_rows<Codes, 1, R, TT>(rows, row_bytes, scales, zeros, scale_cols, col_block, acts, pairs, n, I, acc);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= n) continue;
            const float weight = route_weights[pairs[j]];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float value = warp_sum(acc[0][r][j]);
                if (lane == 0) y[static_cast<long long>(pairs[j]) * H + row0 + r] = (value + bias[r]) * weight;
            }
        }
    }
}
