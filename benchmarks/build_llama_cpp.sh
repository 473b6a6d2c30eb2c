#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-batched-bench and llama-quantize with CUDA: the same-machine baseline of
# benchmarks/offload.py (--llama-bench), benchmarks/llama_cpp.py and benchmarks/quantized.py.
#
# Usage: benchmarks/build_llama_cpp.sh SOURCE_DIR BUILD_DIR [CUDA_ARCHS]
#   SOURCE_DIR  a llama.cpp source tree (a git clone, or vendor/llama.cpp of the llama-cpp-python sdist; the
#               project does not ship it). Its gguf-py/ is what benchmarks/gguf_writer.py writes GGUF files with.
#   BUILD_DIR   where to build; prints the folder of the three binaries on its last line. Reuses a finished build.
#   CUDA_ARCHS  default 90 (H100/H200); one architecture keeps the build to a few minutes on 16 cores.
#   LLAMA_BUILD_JOBS (environment) the build's parallel jobs, default every core (fewer leave cores to what runs beside it)
#
# Flags: CUDA graphs and flash attention on (llama.cpp's defaults), CPU code for this machine (GGML_NATIVE: the
# experts it computes on the CPU use the host's widest vector instructions). Where the CUDA toolkit has no cuBLAS
# (a pip-installed toolkit), the nvidia-cublas wheel's library is linked instead.
set -euo pipefail
src=$(realpath "$1")
build=$(realpath -m "$2")
archs=${3:-90}
if [ -x "$build/bin/llama-bench" ] && [ -x "$build/bin/llama-batched-bench" ] && [ -x "$build/bin/llama-quantize" ]; then
    echo "$build/bin"
    exit 0
fi
mkdir -p "$build"
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" -DGGML_CUDA_NCCL=OFF
       -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
       -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
configure() { cmake -S "$src" -B "$build" "${flags[@]}" "$@" > "$build/configure.log" 2>&1; }
if ! configure; then
    # No cuBLAS next to nvcc (a pip-installed toolkit): link the nvidia-cublas wheel's library (nvidia/cu13 or
    # nvidia/cublas), and the driver's libcuda, under the unversioned names CMake looks for.
    wheel=$(python3 -c '
import glob, os, sys
libs = [lib for root in sys.path for lib in glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublas.so.*"))]
print(os.path.dirname(os.path.dirname(libs[0])) if libs else "")')
    links="$build/cuda-links"
    mkdir -p "$links"
    extra=("-DCMAKE_LIBRARY_PATH=$links")
    if [ -n "$wheel" ]; then
        for lib in "$wheel"/lib/libcublas*.so.*; do
            name=$(basename "$lib")
            ln -sf "$lib" "$links/${name%%.so.*}.so"
        done
        extra+=("-DCMAKE_CUDA_FLAGS=-I$wheel/include" "-DCMAKE_CXX_FLAGS=-I$wheel/include"
                "-DCMAKE_BUILD_RPATH=$wheel/lib")
    fi
    driver=$(ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}')
    if [ -n "$driver" ]; then ln -sf "$driver" "$links/libcuda.so"; fi
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
    if ! configure "${extra[@]}"; then  # still no libcuda: build without CUDA's virtual memory pool
        rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
        configure "${extra[@]}" -DGGML_CUDA_NO_VMM=ON || { tail -30 "$build/configure.log" >&2; exit 1; }
    fi
fi
cmake --build "$build" --target llama-bench llama-batched-bench llama-quantize -j "${LLAMA_BUILD_JOBS:-$(nproc)}" > "$build/build.log" 2>&1 || { tail -40 "$build/build.log" >&2; exit 1; }
echo "$build/bin"
