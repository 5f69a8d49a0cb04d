#!/usr/bin/env bash
# The end-to-end figures of the one-GPU issue, each next to PyTorch (eager and torch.compile)
# timed in the same call: builds the benchmark programs into build-gpu (kept between calls on
# a warm machine), then runs the named points; logs go to $OUT (default ./points_out), the
# table of each point's lines is printed last.
#   usage: benchmarks/cuda/bench_points.sh POINT...
#     bert        BERT-base sequence classifier, lengths 32..512, dynamic padding, dropout 0.1
#     bert-nodrop the same without dropout
#     gpt1.5b     GPT-2 1.5B (48 layers, 25 heads, 1600 channels), batch $BATCH_15B (8)
#     llama1b     a 1.2B Llama (16 layers, 32 heads sharing 8 key/value heads, 2048 channels,
#                 SwiGLU 8192), batch $BATCH_1B (8)
#     350M, 774M  GPT-2 350M and 774M, batch 16 (the sizes' usual benchmark shapes)
#     124M        GPT-2 124M, batch 16
#   env: STEPS (default 10), TESSERA_PYTHON (python with CUDA PyTorch; default python3)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/points_out}
STEPS=${STEPS:-10}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TESSERA_PYTHON=${TESSERA_PYTHON:-python3}

t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_BENCHMARKS=ON \
  -DTESSERA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
  -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 > "$OUT/configure.log" 2>&1
if ! cmake --build build-gpu -j "$(nproc)" \
  --target bench_bert_classify bench_gpt2_train bench_llama_train > "$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -30
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader

run() {  # run NAME PROGRAM ARGS...: the program's table, its log under $OUT/NAME.log
  local name=$1
  shift
  local s=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  echo "== $name (rc $?, $(( $(date +%s) - s )) s): $*"
  grep -vE "^\s*$" "$OUT/$name.log" | tail -12
}

b=build-gpu/benchmarks
for point in "$@"; do
  case $point in
    bert) run bert $b/bench_bert_classify --steps "$STEPS" ;;
    bert-nodrop) run bert_nodrop $b/bench_bert_classify --steps "$STEPS" --dropout 0 ;;
    gpt1.5b) run gpt_1.5b $b/bench_gpt2_train --steps "$STEPS" --batch "${BATCH_15B:-8}" \
               --layers 48 --heads 25 --channels 1600 ;;
    llama1b) run llama_1b $b/bench_llama_train --steps "$STEPS" --batch "${BATCH_1B:-8}" \
               --layers 16 --heads 32 --kv-heads 8 --channels 2048 --intermediate 8192 ;;
    350M) run gpt_350M $b/bench_gpt2_train --steps "$STEPS" --layers 24 --heads 16 --channels 1024 ;;
    774M) run gpt_774M $b/bench_gpt2_train --steps "$STEPS" --layers 36 --heads 20 --channels 1280 ;;
    124M) run gpt_124M $b/bench_gpt2_train --steps "$STEPS" ;;
    *) echo "unknown point '$point' (bert bert-nodrop gpt1.5b llama1b 350M 774M 124M)"; exit 2 ;;
  esac
done
