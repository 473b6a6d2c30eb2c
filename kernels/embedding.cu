// Launch contract
//
// embedding<W>: out[t, :] = float(table[ids[t], :]).
//   table W [V, H] contiguous (W: float, __nv_bfloat16, __half); ids int64 [T]; out float32 [T, H].
//   grid: (T, ceil(H / (EMBEDDING_THREADS * Vec<W>::N))), block: EMBEDDING_THREADS threads, each on one 16-byte
//   chunk of the row (element by element where rows are not 16-byte aligned), so a row is one round of loads.
#include "common.cuh"

constexpr int EMBEDDING_THREADS = 256;

template <typename W>
__global__ void __launch_bounds__(EMBEDDING_THREADS)
embedding(const W* __restrict__ table, const long long* __restrict__ ids, float* __restrict__ out, int H) {
    constexpr int V = Vec<W>::N;
    pdl_wait();
    const long long t = blockIdx.x;
    const W* row = table + ids[t] * H;
    float* dst = out + t * H;
    const int start = (blockIdx.y * EMBEDDING_THREADS + threadIdx.x) * V;
    if (start >= H) return;
    if (H % V == 0 && reinterpret_cast<unsigned long long>(table) % 16 == 0) {  // 16-byte aligned rows
        float values[V];
        Vec<W>::load(row + start, values);
#pragma unroll
        for (int i = 0; i < V; i += 4) {
            *reinterpret_cast<float4*>(dst + start + i) = make_float4(values[i], values[i + 1], values[i + 2],
                                                                      values[i + 3]);
        }
    } else {
        for (int i = start; i < min(start + V, H); ++i) dst[i] = to_float(row[i]);
    }
}
