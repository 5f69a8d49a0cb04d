#!/usr/bin/env bash
# Where two GPUs lose time against one: nsys kernel summaries of `tessera train` (GPT-2 124M
# shape, bf16, 16 x 1024 rows per GPU, CUDA graphs traced per node) on one GPU and on each of
# two ranks, side by side. usage: OUT=dir scripts/nsys_ddp.sh [build-gpu] [steps]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=${1:-build-gpu}
STEPS=${2:-40}
export PATH=/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
[[ -x $NSYS ]] || { echo "nsys_ddp.sh: no nsys on this machine"; exit 1; }
T=$BUILD/cli/tessera
D=${OUT:-$PWD/nsys_ddp_out}
mkdir -p "$D"
python3 benchmarks/cuda/train_metrics.py tokens "$D/t.bin" --count 1400000 --vocab 50257 || exit 1
echo '{"save_strategy": "no", "eval_strategy": "no"}' > "$D/c.json"
A=(train --config "$D/c.json" --data "$D/t.bin" --n-layer 12 --n-head 12 --n-embd 768
   --vocab-size 50304 --seq 1024 --batch 16 --steps "$STEPS" --lr 6e-4 --dtype bf16 --device cuda)
P=(profile -t cuda,nvtx --cuda-graph-trace=node -f true)
"$NSYS" "${P[@]}" -o "$D/one" "$T" "${A[@]}" --out "$D/r1" > "$D/one.log" 2>&1
"$T" launch --nproc-per-node 2 "$NSYS" "${P[@]}" -o "$D/two_%q{RANK}" "$T" "${A[@]}" --out "$D/r2" \
  > "$D/two.log" 2>&1
for rep in one two_0 two_1; do
  [[ -f $D/$rep.nsys-rep ]] || { echo "$rep: no report (see $D/*.log)"; continue; }
  "$NSYS" stats -q -r cuda_gpu_kern_sum -f csv -o "$D/$rep" "$D/$rep.nsys-rep" > /dev/null 2>&1
  csv=$(ls "$D/$rep"*kern_sum*.csv 2>/dev/null | head -1)
  echo "== $rep: GPU kernel time over $STEPS steps (ms), top 22, and the total"
  python3 - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
key = next(k for k in rows[0] if k.startswith("Total Time"))
total = sum(float(r[key]) for r in rows)
for r in sorted(rows, key=lambda r: -float(r[key]))[:22]:
    print(f"{float(r[key]) / 1e6:10.2f} {int(r['Instances']):7d}  {r['Name'][:110]}")
print(f"{total / 1e6:10.2f}  total")
PY
done
rm -f "$D"/*.sqlite "$D/t.bin"; rm -rf "$D/r1/model" "$D/r2/model"
