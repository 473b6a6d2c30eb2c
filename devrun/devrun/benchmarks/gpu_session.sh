#!/usr/bin/env bash
# One session on a GPU machine: install, GPU tests, benchmarks; logs and JSON results under $OUT.
#   COLIBRI_COMMIT=<hash> OUT=<dir> STAGES="tests dense kernels decode engine cpu timeline offload" benchmarks/gpu_session.sh
# (STAGES="" only installs: what a command that runs a script of its own needs first).
# Carried wheels in .whl/ (kvikio, orjson: the image lacks them) are installed first. Each stage has its own time
# limit so the next one runs even if one fails. OFFLOAD_ARGS / TIMELINE_ARGS / DECODE_ARGS / ENGINE_ARGS / CPU_ARGS / DENSE_ARGS
# pass options to the benchmarks; the kernels stage profiles one step per kernel with Nsight Compute (KERNEL_SHAPES, KERNEL_BATCHES).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/colibri-gpu}
STAGES=${STAGES-tests decode offload}  # unset: these three; empty: install only
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv

for stage in $STAGES; do
  case $stage in
    tests)
      echo "== GPU tests"
      timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m "gpu or not gpu" -q --maxfail=25 --continue-on-collection-errors -p no:cacheprovider \
        --junitxml="$OUT/pytest_gpu.xml" ${TEST_FILES:-tests/test_kernel_compile.py tests/test_gpu_kernels.py \
        tests/test_gpu_tiers.py tests/test_gpu_engine.py tests/test_gpu_model.py} 2>&1 | tee "$OUT/pytest_gpu.log" \
        | grep -v "^\.*\s*\[" | tail -60 ;;
    decode)
      echo "== decode benchmark"
      timeout "${DECODE_TIMEOUT:-300}" python3 benchmarks/decode.py --out "$OUT/decode_h200.json" ${DECODE_ARGS:-} \
        2>&1 | tee "$OUT/decode.log" | tail -40 ;;
    engine)
      echo "== decode through the engine against the graph alone"
      (cd benchmarks && timeout "${ENGINE_TIMEOUT:-240}" python3 engine_decode.py --out "$OUT/engine_decode_h200.json" \
        ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" | tail -8) ;;
    dense)
      echo "== dense projections: GEMV against tensor cores"
      timeout "${DENSE_TIMEOUT:-240}" python3 benchmarks/dense_projection.py --out "$OUT/dense_projection_h200.json" \
        ${DENSE_ARGS:-} 2>&1 | tee "$OUT/dense.log" | tail -50 ;;
    kernels)
      echo "== one decode step per kernel (Nsight Compute)"
      for shape in ${KERNEL_SHAPES:-qwen3-30b-a3b mixtral-8x7b}; do
        for batch in ${KERNEL_BATCHES:-1}; do
          timeout "${KERNEL_TIMEOUT:-120}" ncu --profile-from-start off --clock-control none --csv \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
            python3 benchmarks/step_kernels.py --shape "$shape" --batch "$batch" --layers 2 \
            > "$OUT/ncu_${shape}_b${batch}.csv" 2> "$OUT/ncu_${shape}_b${batch}.err"
          python3 benchmarks/step_kernels_table.py "$OUT/ncu_${shape}_b${batch}.csv" | tee "$OUT/kernels_${shape}_b${batch}.md" \
            | tail -16
        done
      done ;;
    cpu)
      echo "== CPU expert executor kernels"
      timeout "${CPU_TIMEOUT:-240}" python3 benchmarks/cpu_expert_kernels.py --out "$OUT/cpu_expert_kernels_h200.json" \
        ${CPU_ARGS:---shapes mixtral-8x7b,qwen3-30b-a3b --dtypes bf16 --tokens 1,16 --threads 8,16 --candidates stream,numba} \
        2>&1 | tee "$OUT/cpu.log" | tail -20 ;;
    timeline)
      echo "== offload hand-offs, layer by layer (the CPU's part: worker against thread)"
      timeout "${TIMELINE_TIMEOUT:-300}" python3 benchmarks/offload_timeline.py --out "$OUT/offload_timeline_h200.json" \
        ${TIMELINE_ARGS:---fractions 0.5 0 --modes colibri --cpu-calls worker thread --handoffs stream --steps 16} \
        2>&1 | tee "$OUT/timeline.log" | grep -v "^\s*$" | tail -20 ;;
    offload)
      echo "== offload benchmark"
      timeout "${OFFLOAD_TIMEOUT:-540}" python3 benchmarks/offload.py --out "$OUT/offload_h200.json" \
        ${OFFLOAD_ARGS:-} 2>&1 | tee "$OUT/offload.log" | tail -60 ;;
  esac
done
