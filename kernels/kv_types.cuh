// The KV cache's element types beyond the weights' (common.cuh): fp8 e4m3 (__nv_fp8_e4m3, cuda_fp8.h), widened with
// to_float and stored with from_float like float, __nv_bfloat16 and __half. Only the kernels that read or write the
// KV cache include it (and linear.cu, whose to_storage fills one from float32).
#pragma once
#include <cuda_fp8.h>

#include "common.cuh"

__device__ __forceinline__ float to_float(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

// To nearest even, saturated at +-448 (satfinite), as the NumPy backend rounds.
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float v) { return __nv_fp8_e4m3(v); }
