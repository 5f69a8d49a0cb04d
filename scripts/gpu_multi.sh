#!/usr/bin/env bash
# One call on a multi-GPU machine does the multi-GPU measurements: builds what they need
# (build-gpu: the library, the CLI, the two examples), then
#   1. benchmarks/cuda/bench_dist.sh, train part: `tessera train --dtype bf16` on 1 GPU and on 2,
#      next to PyTorch eager DDP on 2 (issue 10's two ratios);
#   2. benchmarks/cuda/bench_scaling.sh N: GPT-2 124M/350M under DDP and ZeRO 1-3 on 1..N GPUs
#      next to PyTorch DDP, ZeroRedundancyOptimizer and FSDP; all-reduce and reduce-scatter bus
#      bandwidth; the per-rank memory report at W = N (issues 11 and 16), as markdown.
# Everything runs under time limits that end before TOTAL_S, so partial results and the summary
# are always printed; logs go to $OUT (or ./gpu_multi_out).
#   usage: scripts/gpu_multi.sh [N]      (N GPUs for the scaling table; default: all, at most 8)
#   env: TOTAL_S=570 (the whole call), BUILD_S=400 (configure + build; the benchmarks get what
#        is left), BUILD (build-gpu),
#        PARTS="dist,scaling" (which of 1. and 2. run; a second call on the still-warm machine
#        finds build-gpu built and can give the scaling table all its time, e.g.
#        PARTS=scaling MODELS=350M scripts/gpu_multi.sh 4), and bench_scaling.sh's MODELS, STEPS, ...
#        GPU_MULTI_DRY_RUN=1: check the script on a CPU-only machine (BUILD defaults to
#        build-cpu, which must be configured; tiny GPT, CPU ranks)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-570}
END=$((T0 + TOTAL_S))
export OUT=${OUT:-$PWD/gpu_multi_out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on the lent machines
export TESSERA_PYTHON=${TESSERA_PYTHON:-python3}
summary=()
elapsed() { echo $(($(date +%s) - T0)); }

if [[ ${GPU_MULTI_DRY_RUN:-0} == 1 ]]; then
  export BENCH_DRY_RUN=1
  BUILD=${BUILD:-build-cpu}
  N=${1:-4}
  echo "dry run on the CPU: $N ranks, $BUILD"
else
  BUILD=${BUILD:-build-gpu}
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
  N=${1:-$((gpus < 8 ? gpus : 8))}
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
  echo "GPUs: $gpus"; cat "$OUT/gpu.txt"
  nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
  if ((gpus < 2)); then
    echo "gpu_multi.sh needs at least 2 GPUs (found $gpus)"
    exit 1
  fi
  ((N > gpus)) && N=$gpus
fi

# ---- build: only what the benchmarks run (configure flags as scripts/gpu_check.sh) ----
if [[ ${GPU_MULTI_DRY_RUN:-0} != 1 ]]; then
  timeout "${BUILD_S:-400}" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DTESSERA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" \
    -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
    -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
    -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCHMARKS=OFF -DTESSERA_MPI=OFF \
    > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
fi
left=$((T0 + ${BUILD_S:-400} - $(date +%s)))
if ! timeout "$((left > 10 ? left : 10))" cmake --build "$BUILD" -j "$(nproc)" \
    --target tessera_cli example_gpt_ddp_throughput example_allreduce_bandwidth > "$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40
  tail -5 "$OUT/build.log"
  echo "BUILD FAILED or too slow after $(elapsed) s (see build.log)"
  exit 1
fi
summary+=("build: ok at $(elapsed) s")
echo "build: ok at $(elapsed) s"

PARTS=${PARTS:-dist,scaling}
# ---- 1. issue 10: tessera train on 1 and 2 GPUs vs PyTorch eager DDP ----
if [[ ",$PARTS," == *,dist,* ]]; then
  echo "==== bench_dist.sh (tessera train) ===="
  dist_end=$(($(date +%s) + ${DIST_S:-130}))
  ((dist_end > END - 20)) && dist_end=$((END - 20))
  OUT=$OUT/dist BENCH_PARTS=train DEADLINE=$dist_end RUN_CAP_S=70 \
    bash benchmarks/cuda/bench_dist.sh "$BUILD" 2 2>&1 | tee "$OUT/bench_dist.log"
  summary+=("bench_dist (train): done at $(elapsed) s")
fi

# ---- 2. issues 11 and 16: the scaling table ----
if [[ ",$PARTS," == *,scaling,* ]]; then
  echo "==== bench_scaling.sh $N ===="
  OUT=$OUT/scaling DEADLINE=$((END - 15)) bash benchmarks/cuda/bench_scaling.sh "$N" "$BUILD" 2>&1 \
    | tee "$OUT/bench_scaling.log"
  summary+=("bench_scaling $N: done at $(elapsed) s")
fi

echo "==== summary ===="
printf '%s\n' "${summary[@]}"
grep -E "GPUs / 1 GPU|tessera / PyTorch|failed" "$OUT/bench_dist.log" 2>/dev/null | sed 's/^/  /'
grep -E "^2 GPUs, " "$OUT/scaling/table.md" 2>/dev/null | sed 's/^/  /'
echo "tables: $OUT/scaling/table.md (append to benchmarks/cuda/NOTES.md); logs: $OUT"
echo "total: $(elapsed) s"
