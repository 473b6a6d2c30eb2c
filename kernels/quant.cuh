// Building blocks of the quantized-expert kernels (moe_int4.cu, moe_fp8.cu): a lane's share of a chunk of codes
// streamed into its slot of the weight ring (mma.cuh), and where a row's scales and zero points lie.
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

// The scales of matrix row `row` (clamped to a real row by the caller) of slot `slot`: its row block's entries.
__device__ __forceinline__ const float* scale_row(const float* scales, long long slot, long long s_stride, int row,
                                                  int row_block, int scale_cols) {
    return scales + slot * s_stride + static_cast<long long>(row / row_block) * scale_cols;
}

// The zero points of an int4 row (null when the matrix is symmetric).
__device__ __forceinline__ const unsigned char* zero_row(const unsigned char* zeros, long long slot,
                                                         long long z_stride, int row, int scale_cols) {
    return zeros != nullptr ? zeros + slot * z_stride + static_cast<long long>(row) * scale_cols : nullptr;
}
