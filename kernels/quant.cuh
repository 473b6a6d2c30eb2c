// Building blocks of the quantized-expert kernels (moe_int4.cu, moe_fp8.cu): a lane's share of a chunk of codes
// streamed into its slot of the weight ring (mma.cuh).
#pragma once
#include "mma.cuh"

// B bytes from global to shared memory, asynchronously; zero-filled where `in` is false.
template <int B>
__device__ __forceinline__ void copy_async_bytes(uint4* dst, const void* src, bool in) {
    if constexpr (B == 16) {
        copy_async(dst, src, in);
    } else {
        const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(address), "l"(src), "n"(B),
                     "r"(in ? B : 0)
                     : "memory");
    }
}

// Start copying chunk `chunk` of this lane's weight rows (a[m][h]: the row's codes at its first column) into ring
// slot `slot`: a chunk is the quad's 4 lanes side by side, BYTES bytes (LANE_COLS columns) each; lanes whose columns
// start at or past `cols` copy nothing and get zeros.
template <int BYTES, int LANE_COLS, int M>
__device__ __forceinline__ void fetch_codes_chunk(const unsigned char* const (&a)[M][2], int chunk, int slot,
                                                  int cols, WeightRing<M>& ring) {
    const int lane = chunk * 4 + threadIdx.x % 4;  // this lane's place among the row's lane-sized pieces
    const bool in = lane * LANE_COLS < cols;
    const int offset = in ? lane * BYTES : 0;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) copy_async_bytes<BYTES>(&ring[slot][m][h][threadIdx.x], a[m][h] + offset, in);
    }
}
