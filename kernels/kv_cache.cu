// Launch contract
//
// write_kv<KV>: store each token's key and value rows into its slot of the paged caches, divided by k_scale and
// v_scale (1 but for fp8 caches with scales).
//   key, value            float32 [T, K*D] contiguous (width = K*D)
//   key_cache, value_cache KV [num_blocks, block_size, K, D]: slot s = block * block_size + row owns the
//                          width elements at s * width; KV is float, __nv_bfloat16, __half or __nv_fp8_e4m3
//                          (the KV cache's dtype), each value rounded to nearest when stored (fp8 saturated)
//   slots                 int64 [T]; a negative slot skips the token (padding rows of a captured batch)
//   grid.x: T, block: 128 threads striding over width.
#include "kv_types.cuh"

template <typename KV>
__global__ void write_kv(const float* __restrict__ key, const float* __restrict__ value,
                         KV* __restrict__ key_cache, KV* __restrict__ value_cache,
                         const long long* __restrict__ slots, int width, float k_scale, float v_scale) {
    pdl_wait();
    const long long t = blockIdx.x;
    const long long slot = slots[t];
    if (slot < 0) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        key_cache[slot * width + i] = from_float<KV>(key[t * width + i] / k_scale);
        value_cache[slot * width + i] = from_float<KV>(value[t * width + i] / v_scale);
    }
}
