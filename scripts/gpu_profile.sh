#!/usr/bin/env bash
# Where the time of a training step goes, on a GPU machine: builds the end-to-end benchmark
# (GPT-2 124M, or the Llama of GPT-2-small size with MODEL=llama), runs it with per-phase
# timing, then a per-kernel summary of one step under ncu (duration only, clocks left alone)
# and torch.profiler's kernel table for PyTorch (TORCH_MODE=eager or compile).
#   usage: scripts/gpu_profile.sh [extra bench flags]
#   env: OUT (logs), MODEL (gpt2|llama), TORCH_MODE, TESSERA_PYTHON (python with torch)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_profile_out}
MODEL=${MODEL:-gpt2}
case $MODEL in
  gpt2) target=bench_gpt2_train torch_script=benchmarks/cuda/gpt2_train_torch.py ;;
  llama) target=bench_llama_train torch_script=benchmarks/cuda/llama_train_torch.py ;;
  *) echo "MODEL must be gpt2 or llama, not '$MODEL'" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH TESSERA_PYTHON=${TESSERA_PYTHON:-python3}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF \
  -DTESSERA_CUDA_GENCODE="arch=compute_90a,code=sm_90a" \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 \
  -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 > "$OUT/configure.log" 2>&1
cmake --build build-gpu -j "$(nproc)" --target $target > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
bench=./build-gpu/benchmarks/$target
$bench --profile --no-compile "$@" 2>&1 | tee "$OUT/bench.log"
# One step after one warm-up step; ncu serialises kernels, so only per-kernel durations count.
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel --print-units base \
  --csv $bench --no-torch --warmup 1 --steps 1 "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY' 2>&1 | tee "$OUT/ncu_top.txt"
import csv, sys, collections
# The program's own lines come first (its banner has commas too): the table starts at ncu's header.
rows = list(csv.reader(open(sys.argv[1])))
start = next(i for i, r in enumerate(rows) if r and r[0] == "Process ID")
hdr = rows[start]; rows = rows[start + 1:]
def col(name): return next(i for i, h in enumerate(hdr) if name in h)
k, inv, avg = col("Kernel Name"), col("Invocations"), col("Average")
tot = collections.Counter(); cnt = collections.Counter()
for r in rows:
    try: t = float(r[avg].replace(",", "")) * int(r[inv]); tot[r[k][:110]] += t; cnt[r[k][:110]] += int(r[inv])
    except ValueError: pass
all_ns = sum(tot.values())
print(f"ncu: {all_ns/1e6:.2f} ms of kernels over 2 steps (warm-up + timed), {sum(cnt.values())} launches")
for name, t in tot.most_common(40): print(f"{t/2e6:8.3f} ms/step {cnt[name]//2:5d}x  {name}")
PY
$TESSERA_PYTHON $torch_script --mode "${TORCH_MODE:-eager}" --profile "$@" 2>&1 | tail -60 | tee "$OUT/torch_profile.txt"
