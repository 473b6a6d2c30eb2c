#!/usr/bin/env bash
# One session on a GPU machine: install, GPU tests, benchmarks; logs and JSON results under $OUT.
#   COLIBRI_COMMIT=<hash> OUT=<dir> STAGES="tests dense kernels decode engine cpu timeline llama offload" benchmarks/gpu_session.sh
# (other stages: attention, moe_prefill, moe_formats, long_context, quantized, compare, serving, exit)
# (llama_build before other stages: llama.cpp builds in the background while they run, and stage llama waits for it;
#  llama_pack after them brings the build back for LLAMA_PREBUILT in a later call)
# (STAGES="" only installs: what a command that runs a script of its own needs first).
# Carried wheels in .whl/ (kvikio, orjson: the image lacks them) are installed first; GPU tests that start a server
# (tests/test_gpu_tiers.py, test_gpu_quant_experts.py) import the openai client, which the image lacks too: add it with
# its dependencies (`pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
# openai`, about 6 MB). COLIBRI_COMMIT: pass the hash itself (`git rev-parse --short HEAD` run here, not there).
# Each stage has its own time limit so the next one runs even if one fails. OFFLOAD_ARGS / TIMELINE_ARGS / DECODE_ARGS / ENGINE_ARGS / CPU_ARGS / DENSE_ARGS
# / QUANT_ARGS pass options to the benchmarks; the kernels stage profiles one step per kernel with Nsight Compute
# (KERNEL_CASES: SHAPE:BATCH:CONTEXT[:DENSE[:PREFILL]] entries; PREFILL: new tokens per sequence, a prefill chunk
# instead of a decode step).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/colibri-gpu}
STAGES=${STAGES-tests decode offload}  # unset: these three; empty: install only
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${COLIBRI_COMMIT:-}" ]; then  # a copied tree's .git can name an older commit than the files it holds
  echo "COLIBRI_COMMIT is not set: records will name $(git rev-parse --short HEAD 2>/dev/null || echo 'no commit')," \
       "this tree's git HEAD, which a device copy may not have moved with its files" >&2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv

llama_builder=""  # the background build of llama.cpp that stage llama_build started

# bench SECONDS LOG LINES SCRIPT ARGS...: run a benchmark script under a time limit, its output logged to $OUT/LOG
# and its last LINES lines printed
bench() {
  local limit=$1 log=$2 lines=$3
  shift 3
  timeout "$limit" python3 "$@" 2>&1 | tee "$OUT/$log" | tail -"$lines"
}
for stage in $STAGES; do
  case $stage in
    llama_build)
      # start building llama.cpp in the background (stage llama waits for it), so stages that do not time anything
      # (tests, writing the models) run meanwhile
      echo "== llama.cpp: build started in the background"
      build_start=$(date +%s)
      if [ -n "${LLAMA_PREBUILT:-}" ]; then  # parts written by stage llama_pack in an earlier call
        mkdir -p "${LLAMA_BUILD:-/tmp/llama-build}"
        cat "$LLAMA_PREBUILT"/llama-bin.tar.xz.part-* | xz -d | tar -C "${LLAMA_BUILD:-/tmp/llama-build}" -xf -
      fi
      benchmarks/build_llama_cpp.sh "$LLAMA_SRC" "${LLAMA_BUILD:-/tmp/llama-build}" > "$OUT/llama_build.log" 2>&1 &
      llama_builder=$! ;;
    llama_pack)
      # the finished llama.cpp build as xz parts under $OUT (15 MiB each, the size a call brings back), so a later
      # call can carry them instead of building: LLAMA_PREBUILT=<folder of the parts> before stage llama_build
      if [ -n "$llama_builder" ] && ! wait $llama_builder; then tail -20 "$OUT/llama_build.log"; continue; fi
      tar -C "${LLAMA_BUILD:-/tmp/llama-build}" -cf - bin | xz -T0 -6 | split -b 15M - "$OUT/llama-bin.tar.xz.part-"
      llama_builder=""
      ls -la "$OUT"/llama-bin.tar.xz.part-* ;;
    tests)
      echo "== GPU tests"
      # every test marked gpu (the README's GPU test command); TEST_FILES narrows it to some files, TEST_SELECT to
      # the tests a -k expression selects
      timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q --maxfail=25 --continue-on-collection-errors -p no:cacheprovider \
        --junitxml="$OUT/pytest_gpu.xml" ${TEST_FILES:-tests/} ${TEST_SELECT:+-k "$TEST_SELECT"} 2>&1 | tee "$OUT/pytest_gpu.log" \
        | grep -v "^\.*\s*\[" | tail -60 ;;
    decode)
      echo "== decode benchmark"
      bench "${DECODE_TIMEOUT:-300}" decode.log 40 benchmarks/decode.py --out "$OUT/decode_h200.json" ${DECODE_ARGS:-} ;;
    engine)
      echo "== decode through the engine against the graph alone"
      (cd benchmarks && timeout "${ENGINE_TIMEOUT:-240}" python3 engine_decode.py --out "$OUT/engine_decode_h200.json" \
        ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" | tail -8) ;;
    dense)
      echo "== dense projections: GEMV against tensor cores"
      bench "${DENSE_TIMEOUT:-240}" dense.log 50 benchmarks/dense_projection.py --out "$OUT/dense_projection_h200.json" \
        ${DENSE_ARGS:-} ;;
    kernels)
      echo "== one decode (or prefill) step per kernel (Nsight Compute)"
      for case in ${KERNEL_CASES:-qwen3-30b-a3b:1:144 mixtral-8x7b:1:144}; do
        IFS=: read -r shape batch context dense prefill <<< "$case"  # dense: leading dense layers (optional)
        name="${shape}_b${batch}_c${context}${dense:+_d$dense}${prefill:+_p$prefill}"
        timeout "${KERNEL_TIMEOUT:-120}" ncu --profile-from-start off --clock-control none --csv \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
          python3 benchmarks/step_kernels.py --shape "$shape" --batch "$batch" --layers 2 --context "$context" ${dense:+--dense-layers "$dense"} \
            ${prefill:+--prefill "$prefill"} \
          > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
        echo "-- $shape, batch $batch, context $context"
        python3 benchmarks/step_kernels_table.py "$OUT/ncu_$name.csv" | tee "$OUT/kernels_$name.md" | tail -16
      done ;;
    cpu)
      echo "== CPU expert executor kernels"
      bench "${CPU_TIMEOUT:-240}" cpu.log 20 benchmarks/cpu_expert_kernels.py --out "$OUT/cpu_expert_kernels_h200.json" \
        ${CPU_ARGS:---shapes mixtral-8x7b,qwen3-30b-a3b --dtypes bf16 --tokens 1,16 --threads 8,16 --candidates stream,numba} ;;
    timeline)
      echo "== offload hand-offs, layer by layer"
      timeout "${TIMELINE_TIMEOUT:-300}" python3 benchmarks/offload_timeline.py --out "$OUT/offload_timeline_h200.json" \
        ${TIMELINE_ARGS:---fractions 0.5 0 --modes colibri --steps 16} \
        2>&1 | tee "$OUT/timeline.log" | grep -v "^\s*$" | tail -20 ;;
    llama)
      # llama.cpp as a baseline. LLAMA_SRC: a llama.cpp source tree (not part of the project: carried, or fetched
      # where the machine can). llama-bench and llama-batched-bench are built in LLAMA_BUILD while each model of
      # LLAMA_MODELS ("shape:layers:n-cpu-moe list", e.g. mixtral-8x7b:8:8,4,0) is written as a native folder
      # /tmp/colibri-SHAPE-LAYERS and as GGUF next to it; builds and files stay for later stages (offload.py
      # --folder ... --llama-bench ...). Then llama_cpp.py runs each model: decode on the GPU at LLAMA_BATCHES
      # and, where a list is given, offloaded decode and prefill with --n-cpu-moe (LLAMA_WRITE_ONLY=1: no runs).
      echo "== llama.cpp: build, models as GGUF, runs"
      llama_build=${LLAMA_BUILD:-/tmp/llama-build}
      start=${build_start:-$(date +%s)}
      if [ -z "$llama_builder" ]; then
        benchmarks/build_llama_cpp.sh "$LLAMA_SRC" "$llama_build" > "$OUT/llama_build.log" 2>&1 &
        llama_builder=$!
      fi
      for spec in ${LLAMA_MODELS:-mixtral-8x7b:8:8,4,0}; do
        IFS=: read -r shape layers cpu_moe <<< "$spec"
        folder=/tmp/colibri-$shape-$layers
        (cd benchmarks && python3 llama_cpp.py --shape "$shape" --layers "$layers" --folder "$folder" \
          --gguf "$folder.gguf" --gguf-py "$LLAMA_SRC/gguf-py" 2>&1 | tail -3)
        echo "$shape ($layers layers) written after $(( $(date +%s) - start )) s"
      done
      if ! wait $llama_builder; then
        tail -20 "$OUT/llama_build.log"
        continue
      fi
      echo "llama.cpp built after $(( $(date +%s) - start )) s"
      for spec in ${LLAMA_MODELS:-mixtral-8x7b:8:8,4,0}; do
        [ -n "${LLAMA_WRITE_ONLY:-}" ] && break
        IFS=: read -r shape layers cpu_moe <<< "$spec"
        folder=/tmp/colibri-$shape-$layers
        args=(--batched-bench "$llama_build/bin/llama-batched-bench" --batches ${LLAMA_BATCHES:-1 16 64})
        if [ -n "$cpu_moe" ]; then
          args+=(--llama-bench "$llama_build/bin/llama-bench" --n-cpu-moe ${cpu_moe//,/ })
        fi
        (cd benchmarks && timeout "${LLAMA_TIMEOUT:-300}" python3 llama_cpp.py --shape "$shape" --layers "$layers" \
          --folder "$folder" --gguf "$folder.gguf" --gguf-py "$LLAMA_SRC/gguf-py" "${args[@]}" \
          --out "$OUT/llama_cpp_${shape}_h200.json" 2>&1 | tail -8)
      done ;;
    attention)
      echo "== decode attention alone: splits swept against the KV bytes"
      bench "${ATTENTION_TIMEOUT:-240}" attention.log 40 benchmarks/decode_attention.py \
        --out "$OUT/decode_attention_h200.json" ${ATTENTION_ARGS:-} ;;
    moe_prefill)
      echo "== routed experts of a prefill chunk: per-expert GEMMs against moe_mma"
      bench "${MOE_PREFILL_TIMEOUT:-240}" moe_prefill.log 30 benchmarks/moe_prefill.py --out "$OUT/moe_prefill_h200.json" \
        ${MOE_PREFILL_ARGS:-} ;;
    long_context)
      # needs LLAMA_SRC and llama.cpp built (stage llama_build first: this stage waits for it)
      echo "== long context against llama.cpp"
      if [ -n "$llama_builder" ]; then  # the models are written while llama.cpp builds, then timed after it
        timeout "${LONG_TIMEOUT:-540}" python3 benchmarks/long_context.py --write-only --gguf-py "$LLAMA_SRC/gguf-py" \
          --keep-models ${LONG_ARGS:-} 2>&1 | tail -3
        if ! wait $llama_builder; then tail -20 "$OUT/llama_build.log"; continue; fi
        llama_builder=""
      fi
      bench "${LONG_TIMEOUT:-540}" long_context.log 30 benchmarks/long_context.py --out "$OUT/long_context_h200.json" \
        --batched-bench "${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-batched-bench" --gguf-py "$LLAMA_SRC/gguf-py" \
        ${LONG_ARGS:-} ;;
    moe_formats)
      echo "== routed experts per format: bf16, int4, fp8"
      bench "${FORMATS_TIMEOUT:-180}" moe_formats.log 40 benchmarks/moe_formats.py --out "$OUT/moe_formats_h200.json" \
        ${FORMATS_ARGS:-} ;;
    quantized)
      # int4 and fp8 experts against llama.cpp's Q4_0 and Q8_0 of the same weights: decode and offload. Needs LLAMA_SRC
      # (its gguf-py) and llama.cpp built in LLAMA_BUILD (stage llama_build first: this stage waits for it); without
      # them Colibri runs alone and the records say why. The script stops starting cases 90 s before QUANT_TIMEOUT.
      echo "== quantized experts against llama.cpp"
      if [ -n "$llama_builder" ]; then  # the files are written while llama.cpp builds, then timed after it
        timeout "${QUANT_TIMEOUT:-570}" python3 benchmarks/quantized.py --prepare-only \
          --gguf-py "${LLAMA_SRC:-/nonexistent}/gguf-py" ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quantized_prepare.log" | tail -4
        wait $llama_builder || tail -20 "$OUT/llama_build.log"
        llama_builder=""
      fi
      quant_limit=${QUANT_TIMEOUT:-570}
      bench "$quant_limit" quantized.log 40 benchmarks/quantized.py --out "$OUT/quantized_h200.json" \
        --llama-bin "${LLAMA_BUILD:-/tmp/llama-build}/bin" --gguf-py "${LLAMA_SRC:-/nonexistent}/gguf-py" \
        --time-budget $((quant_limit - 90)) ${QUANT_ARGS:-} ;;
    compare)
      # BASELINE_TREE: an older revision's tree (git archive REV colibri_stream kernels benchmarks | tar -x -C DIR)
      echo "== this tree against $BASELINE_TREE"
      eval "compare_args=(${COMPARE_ARGS:-})"  # quoted options stay whole: --decode-args "--shapes ... --batches 1"
      bench "${COMPARE_TIMEOUT:-580}" compare.log 30 benchmarks/compare_revisions.py --baseline-tree "$BASELINE_TREE" \
        --baseline-label "${BASELINE_LABEL:-baseline}" --out "$OUT/compare_revisions_h200.json" "${compare_args[@]}" ;;
    serving)
      echo "== serving against the engine offline"
      bench "${SERVING_TIMEOUT:-400}" serving.log 30 benchmarks/serving_gpu.py --out "$OUT/serving_gpu_h200.json" \
        ${SERVING_ARGS:-} ;;
    exit)
      # exit codes of GPU generate runs whose experts are offloaded (the CPU worker's thread is joined at close)
      echo "== exit codes of offloaded GPU runs"
      folder=/tmp/colibri-exit-mixtral
      python3 -c "from colibri_stream.synthetic import write_synthetic_folder as w; w('$folder', 'mixtral-8x7b', 2)" \
        > /dev/null 2>&1
      cp colibri_stream/default_model/tokenizer* $folder/  # a tokenizer for the text prompt
      codes=""
      for i in $(seq ${EXIT_RUNS:-12}); do
        timeout 120 python3 -m colibri_stream.cli generate --model $folder --device cuda --gpu-memory-limit 4GB \
          --prompt "hello" --max-tokens 8 --ignore-eos --json > /dev/null 2>> "$OUT/exit.err"
        codes="$codes $?"
      done
      echo "exit codes:$codes" ;;
    offload)
      # OFFLOAD_ARGS: offload.py's options. DeepSeek-V3, 1 dense + 2 MoE layers (51 GB a copy: the folder on the disk,
      # its GGUF in /dev/shm), against llama.cpp's llama-bench at 0 % and 50 % of the routed experts on the GPU (one
      # MoE layer's experts on the CPU: --n-cpu-moe 2, with Colibri's layers layout the same split):
      #   OFFLOAD_TIMEOUT=900 OFFLOAD_ARGS="--shape deepseek-v3 --layers 3 --dense-layers 1
      #     --folder /tmp/colibri-deepseek-v3-3-1 --gguf /dev/shm/colibri-deepseek-v3-3-1.gguf --fractions 0 0.5
      #     --batches 1 --sources l2 --modes colibri ondemand --slot-layout layers spread --accelerate-fractions
      #     --llama-bench $LLAMA_BUILD/bin/llama-bench --gguf-py $LLAMA_SRC/gguf-py" STAGES=offload \
      #     benchmarks/gpu_session.sh
      # (the same with --write-only added writes the two files and stops: a first call, then this one times them)
      echo "== offload benchmark"
      if [ -n "$llama_builder" ]; then  # the files are written while llama.cpp builds, then timed after it
        timeout "${OFFLOAD_TIMEOUT:-540}" python3 benchmarks/offload.py --write-only ${OFFLOAD_ARGS:-} 2>&1 | tail -4
        wait $llama_builder || tail -20 "$OUT/llama_build.log"
        llama_builder=""
      fi
      bench "${OFFLOAD_TIMEOUT:-540}" offload.log 60 benchmarks/offload.py --out "$OUT/offload_h200.json" ${OFFLOAD_ARGS:-} ;;
  esac
done
