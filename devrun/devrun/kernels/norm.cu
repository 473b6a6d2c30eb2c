// Launch contract
//
// rms_norm: RMSNorm of each row, optionally fused with the residual add.
//   x        float32 [R, N] contiguous
//   residual float32 [R, N] or null; when given, s = x + residual is normalised and written to sum_out
//   weight   float32 [N]
//   out      float32 [R, N]: s / sqrt(mean(s^2) + eps) * weight
//   sum_out  float32 [R, N] or null (must be given with residual)
//   grid.x: R, block: a multiple of 32 (at most 1024) threads striding over N.
#include "common.cuh"

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ residual,
                                    const float* __restrict__ weight, float* __restrict__ out,
                                    float* __restrict__ sum_out, int N, float eps) {
    pdl_wait();
    const long long base = static_cast<long long>(blockIdx.x) * N;
    float squares = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        float v = x[base + i];
        if (residual != nullptr) {
            v += residual[base + i];
            sum_out[base + i] = v;
        }
        squares = fmaf(v, v, squares);
    }
    const float inv = rsqrtf(block_sum(squares) / N + eps);
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const float v = residual != nullptr ? sum_out[base + i] : x[base + i];
        out[base + i] = v * inv * weight[i];
    }
}
