// Launch contract
//
// embedding<W>: out[t, :] = float(table[ids[t], :]).
//   table W [V, H] contiguous (W: float, __nv_bfloat16, __half); ids int64 [T]; out float32 [T, H].
//   grid.x: T, block: 256 threads striding over H.
#include "common.cuh"

template <typename W>
__global__ void embedding(const W* __restrict__ table, const long long* __restrict__ ids, float* __restrict__ out,
                          int H) {
    pdl_wait();
    const long long t = blockIdx.x;
    const W* row = table + ids[t] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[t * H + i] = to_float(row[i]);
}
