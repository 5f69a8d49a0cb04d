#!/usr/bin/env bash
# Capacity: a GPT whose mixed-precision training state (16 bytes per parameter: bf16
# parameters and gradients, f32 master and two f32 Adam moments) does not fit one 80 GB H100
# trains on N GPUs under ZeRO stage 3, and under stage 3 with the optimizer offloaded to the
# host; the same model under DDP fails at its first step with Tessera's out-of-memory error,
# which names the bytes it asked for.
#
# The default model: 48 layers, n_embd 3200, 25 heads of 128 (GPT-2 vocabulary, T = 1024):
# 12·48·3200² + 50304·3200 + 1024·3200 = 6.06 billion parameters, 90 GiB of training state
# (16 B/param) against the card's ~79 GiB. Per GPU on 2 GPUs, stage 3 holds 1/2 of it
# (45 GiB) plus the gathered blocks and the activations; with --offload optimizer the
# device keeps only the bf16 parameter and gradient shards (~6 GiB each) and the f32
# reduced slice, while each process holds ~54 GiB of host memory (f32 masters, gradients
# and moments of its 3 billion elements, and bf16 staging) and runs AdamW on the CPU.
#
# First `tessera plan --all-strategies` predicts each strategy's outcome for the same model
# and run (a size-only dry run: no GPU memory used) against this GPU's memory; its verdicts
# are printed next to the measured outcomes at the end.
#
#   usage: benchmarks/cuda/bench_capacity.sh [BUILD_DIR] [N]      (default build-gpu, 2)
#   env:   LAYERS EMBD HEADS SEQ BATCH STEPS (model and run size), OUT (logs)
# Expected wall time on 2 H100s: under 5 minutes (DDP fails after ~1 minute of set-up and one
# forward/backward; stage 3 and stage 3 + offload each initialise in well under a minute and
# time STEPS steps after one warm-up step; offload steps take seconds each: AdamW over 3
# billion f32 elements per process runs on the host's cores).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
N=${2:-2}
LAYERS=${LAYERS:-48}
EMBD=${EMBD:-3200}
HEADS=${HEADS:-25}
SEQ=${SEQ:-1024}
BATCH=${BATCH:-1}
STEPS=${STEPS:-3}
OUT=${OUT:-$PWD/bench_capacity_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
launch="$BUILD/tessera launch --nproc-per-node $N"
program="$BUILD/examples/example_gpt_ddp_throughput"
[[ -x $program ]] || program="$BUILD/example_gpt_ddp_throughput"
[[ -x $program ]] || { echo "no example_gpt_ddp_throughput in $BUILD (ninja -C $BUILD example_gpt_ddp_throughput)"; exit 2; }
model="--layers $LAYERS --n-embd $EMBD --n-head $HEADS --seq $SEQ --batch $BATCH --warmup 1 --memory 1 --prefetch ${PREFETCH:-50000000}"

# The prediction first (vocabulary and prefetch as example_gpt_ddp_throughput's defaults).
PREFETCH=${PREFETCH:-50000000}
"$BUILD/tessera" plan --all-strategies --device cuda --dtype bf16 --nproc "$N" --vocab 50304 \
  --n-layer "$LAYERS" --n-embd "$EMBD" --n-head "$HEADS" --seq "$SEQ" --batch "$BATCH" \
  --prefetch "$PREFETCH" > "$OUT/plan.txt" 2>&1
echo "== tessera plan (size-only dry run):"
sed 's/^/   /' "$OUT/plan.txt"
verdict() { grep -E "^$1 {2,}" "$OUT/plan.txt" | grep -oE "(fits|does NOT fit).*" || echo "(no plan)"; }

# run NAME TIMEOUT ARGS...: the job's output goes to $OUT/NAME.txt; prints its status.
run() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" $launch "$program" $model "$@" > "$OUT/$name.txt" 2>&1
  local status=$?
  echo "== $name: exit status $status after $((SECONDS - start)) s"
  grep -E "billion parameters|tokens/s|memory rank|out of memory" "$OUT/$name.txt" | sed 's/^/   /'
  return $status
}

run ddp 150 --zero-stage 0 --steps 1
ddp=$?
run zero3 150 --zero-stage 3 --steps "$STEPS"
zero3=$?
run zero3_offload 240 --zero-stage 3 --offload optimizer --steps "$STEPS"
offload=$?

echo
if grep -q "out of memory allocating [0-9]* bytes" "$OUT/ddp.txt"; then
  echo "DDP: failed with Tessera's out-of-memory error (as it must):"
  grep -m1 -oE "cuda:[0-9]+: out of memory allocating [0-9]+ bytes" "$OUT/ddp.txt" | sed 's/^/   /'
else
  echo "DDP: did NOT fail with an out-of-memory error (status $ddp); see $OUT/ddp.txt"
fi
[[ $zero3 == 0 ]] && echo "ZeRO-3: trained" || echo "ZeRO-3: failed (status $zero3); see $OUT/zero3.txt"
[[ $offload == 0 ]] && echo "ZeRO-3 + offload: trained" ||
  echo "ZeRO-3 + offload: failed (status $offload); see $OUT/zero3_offload.txt"

echo
echo "predicted (tessera plan) vs measured:"
printf "   %-28s %-55s %s\n" strategy "plan" "measured"
printf "   %-28s %-55s %s\n" DDP "$(verdict DDP)" \
  "$(grep -q 'out of memory allocating' "$OUT/ddp.txt" && echo 'out of memory' || echo "status $ddp")"
printf "   %-28s %-55s %s\n" ZeRO-3 "$(verdict ZeRO-3)" \
  "$([[ $zero3 == 0 ]] && echo trained || echo "failed (status $zero3)")"
printf "   %-28s %-55s %s\n" "ZeRO-3 + offload optimizer" "$(verdict 'ZeRO-3 \+ offload optimizer')" \
  "$([[ $offload == 0 ]] && echo trained || echo "failed (status $offload)")"
