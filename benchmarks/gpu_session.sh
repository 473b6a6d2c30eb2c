#!/usr/bin/env bash
# One session on a GPU machine: install, GPU tests, decode benchmark; logs and JSON results under $OUT.
#   COLIBRI_COMMIT=<hash> OUT=<dir> benchmarks/gpu_session.sh
# Carried wheels in .whl/ (orjson, which the image lacks) are installed first. Each stage has its own time limit
# so the benchmark runs even if the tests fail.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/colibri-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv

echo "== GPU tests"
timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" \
  tests/test_gpu_kernels.py tests/test_gpu_model.py 2>&1 | tee "$OUT/pytest_gpu.log" | grep -v "^\.*\s*\[" | tail -60

echo "== decode benchmark"
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/decode.py --out "$OUT/decode_h200.json" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/decode.log" | tail -40
