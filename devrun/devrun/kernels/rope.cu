// Launch contract
//
// rotary: rotary position embedding, "rotate half" pairing (dimension i with i + D/2).
//   x         float32 [T, heads, D] contiguous; out float32 [T, heads, D] (not aliasing x)
//   cos, sin  float32 [P, D/2] tables; positions int64 [T], each below P
//   out[t, h, i]       = x[t, h, i] * cos[p, i] - x[t, h, i + D/2] * sin[p, i]
//   out[t, h, i + D/2] = x[t, h, i + D/2] * cos[p, i] + x[t, h, i] * sin[p, i]      (p = positions[t])
//   grid.x: T, block: 256 threads striding over heads * D/2.
#include "common.cuh"

extern "C" __global__ void rotary(const float* __restrict__ x, float* __restrict__ out, const float* __restrict__ cos,
                                  const float* __restrict__ sin, const long long* __restrict__ positions, int heads,
                                  int half) {
    pdl_wait();
    const long long t = blockIdx.x;
    const long long p = positions[t];
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        const long long base = (t * heads + h) * 2 * half;
        const float c = cos[p * half + i], s = sin[p * half + i];
        const float x1 = x[base + i], x2 = x[base + half + i];
        out[base + i] = x1 * c - x2 * s;
        out[base + half + i] = x2 * c + x1 * s;
    }
}
