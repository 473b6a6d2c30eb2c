#!/usr/bin/env bash
# Installs NVRTC, the CUDA headers and CuPy's NVRTC bindings as wheels into folder $1 (about 230 MB to download),
# apart from the test environment: tests/test_kernel_compile.py, given COLIBRI_NVRTC_SITE=$1, compiles every
# kernels/*.cu in a child process that alone sees them, so no other test finds CuPy on a machine without a GPU.
set -euo pipefail
site=${1:?usage: .ci/nvrtc_site.sh FOLDER}
python -m pip install -q --no-deps --target "$site" "cupy-cuda12x>=13.3" fastrlock cuda-pathfinder \
  nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
