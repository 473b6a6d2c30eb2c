"""Weight products on cuBLAS tensor cores with float32 activations: the activations' parts, and one GEMM call.

The backend keeps activations in float32 and weights in bf16/fp16. To multiply them on tensor cores, the
activations are cut into parts of the weight's type (`activation_parts`): at matmul precision "high" (the
default) a high and a low part (x = hi + lo to about 16 significant bits), at "medium" one part (x rounded, about 8
bits for bf16, what engines that keep bf16 activations compute). Every part is multiplied by the weight with
float32 accumulation: as one GEMM of the parts' rows (dense projections, cupy_backend) or as one GEMM per part
into the same output, each after the first adding to it (routed experts per expert, cupy_expert_gemm).

`weight_product` is that GEMM on raw pointers, so a caller can multiply a slice of rows by one expert's matrix in
place. Inside a CUDA-graph capture it calls cuBLAS through ctypes (captured_cublas.py), since CuPy's wrappers
refuse to run there. `per_head_products` multiplies each head of the activations by its own matrix (latent
attention's up-projections) as one strided batched GEMM per part, outside captures; `per_head_expansion` takes bf16
rows that every head shares through each head's matrix into bf16 (latent attention's decompressed prefill).
"""

from __future__ import annotations

import numpy as np

from ..config import MATMUL_PRECISIONS
from .cupy_launch import Array, ceil_div, launch, storage_type


# by matmul precision (EngineConfig.matmul_precision): the parts of float32 activations in tensor-core products
ACTIVATION_PARTS = dict(zip(MATMUL_PRECISIONS, (2, 1)))


def activation_parts(x: Array, like: Array, parts: int) -> Array:
    """x float32 [T, In] (contiguous) as [parts * T, In] of `like`'s dtype (bf16 bits or fp16): rows 0..T-1 x
    rounded; with two parts, rows T..2T-1 the rounding error x - hi, rounded."""
    import cupy

    t, n_in = x.shape
    w = storage_type(like)
    out = cupy.empty((parts * t, n_in), like.dtype)  # [parts * T, In]
    kernel = {1: "to_storage", 2: "to_storage_split"}[parts]
    launch("linear.cu", f"{kernel}<{w}>", (ceil_div(x.size, 256),), 256, (x, out, np.int64(x.size)),
           weight_type=w)
    return out


def _cuda_type(weight_dtype) -> int:
    """cuBLAS's data type of a weight dtype: uint16 (bf16 bits) or float16."""
    from cupy.cuda import runtime

    return runtime.CUDA_R_16BF if np.dtype(weight_dtype) == np.uint16 else runtime.CUDA_R_16F


def weight_product(out: int, out_stride: int, weight: int, weight_stride: int, weight_dtype, n_out: int, n_in: int,
                   inputs: int, input_stride: int, rows: int, accumulate: bool) -> None:
    """out[r, :n_out] (+)= inputs[r, :n_in] . weight[:n_out, :n_in]^T for r < rows, in float32 on the current
    stream: `out` float32, `weight` and `inputs` of `weight_dtype` (uint16 bf16 bits or float16), all row-major
    device pointers with row strides in elements; `accumulate` adds to out (beta 1) instead of overwriting it."""
    import cupy
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas

    if rows == 0 or n_out == 0:
        return
    code = _cuda_type(weight_dtype)
    handle = cupy.cuda.device.get_cublas_handle()
    # Column-major view: out^T [n_out, rows] = weight [n_out, n_in] (row-major, so transposed) times inputs^T.
    shape = (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n_out, rows, n_in)
    operands = (weight, code, weight_stride, inputs, code, input_stride)
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        from .captured_cublas import gemm_ex

        gemm_ex(handle, stream.ptr, *shape, *operands, out, runtime.CUDA_R_32F, out_stride,
                cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT, accumulate)
        return
    one, beta = np.ones(1, np.float32), np.full(1, 1.0 if accumulate else 0.0, np.float32)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    a, a_type, lda, b, b_type, ldb = operands
    cublas.gemmEx(handle, *shape, one.ctypes.data, a, a_type, lda, b, b_type, ldb, beta.ctypes.data, out,
                  runtime.CUDA_R_32F, out_stride, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)


def per_head_products(x_parts: Array, weight: Array, num_parts: int) -> Array:
    """out[t, h] = x[t, h] . weight[h]^T with x given as `num_parts` parts (`activation_parts` of its [T, H * In]
    rows), float32 accumulation: one strided batched GEMM per part over the heads, each after the first adding to
    the output.  # x_parts [N * T, H * In], weight [H, Out, In] (bf16 bits or fp16) -> [T, H, Out] float32"""
    import cupy
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas

    heads, n_out, n_in = weight.shape
    t = x_parts.shape[0] // num_parts
    weight = cupy.ascontiguousarray(weight)
    out = cupy.empty((t, heads, n_out), np.float32)  # [T, H, Out]
    if t == 0:
        return out
    code = _cuda_type(weight.dtype)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    one = np.ones(1, np.float32)
    for part in range(num_parts):
        beta = np.full(1, 1.0 if part else 0.0, np.float32)
        inputs = x_parts.data.ptr + part * t * heads * n_in * x_parts.itemsize
        # Column-major per head h: out_h^T [Out, T] (rows of H * Out) = weight_h^T of its row-major [Out, In], times
        # x_h^T [In, T] (rows of H * In, head h from column h * In)
        cublas.gemmStridedBatchedEx(
            handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n_out, t, n_in, one.ctypes.data,
            weight.data.ptr, code, n_in, n_out * n_in, inputs, code, heads * n_in, n_in, beta.ctypes.data,
            out.data.ptr, runtime.CUDA_R_32F, heads * n_out, n_out, heads, cublas.CUBLAS_COMPUTE_32F,
            cublas.CUBLAS_GEMM_DEFAULT)
    return out


def per_head_expansion(x: Array, weight: Array, out: Array, column: int, inputs_first: bool) -> None:
    """out[c, h, column : column + Out] = x[c] . W_h for every head h, float32 accumulation rounded to out's bf16,
    as one strided batched GEMM whose heads share x: W_h = weight[h]^T of weight [H, Out, In], or with
    `inputs_first` W_h = weight[h] of weight [H, In, Out].  # x [C, In], weight (bf16 bits) -> out [C, H, W] bf16"""
    import cupy
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas

    heads = weight.shape[0]
    n_in, n_out = (weight.shape[1], weight.shape[2]) if inputs_first else (weight.shape[2], weight.shape[1])
    rows, width = x.shape[0], out.shape[2]
    if rows == 0:
        return
    code = _cuda_type(weight.dtype)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    # Column-major per head h: out_h^T [Out, C] (rows of H * W, head h from column h * W + column) = W_h^T [Out, In]
    # (weight[h] row-major [Out, In] read transposed, or [In, Out] read as it is) times x^T [In, C] (shared: stride 0)
    op, lda = (cublas.CUBLAS_OP_N, n_out) if inputs_first else (cublas.CUBLAS_OP_T, n_in)
    cublas.gemmStridedBatchedEx(
        handle, op, cublas.CUBLAS_OP_N, n_out, rows, n_in, one.ctypes.data,
        weight.data.ptr, code, lda, n_out * n_in, x.data.ptr, code, n_in, 0, zero.ctypes.data,
        out.data.ptr + column * out.itemsize, runtime.CUDA_R_16BF, heads * width, width, heads,
        cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
