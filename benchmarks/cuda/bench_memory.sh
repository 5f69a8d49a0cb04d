#!/usr/bin/env bash
# Each rank's peak memory under DDP and ZeRO stages 1-3 on N GPUs: `tessera plan` (a
# size-only dry run on the host, GPU routes, no device memory used) next to the peak the
# allocator counted on GPU 0 in a real bf16 run of the same GPT (`tessera train
# --memory-report`, two optimizer steps), for GPT-2 124M and 350M. Prints one table.
#   usage: benchmarks/cuda/bench_memory.sh [BUILD_DIR] [N]   (default build-gpu, 2 GPUs)
#   env: BATCH (rows per GPU, default 8), SEQ (default 1024), OUT (logs), REDUCE_DTYPE (fp32
#        or bf16: the dtype gradients are averaged in; default the policy's, bf16), MODELS
#        ("124M" or "350M" for one of them)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
N=${2:-2}
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
OUT=${OUT:-$PWD/bench_memory_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
tessera="$BUILD/tessera"

# Random tokens below GPT-2's vocabulary, in the llm.c layout (version 1: uint16).
DATA="$OUT/tokens.bin"
if [ ! -f "$DATA" ]; then
  python3 - "$DATA" <<'PY'
import random, struct, sys
random.seed(0)
n = 200_000
header = [20240520, 1, n] + [0] * 253
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack("<%dH" % n, *(random.randrange(50257) for _ in range(n))))
PY
fi

printf "%-6s %-6s %14s %14s %9s %16s\n" model stage "plan GiB" "measured GiB" "diff" "formula P+G+O GiB"
reduce=()
[[ -n ${REDUCE_DTYPE:-} ]] && reduce=(--reduce-dtype "$REDUCE_DTYPE")
for model in "124M 12 12 768" "350M 24 16 1024"; do
  set -- $model
  name=$1 layers=$2 heads=$3 embd=$4
  [[ -n ${MODELS:-} && " $MODELS " != *" $name "* ]] && continue
  shape="--n-layer $layers --n-head $heads --n-embd $embd --seq $SEQ --batch $BATCH"
  for stage in 0 1 2 3; do
    plan=$("$tessera" plan --device cuda --dtype bf16 --nproc "$N" --zero-stage "$stage" --vocab 50257 $shape "${reduce[@]}" \
           2>&1 | tee "$OUT/plan_${name}_$stage.txt")
    predicted=$(grep -oE '^peak_bytes [0-9]+' <<<"$plan" | awk '{print $2}')
    formula=$(grep -E '^ZeRO formula' <<<"$plan" | awk '{print $3 + $4 + $5}')
    "$tessera" launch --nproc-per-node "$N" "$tessera" train --data "$DATA" --vocab-size 50257 $shape \
      --device cuda --dtype bf16 --steps 2 --eval-batches 1 --memory-report --zero-stage "$stage" "${reduce[@]}" \
      --out "$OUT/run_${name}_$stage" > "$OUT/train_${name}_$stage.txt" 2>&1
    measured=$(grep -E '^rank 0 peak' "$OUT/train_${name}_$stage.txt" | awk '{print $10 / 1024}')
    awk -v m="$name" -v s="$stage" -v p="$predicted" -v q="$measured" -v f="$formula" 'BEGIN {
      if (p == "" || q == "") { printf "%-6s %-6s (a run failed; see %s)\n", m, s, "logs"; exit }
      pg = p / 2^30
      printf "%-6s %-6s %14.3f %14.3f %+8.1f%% %16.3f\n", m, s, pg, q, 100 * (pg - q) / q, f }'
  done
done
