#!/usr/bin/env bash
# One GPU, this tree against an earlier one in the same call: the round's "no figure falls by
# more than 2%" check. Builds both trees (this one into build-gpu, the earlier source tree
# PREV_SRC into PREV_SRC/build-gpu), then times each model with both builds back to back,
# PyTorch (eager, torch.compile) once in the same call, and prints a table of ms/step and the
# ratio new/old.
#   usage: benchmarks/cuda/bench_paired.sh PREV_SRC [build|time|all]
#     PREV_SRC: a source tree of the earlier commit (e.g. `git archive OLD | tar -x -C .prev`)
#     build: build both trees only; time: time only (the builds exist); all (default): both.
#     On the lent GPU machine PREV_SRC travels as a carried, git-ignored folder; a later call
#     that carries it again replaces it there, its build-gpu/ included, and one that does not
#     carry it may find it gone (seen on an H200, session 28): use `all` in every call.
#   env: MODELS (default "124M llama shakespeare"; also 350M, 774M), STEPS (default 20),
#        TESSERA_PYTHON (python with CUDA PyTorch), OUT (logs; default ./paired_out).
set -uo pipefail
cd "$(dirname "$0")/../.."
PREV=${1:?usage: bench_paired.sh PREV_SRC [build|time|all]}
MODE=${2:-all}
OUT=${OUT:-$PWD/paired_out}
MODELS=${MODELS:-"124M llama shakespeare"}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
export TESSERA_PYTHON=${TESSERA_PYTHON:-python3}
targets=(tessera_cli bench_gpt2_train bench_llama_train)

build_tree() {  # build_tree SRC LOG: the benchmark programs of one tree, half the cores each
  cmake -S "$1" -B "$1/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DTESSERA_BUILD_BENCHMARKS=ON -DTESSERA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" \
    -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
    -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 > "$2" 2>&1 &&
    cmake --build "$1/build-gpu" -j $(($(nproc) / 2)) --target "${targets[@]}" "${@:3}" >> "$2" 2>&1
}

if [[ $MODE == build || $MODE == all ]]; then
  t0=$(date +%s)
  # Both trees take the cuDNN attention path only with the frontend headers (scripts/setup.sh
  # fetches them into .deps, which git ignores: carry .deps/cudnn_frontend): the earlier tree
  # uses this one's, so that the two builds differ in their code alone.
  if [[ -d .deps/cudnn_frontend && ! -d $PREV/.deps/cudnn_frontend ]]; then
    mkdir -p "$PREV/.deps" && cp -r .deps/cudnn_frontend "$PREV/.deps/"
  fi
  [[ -d .deps/cudnn_frontend ]] || echo "note: no .deps/cudnn_frontend: both trees build without cuDNN attention"
  build_tree . "$OUT/build_new.log" test_cuda test_nn test_autograd test_cli & new=$!
  build_tree "$PREV" "$OUT/build_prev.log" & old=$!
  wait $new || { grep -E "error|FAILED" "$OUT/build_new.log" | head -30; echo "new tree: BUILD FAILED"; exit 1; }
  wait $old || { grep -E "error|FAILED" "$OUT/build_prev.log" | head -30; echo "previous tree: BUILD FAILED"; exit 1; }
  echo "both trees built in $(($(date +%s) - t0)) s"
fi
[[ $MODE == build ]] && exit 0

# ms/step of one model with one build (Tessera only: --no-torch); the PyTorch line separately.
model_args() {
  case $1 in
    124M) echo "bench_gpt2_train --layers 12 --heads 12 --channels 768" ;;
    350M) echo "bench_gpt2_train --layers 24 --heads 16 --channels 1024" ;;
    774M) echo "bench_gpt2_train --layers 36 --heads 20 --channels 1280" ;;
    llama) echo "bench_llama_train" ;;
  esac
}
# nanoGPT's shakespeare_char shape through `tessera train`, as benchmarks/cuda/bench_small.sh runs it.
SMALL=$(mktemp -d /tmp/tessera-paired.XXXXXX)
python3 - "$SMALL" <<'PY'
import random, struct, sys
random.seed(0)
for name, n in (("train.bin", 400_000), ("val.bin", 40_000)):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack(f"<{n}H", *(random.randrange(65) for _ in range(n))))
PY
small_ms() {  # small_ms BUILD LOG: mean ms/step after the first 10 steps
  rm -rf "$SMALL/run"
  timeout 300 "$1/tessera" train --data "$SMALL/train.bin" --val-data "$SMALL/val.bin" --n-layer 6 \
    --n-head 6 --n-embd 384 --seq 256 --batch 64 --vocab-size 65 --dtype bf16 --device cuda \
    --lr 1e-3 --warmup 10 --grad-clip 1.0 --dropout 0 --steps $((STEPS + 40)) --eval-every 0 \
    --eval-batches 1 --out "$SMALL/run" > "$2" 2>&1
  python3 -c "import json,sys;l=[json.loads(x) for x in open(sys.argv[1]) if '\"ms\"' in x][10:];print('%.3f' % (sum(x['ms'] for x in l)/len(l)))" "$SMALL/run/metrics.jsonl" 2>/dev/null
}
tessera_ms() {  # tessera_ms BUILD MODEL LOG
  local args program
  if [[ $2 == shakespeare ]]; then small_ms "$1" "$3"; return; fi
  read -r program args <<< "$(model_args "$2")"
  # shellcheck disable=SC2086
  timeout 300 "$1/benchmarks/$program" $args --steps "$STEPS" --warmup 5 --no-torch > "$3" 2>&1
  awk '$1 == "tessera" { print $2; exit }' "$3"  # the results table's ms/step column
}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rows=()
for m in $MODELS; do
  # Alternate the builds (old, new, old, new) so a drift of the card's clocks hits both.
  o1=$(tessera_ms "$PREV/build-gpu" "$m" "$OUT/${m}_old1.log")
  n1=$(tessera_ms build-gpu "$m" "$OUT/${m}_new1.log")
  o2=$(tessera_ms "$PREV/build-gpu" "$m" "$OUT/${m}_old2.log")
  n2=$(tessera_ms build-gpu "$m" "$OUT/${m}_new2.log")
  read -r program args <<< "$(model_args "$m")"
  if [[ $m == shakespeare ]]; then
    BUILD_DIR=build-gpu timeout 400 bash benchmarks/cuda/bench_small.sh > "$OUT/${m}_torch.log" 2>&1
    torch=$(grep -E "ms/step" "$OUT/${m}_torch.log" | awk '{printf "%s; ", $0}' | tr -s ' ')
  else
  # shellcheck disable=SC2086
  timeout 400 "build-gpu/benchmarks/$program" $args --steps "$STEPS" --warmup 5 > "$OUT/${m}_torch.log" 2>&1
  torch=$(grep -E "^  (tessera|pytorch) " "$OUT/${m}_torch.log" | awk '{printf "%s %s %s ms; ", $1, ($1 == "pytorch" ? $2 : ""), ($1 == "pytorch" ? $3 : $2)}')
  fi
  rows+=("$(python3 -c "
import statistics as s, sys
o=[float(x) for x in sys.argv[2:4] if x]; n=[float(x) for x in sys.argv[4:6] if x]
if not o or not n: print(f'{sys.argv[1]:12s} missing figures (see logs)'); sys.exit()
mo, mn = s.median(o), s.median(n)
print(f'{sys.argv[1]:12s} old {o} ms, new {n} ms: new/old time {mn/mo:.3f} ({(mo/mn-1)*100:+.1f}% speed)')
" "$m" "$o1" "$o2" "$n1" "$n2")")
  rows+=("             same call, with PyTorch: $torch")
done
echo "==== paired: this tree against $PREV ===="
printf '%s\n' "${rows[@]}"
