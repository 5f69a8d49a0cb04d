#!/usr/bin/env bash
# Scaling on 2..N GPUs of one machine, Tessera next to PyTorch in the same sitting; prints the
# whole table as markdown (for benchmarks/cuda/NOTES.md) at the end:
#  - GPT-2 124M and 350M, bf16, 16 x 1024 tokens per GPU: tokens/s per GPU on 1, 2, 4(, 8)
#    GPUs under Tessera's DDP and ZeRO stages 1, 2, 3 (example_gpt_ddp_throughput
#    --zero-stages, one process per world size) and PyTorch eager DDP, DDP +
#    ZeroRedundancyOptimizer and FSDP FULL_SHARD (gpt2_train_torch.py --strategies), with the
#    scaling efficiency against one GPU;
#  - all-reduce and reduce-scatter bus bandwidth, float32 1 MiB .. 1 GiB, on 2..N GPUs
#    (nccl-tests' formulas), Tessera's process group vs torch.distributed;
#  - every rank's memory by category next to ZeRO's formula for each stage at W = N.
# The most wanted rows run first (124M on 2, 1, N GPUs; the collectives; then 350M); each
# run has a time limit, so a cut-short sitting still prints what it measured.
#   usage: benchmarks/cuda/bench_scaling.sh N [BUILD_DIR]          (BUILD_DIR: build-gpu)
#   env: OUT (logs; default ./bench_scaling_out), SCALING_BUDGET_S=480 (the whole script),
#        DEADLINE (absolute `date +%s`; overrides the budget), STEPS=20 WARMUP=3,
#        MODELS="124M 350M", STAGES_AT_1="0" (Tessera strategies on one GPU),
#        COLLECTIVES=1 (0 skips them), TESSERA_PYTHON, BENCH_DRY_RUN=1 (CPU, tiny GPT)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
N=${1:?usage: bench_scaling.sh N [BUILD_DIR]}
if ! [[ $N =~ ^[0-9]+$ ]] || ((N < 2)); then
  echo "bench_scaling.sh: N must be a number of GPUs >= 2, got '$N'" >&2
  exit 2
fi
BUILD=${2:-build-gpu}
OUT=${OUT:-$PWD/bench_scaling_out}
mkdir -p "$OUT"
# shellcheck source=benchmarks/cuda/bench_lib.sh
source benchmarks/cuda/bench_lib.sh
DEADLINE=${DEADLINE:-$(($(date +%s) + ${SCALING_BUDGET_S:-480}))}
STEPS=${STEPS:-20} WARMUP=${WARMUP:-3}
[[ $DRY_RUN == 1 ]] && STEPS=${STEPS_DRY:-3} WARMUP=1
bench_require "$BUILD" tessera TESSERA || exit 1
bench_require "$BUILD" example_gpt_ddp_throughput EXAMPLE || exit 1
bench_require "$BUILD" example_allreduce_bandwidth ALLREDUCE || exit 1
if [[ $DRY_RUN != 1 ]]; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
  if ((gpus < N)); then
    echo "bench_scaling.sh: asked for $N GPUs, this machine has $gpus" >&2
    exit 1
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1 > "$OUT/machine.txt"
else
  echo "CPU dry run ($(nproc) cores)" > "$OUT/machine.txt"
fi
echo "$N x $(cat "$OUT/machine.txt")" > "$OUT/machine.txt"

worlds=(2 1)  # 2 first: issue 11's rows; then the baseline; then the larger worlds
for ((w = 4; w <= N; w *= 2)); do worlds+=("$w"); done

# One world size of one model: Tessera's strategies in one launch, PyTorch's in another.
gpt_rows() {
  local model=$1 w=$2 layers heads channels stages strategies extra=()
  read -r layers heads channels < <(gpt_shape "$model") || return 1
  local common=(--batch "$BENCH_BATCH" --seq "$BENCH_SEQ" --vocab "$BENCH_VOCAB" --steps "$STEPS"
                --warmup "$WARMUP" --layers "$layers" --heads "$heads" --channels "$channels")
  stages=0,1,2,3 strategies=ddp,zero,fsdp
  if ((w == 1)); then stages=${STAGES_AT_1:-0} strategies=ddp; fi
  ((w == N)) && extra=(--memory-report 1)
  local starter=("$EXAMPLE")
  ((w > 1)) && starter=("$TESSERA" launch --nproc-per-node "$w" "$EXAMPLE")
  run_limited 150 "$OUT/gpt_${model}_tessera_w${w}.log" "${starter[@]}" "${common[@]}" \
    --mixed-precision bf16 --zero-stages "$stages" "${extra[@]}"
  torch_launcher "$w"
  run_limited 180 "$OUT/gpt_${model}_torch_w${w}.log" "${TORCH_LAUNCH[@]}" benchmarks/cuda/gpt2_train_torch.py \
    --device "$BENCH_DEVICE" "${common[@]}" --strategies "$strategies"
}

collective_rows() {
  local w=$1 sizes=(--max-mib 1024 --iters 20 --op both)
  [[ $DRY_RUN == 1 ]] && sizes=(--max-mib 4 --iters 3 --op both)
  run_limited 90 "$OUT/coll_tessera_w${w}.log" "$TESSERA" launch --nproc-per-node "$w" "$ALLREDUCE" "${sizes[@]}"
  torch_launcher "$w"
  run_limited 90 "$OUT/coll_torch_w${w}.log" "${TORCH_LAUNCH[@]}" benchmarks/cuda/allreduce_torch.py \
    --device "$BENCH_DEVICE" "${sizes[@]}"
}

read -r -a models <<< "${MODELS:-124M 350M}"
echo "bench_scaling: $N GPUs, models ${models[*]}, worlds ${worlds[*]}, logs in $OUT" >&2
first=${models[0]}
for w in "${worlds[@]}"; do gpt_rows "$first" "$w"; done
if [[ ${COLLECTIVES:-1} == 1 ]]; then
  for w in "${worlds[@]}"; do ((w > 1)) && collective_rows "$w"; done
fi
for model in "${models[@]:1}"; do
  for w in 1 2 "${worlds[@]:2}"; do gpt_rows "$model" "$w"; done
done
"$PY" benchmarks/cuda/scaling_table.py "$OUT" --gpus "$N" --models "$(IFS=,; echo "${models[*]}")" \
  --tokens "$BENCH_BATCH x $BENCH_SEQ" | tee "$OUT/table.md"
