#!/usr/bin/env bash
# One call on a GPU machine does everything for the CUDA backend: build, run test_cuda,
# compute-sanitizer (memcheck on the whole suite, racecheck on the shared-memory kernels),
# the kernel benchmarks; logs go to $OUT (or ./gpu_check_out), a short table is printed last.
#   usage: scripts/gpu_check.sh [test|bench|e2e|all|quick|ladders] [gtest filter for racecheck]
#     test: test_cuda and the GPU tests of test_nn/test_autograd/test_cli, then the sanitizers;
#     bench: the kernel benchmarks; e2e: the GPT-2 training benchmark next to PyTorch;
#     quick: test without sanitizers, then e2e; all: everything but the ladders;
#     ladders: builds only tessera_ladders, runs every kernel ladder (ladders/README.md; about
#     a minute), then memcheck and racecheck over their small shapes (--check-only);
#     LADDERS_S=300 and LADDERS_SAN_S=120 (per sanitizer) limit them.
#   time limits (s): MEMCHECK_S=300 (per shard) RACECHECK_S=120 ATTN_RACECHECK_S=200 (0 skips)
#   BENCH_S=150
#   On a lent machine, carry .deps/cudnn_frontend (scripts/setup.sh fetches it; git ignores it):
#   without it the cuDNN attention path is not built and its tests skip (the summary's build
#   line says which).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
SAN_FILTER=${2:-'CudaFused.*:CudaSoftmax.*:CudaReduce.*:CudaLayerNorm.*:CudaCrossEntropy.*'}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0   # never NVLink multicast on the lent machines
export PATH=/usr/local/cuda/bin:$PATH
export TESSERA_PYTHON=${TESSERA_PYTHON:-python3}  # the GPU machine's torch lives there
JOBS=$(nproc)
summary=()

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
echo "GPU: $(cat "$OUT/gpu.txt")"

# CMake older than 3.26 does not know nvcc's C++20 flag: name it (harmless where it does).
# Symbols other layers have declared but not yet defined must not stop the CUDA programs
# from linking (functions bind lazily; these programs do not call them).
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTESSERA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
  -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
  > "$OUT/configure.log" 2>&1
targets=(test_cuda test_nn test_autograd test_cli test_kernels tessera_cli bench_cuda_kernels bench_gpt2_train bench_llama_train)
[[ $MODE == ladders ]] && targets=(tessera_ladders)
if ! cmake --build build-gpu -j "$JOBS" --target "${targets[@]}" > "$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40
  echo "BUILD FAILED (see build.log)"
  exit 1
fi
summary+=("build: ok in $(( $(date +%s) - t0 )) s; $(grep -oE 'cuDNN attention path: [a-z ]+' "$OUT/configure.log" | head -1)")
# Registers, spills (local memory) and shared memory of every kernel.
cuobjdump --dump-resource-usage build-gpu/libtessera.so 2>/dev/null | c++filt > "$OUT/resources.log"
grep -B1 -E "LOCAL:[1-9]|STACK:[1-9]" "$OUT/resources.log" | grep -oE "Function [^ ]+|LOCAL:[0-9]+|STACK:[0-9]+" \
  | paste - - - | head -20 > "$OUT/spills.log"
[[ -s $OUT/spills.log ]] && summary+=("kernels with local memory (spills): $(wc -l < "$OUT/spills.log")")

if [[ $MODE == test || $MODE == all || $MODE == quick ]]; then
  ./build-gpu/tests/cuda/test_cuda --gtest_brief=1 > "$OUT/test.log" 2>&1
  rc=$?
  grep -E "FAILED|Failure|error|expected|Which is|got" "$OUT/test.log" | head -60
  summary+=("test_cuda: rc=$rc, $(grep -E '^\[  PASSED  \]' "$OUT/test.log" | head -1) $(grep -E '^\[  FAILED  \].*tests?, listed' "$OUT/test.log" | head -1)")
  # The GPU tests of the other suites (GPT on CUDA, PyTorch parity, CUDA gradients, attention,
  # the fused element-wise routes on both devices).
  gpu_filter='*Cuda*:*CUDA*:*Gpu*:*GPU*:GPTParity.*:*Flash*:*Attention*:*Qkv*:*HuggingFace*:FusedDropout.*:FusedGeluErf.*'
  for suite in nn autograd cli kernels; do
    program=$(find build-gpu/tests -name "test_$suite" -type f | head -1)
    "$program" --gtest_brief=1 --gtest_filter="$gpu_filter" > "$OUT/test_$suite.log" 2>&1
    rc=$?
    grep -E "FAILED|Failure|expected|Which is|parity" "$OUT/test_$suite.log" | head -30
    summary+=("test_$suite (GPU filter): rc=$rc, $(grep -E '^\[  PASSED  \]' "$OUT/test_$suite.log" | head -1) $(grep -cE '^\[  SKIPPED \] [A-Z]' "$OUT/test_$suite.log") skipped")
  done
fi
if [[ $MODE == test || $MODE == all || $MODE == quick ]]; then
  # The kernel tracer (docs/profiling.md) on a probe with known kernels, graphs and overlap.
  if cmake --build build-gpu -j "$JOBS" --target tessera_kernel_trace kernel_trace_probe >> "$OUT/build.log" 2>&1; then
    (cd build-gpu && ctest -R '^kernel_trace_gpu$' --output-on-failure) > "$OUT/kernel_trace.log" 2>&1
    summary+=("kernel tracer (ctest kernel_trace_gpu): rc=$? $(grep -E 'tests passed|Skipped' "$OUT/kernel_trace.log" | head -1)")
  else
    summary+=("kernel tracer: not built (see build.log)")
  fi
fi
if [[ $MODE == test || $MODE == all ]]; then
  # The whole suite under memcheck takes over 5 minutes in one process: four gtest shards
  # share the GPU at once (the sanitizer's cost is on the CPU), about 2 minutes in all.
  shards=4 failed=0
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${MEMCHECK_S:-300}" \
      compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
      ./build-gpu/tests/cuda/test_cuda --gtest_brief=1 \
      --gtest_filter=-CudaRuntime.OutOfMemoryIsItsOwnError > "$OUT/memcheck_$i.log" 2>&1 &
  done
  for ((i = 0; i < shards; ++i)); do wait -n || failed=$((failed + 1)); done
  summary+=("memcheck (all tests but the deliberate OOM, $shards shards): $failed shards failed; $(cat "$OUT"/memcheck_*.log | grep -E 'ERROR SUMMARY' | sort | uniq -c | tr -s ' ' | tr '\n' ';')")
  # The fused element-wise kernels' tests live in test_kernels (they compare both devices).
  kernels_program=$(find build-gpu/tests -name test_kernels -type f | head -1)
  timeout "${MEMCHECK_S:-300}" compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 \
    "$kernels_program" --gtest_brief=1 --gtest_filter='FusedDropout.*:FusedGeluErf.*' \
    > "$OUT/memcheck_kernels.log" 2>&1
  summary+=("memcheck (test_kernels FusedDropout/FusedGeluErf): rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_kernels.log" | tail -1)")
  if [[ ${RACECHECK_S:-120} -gt 0 ]]; then
    timeout "${RACECHECK_S:-120}" compute-sanitizer --tool racecheck --error-exitcode 9 \
      ./build-gpu/tests/cuda/test_cuda --gtest_brief=1 --gtest_filter="$SAN_FILTER" > "$OUT/racecheck.log" 2>&1
    summary+=("racecheck ($SAN_FILTER): rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | tail -1)")
  fi
  # Tessera's own attention kernels (Hopper wgmma/TMA forward and backward, the masked and
  # dropout entries) under racecheck; TESSERA_ATTENTION=flash keeps cuDNN's generated kernels,
  # whose mbarrier synchronisation racecheck does not follow, out of it.
  if [[ ${ATTN_RACECHECK_S:-200} -gt 0 ]]; then
    attention_filter='AttentionSm90Cuda.DirectAgainstFloat64:AttentionSm90BackwardCuda.DirectAgainstFloat64AndRepeatable:FlashMaskedAttention.KernelEntriesWriteTheLogSumExp:AttentionDropoutCuda.KernelsMatchFloat64WithTheMaskOfTheSamePhiloxNumbers'
    TESSERA_ATTENTION=flash timeout "${ATTN_RACECHECK_S:-200}" compute-sanitizer --tool racecheck --error-exitcode 9 \
      ./build-gpu/tests/cuda/test_cuda --gtest_brief=1 --gtest_filter="$attention_filter" > "$OUT/racecheck_attention.log" 2>&1
    summary+=("racecheck (attention kernels): rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_attention.log" | tail -1)")
  fi
fi

if [[ $MODE == bench || $MODE == all ]]; then
  timeout "${BENCH_S:-150}" ./build-gpu/benchmarks/bench_cuda_kernels --benchmark_counters_tabular=true \
    > "$OUT/bench.log" 2>&1
  summary+=("bench: rc=$?")
fi

if [[ $MODE == e2e || $MODE == all || $MODE == quick ]]; then
  # The step as `tessera train` runs it (a replayed CUDA graph) next to PyTorch, then the
  # phases of an eager step.
  timeout "${E2E_S:-300}" ./build-gpu/benchmarks/bench_gpt2_train > "$OUT/e2e.log" 2>&1
  summary+=("bench_gpt2_train: rc=$?")
  timeout "${E2E_S:-300}" ./build-gpu/benchmarks/bench_gpt2_train --profile --no-torch >> "$OUT/e2e.log" 2>&1
  summary+=("bench_gpt2_train --profile (eager steps): rc=$?")
  timeout "${E2E_S:-300}" ./build-gpu/benchmarks/bench_llama_train > "$OUT/e2e_llama.log" 2>&1
  summary+=("bench_llama_train: rc=$?")
fi

if [[ $MODE == ladders ]]; then
  ladders=./build-gpu/ladders/tessera_ladders
  timeout "${LADDERS_S:-300}" "$ladders" all > "$OUT/ladders.log" 2>&1
  summary+=("ladders: rc=$? ($(grep -c MISMATCH "$OUT/ladders.log") mismatching rungs)")
  # Small shapes only; racecheck on the ladders' own kernels (test_cuda's covers production).
  for tool in memcheck racecheck; do
    flags=(--check-only)
    [[ $tool == racecheck ]] && flags+=(--own-kernels)
    timeout "${LADDERS_SAN_S:-120}" compute-sanitizer --tool $tool --error-exitcode 9 "$ladders" \
      "${flags[@]}" all > "$OUT/ladders_$tool.log" 2>&1
    summary+=("ladders $tool ${flags[*]}: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/ladders_$tool.log" | tail -1)")
  done
fi

echo "==== summary ===="
printf '%s\n' "${summary[@]}"
[[ -f $OUT/e2e.log ]] && grep -vE "^GPT-2 training" "$OUT/e2e.log" | cut -c1-160
[[ -f $OUT/ladders.log ]] && grep -E "^ceilings|^\||MISMATCH|FAILED|unwritten|every rung|do not match" \
  "$OUT/ladders.log" | cut -c1-200
[[ -f $OUT/e2e_llama.log ]] && grep -vE "^Llama training" "$OUT/e2e_llama.log" | cut -c1-160
if [[ -f $OUT/bench.log ]]; then
  grep -E "ceilings|^BM_|^Benchmark" "$OUT/bench.log" | cut -c1-200
fi
