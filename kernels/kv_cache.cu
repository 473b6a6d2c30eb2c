// Launch contract
//
// write_kv<KV>: store each token's key and value rows into its slot of the paged caches.
//   key, value            float32 [T, K*D] contiguous (width = K*D)
//   key_cache, value_cache KV [num_blocks, block_size, K, D]: slot s = block * block_size + row owns the
//                          width elements at s * width; KV is float, __nv_bfloat16 or __half (the KV cache's
//                          dtype), each value rounded to nearest when stored
//   slots                 int64 [T]; a negative slot skips the token (padding rows of a captured batch)
//   grid.x: T, block: 128 threads striding over width.
#include "common.cuh"

template <typename KV>
__global__ void write_kv(const float* __restrict__ key, const float* __restrict__ value,
                         KV* __restrict__ key_cache, KV* __restrict__ value_cache,
                         const long long* __restrict__ slots, int width) {
    pdl_wait();
    const long long t = blockIdx.x;
    const long long slot = slots[t];
    if (slot < 0) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        key_cache[slot * width + i] = from_float<KV>(key[t * width + i]);
        value_cache[slot * width + i] = from_float<KV>(value[t * width + i]);
    }
}
