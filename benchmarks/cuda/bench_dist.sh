#!/usr/bin/env bash
# Multi-GPU figures of the dist layer, each next to its reference measured in the same run:
#  allreduce: all-reduce bus bandwidth of Tessera's NCCL process group vs PyTorch's NCCL
#     all-reduce (float32, 1 MiB .. 1 GiB, benchmarks/cuda/allreduce_torch.py);
#  example: GPT-2 124M training throughput per GPU under DDP on N GPUs vs one process on one
#     GPU (examples/gpt_ddp_throughput.cpp, bf16, batch 16 per GPU), and the same scaling for
#     PyTorch eager DDP (benchmarks/cuda/gpt2_train_torch.py);
#  train: `tessera train --dtype bf16` itself (GPT-2 124M shape, 16 x 1024 tokens per GPU, on a
#     file of random tokens) on one GPU and under `tessera launch --nproc-per-node N`, and
#     PyTorch eager DDP on N GPUs; tokens/s per GPU from the wall clock of metrics.jsonl after
#     TRAIN_SKIP warm-up steps, and the two ratios issue 10 asks for (N GPUs / 1 GPU >= 0.97,
#     tessera train / PyTorch DDP >= 1.2). The one-GPU run goes on every card of the N-GPU run
#     (--device cuda:g; TRAIN_EACH_GPU=0: on GPU 0 alone): cards of one host differ by a few
#     percent, and an N-GPU job runs at its slowest card's pace, so the ratio is given against
#     GPU 0's run and against the mean of the cards' runs.
#   usage: benchmarks/cuda/bench_dist.sh [BUILD_DIR] [N] [example args...]  (build-gpu, 2 GPUs)
#   env: BENCH_PARTS (default "allreduce,example,train"), OUT (logs; default ./bench_dist_out),
#        TRAIN_STEPS=40 TRAIN_SKIP=10, TORCH_STEPS=20, RUN_CAP_S=150 (limit of one run),
#        DEADLINE (absolute `date +%s` no run may pass), DDP_PROFILE=1 (phase times, 1 GPU vs
#        N), TRAIN_VARIANTS="NCCL_MAX_CTAS=8;--zero-stage 1" (train part: the N-GPU run again
#        under each ';'-separated set of environment settings (NAME=value) and extra `tessera
#        train` flags, for tuning and for other strategies), TRAIN_ACCUM=K (train part: K
#        micro-batches per optimizer step in every run, Tessera's and PyTorch's, the gradients
#        exchanged once per step as in a GPT-2 recipe's accumulation; default 1),
#        TESSERA_PYTHON, BENCH_DRY_RUN=1 (CPU, tiny GPT: checks the script; see bench_lib.sh)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
BUILD=${1:-build-gpu}
N=${2:-2}
PARTS=${BENCH_PARTS:-allreduce,example,train}
OUT=${OUT:-$PWD/bench_dist_out}
CAP=${RUN_CAP_S:-150}
mkdir -p "$OUT"
# shellcheck source=benchmarks/cuda/bench_lib.sh
source benchmarks/cuda/bench_lib.sh
bench_require "$BUILD" tessera TESSERA || exit 1
launch=("$TESSERA" launch --nproc-per-node "$N")
status=0
wants() { [[ ",$PARTS," == *",$1,"* ]]; }

if wants allreduce; then
  bench_require "$BUILD" example_allreduce_bandwidth ALLREDUCE || exit 1
  sizes=(--max-mib 1024 --iters 20)
  [[ $DRY_RUN == 1 ]] && sizes=(--max-mib 4 --iters 3)
  run_limited "$CAP" "$OUT/allreduce_tessera.txt" "${launch[@]}" "$ALLREDUCE" "${sizes[@]}"
  torch_launcher "$N"
  run_limited "$CAP" "$OUT/allreduce_torch.txt" "${TORCH_LAUNCH[@]}" benchmarks/cuda/allreduce_torch.py \
    --device "$BENCH_DEVICE" "${sizes[@]}"
  echo "all-reduce, float32, $N GPUs: bus bandwidth GB/s (nccl-tests formula)"
  printf "  %12s %12s %12s %8s\n" bytes tessera pytorch ratio
  join <(awk '$1 == "all_reduce" {print $2, $5}' "$OUT/allreduce_tessera.txt" | sort) \
       <(awk '$1 == "all_reduce" {print $2, $5}' "$OUT/allreduce_torch.txt" | sort) | sort -n |
    awk '{printf "  %12d %12.1f %12.1f %7.3fx\n", $1, $2, $3, ($3 > 0) ? $2 / $3 : 0}'
fi

if wants example; then
  bench_require "$BUILD" example_gpt_ddp_throughput EXAMPLE || exit 1
  read -r layers heads channels < <(gpt_shape 124M)
  shape=(--layers "$layers" --heads "$heads" --channels "$channels" --batch "$BENCH_BATCH"
         --seq "$BENCH_SEQ" --vocab "$BENCH_VOCAB")
  example_tps() { awk '/^RESULT/ {for (i = 2; i <= NF; ++i) if ($i ~ /^tokens_per_s_per_gpu=/) print substr($i, 22)}' "$1" | tail -1; }
  run_limited "$CAP" "$OUT/ddp_1gpu.txt" "$EXAMPLE" "${shape[@]}" "${@:3}"
  run_limited "$CAP" "$OUT/ddp_${N}gpu.txt" "${launch[@]}" "$EXAMPLE" "${shape[@]}" "${@:3}"
  echo "GPT-2 124M DDP (example_gpt_ddp_throughput, bf16, B=$BENCH_BATCH per GPU, T=$BENCH_SEQ): tokens/s per GPU"
  awk -v one="$(example_tps "$OUT/ddp_1gpu.txt")" -v many="$(example_tps "$OUT/ddp_${N}gpu.txt")" -v n="$N" 'BEGIN {
    if (one == "" || many == "") { print "  (a run failed; see the logs)"; exit }
    printf "  1 GPU: %.0f   %d GPUs: %.0f per GPU   scaling efficiency %.1f%%\n", one, n, many, 100 * many / one }'
  torch_tps() { grep -oE '"tokens_per_s": [0-9.]+' "$1" | awk '{print $2}' | tail -1; }
  torch_shape=(--device "$BENCH_DEVICE" --layers "$layers" --heads "$heads" --channels "$channels"
               --batch "$BENCH_BATCH" --seq "$BENCH_SEQ" --vocab "$BENCH_VOCAB")
  torch_launcher 1
  run_limited "$CAP" "$OUT/torch_ddp_1gpu.txt" "${TORCH_LAUNCH[@]}" benchmarks/cuda/gpt2_train_torch.py "${torch_shape[@]}"
  torch_launcher "$N"
  run_limited "$CAP" "$OUT/torch_ddp_${N}gpu.txt" "${TORCH_LAUNCH[@]}" benchmarks/cuda/gpt2_train_torch.py "${torch_shape[@]}"
  awk -v one="$(torch_tps "$OUT/torch_ddp_1gpu.txt")" -v many="$(torch_tps "$OUT/torch_ddp_${N}gpu.txt")" -v n="$N" 'BEGIN {
    if (one == "" || many == "") { print "  pytorch: (a run failed; see the logs)"; exit }
    printf "  pytorch eager DDP: 1 GPU: %.0f   %d GPUs: %.0f per GPU   scaling efficiency %.1f%%\n", one, n, many, 100 * many / one }'
  if [[ ${DDP_PROFILE:-0} == 1 ]]; then  # where the per-step time goes, 1 GPU vs N (synchronised phases)
    echo "phases, 1 GPU:"; "$EXAMPLE" --profile 1 "${shape[@]}" "${@:3}" 2>&1 | grep -E "^ +[0-9] "
    echo "phases, $N GPUs:"; "${launch[@]}" "$EXAMPLE" --profile 1 "${shape[@]}" "${@:3}" 2>&1 | grep -E "^ +[0-9] "
  fi
fi

if wants train; then
  steps=${TRAIN_STEPS:-40} skip=${TRAIN_SKIP:-10} accum=${TRAIN_ACCUM:-1}
  read -r layers heads channels < <(gpt_shape 124M)
  data=$OUT/tokens/train.bin  # no val.bin beside it: no evaluation
  mkdir -p "$OUT/tokens"
  # Tokens below GPT-2's 50257 (the model's vocabulary is the padded 50304); enough that N
  # ranks read new rows at every step (the loader wraps past the end anyway).
  count=$(( N * BENCH_BATCH * BENCH_SEQ * accum * steps + 1 ))
  (( count > 4000000 )) && count=4000000
  [[ -f $data ]] || "$PY" benchmarks/cuda/train_metrics.py tokens "$data" --count "$count" \
    --vocab $((BENCH_VOCAB < 50257 ? BENCH_VOCAB : 50257)) || exit 1
  # No checkpoints and no evaluation: the run times the training loop (the final model is
  # still written after it).
  echo '{"save_strategy": "no", "eval_strategy": "no"}' > "$OUT/bench_train.json"
  train_args=(train --config "$OUT/bench_train.json" --data "$data" --n-layer "$layers" --n-head "$heads"
              --n-embd "$channels" --vocab-size "$BENCH_VOCAB" --seq "$BENCH_SEQ" --batch "$BENCH_BATCH"
              --grad-accum "$accum" --steps "$steps" --lr 6e-4 --beta2 0.95 --dtype bf16
              --device "$BENCH_DEVICE")
  rm -rf "$OUT/train_1gpu" "$OUT/train_${N}gpu"
  run_limited "$CAP" "$OUT/train_1gpu.txt" "$TESSERA" "${train_args[@]}" --out "$OUT/train_1gpu"
  run_limited "$CAP" "$OUT/train_${N}gpu.txt" "${launch[@]}" "$TESSERA" "${train_args[@]}" --out "$OUT/train_${N}gpu"
  cards=1
  [[ ${TRAIN_EACH_GPU:-1} == 1 && $BENCH_DEVICE == cuda ]] && cards=$N
  for ((g = 1; g < cards; ++g)); do
    rm -rf "$OUT/train_1gpu_cuda$g"
    run_limited "$CAP" "$OUT/train_1gpu_cuda$g.txt" "$TESSERA" "${train_args[@]}" --device "cuda:$g" \
      --out "$OUT/train_1gpu_cuda$g"
  done
  train_tps() {  # tokens/s per GPU (wall clock) of a run directory, or nothing
    [[ -f $1/metrics.jsonl ]] || return 0
    "$PY" benchmarks/cuda/train_metrics.py rate "$1/metrics.jsonl" --world "$2" --skip "$skip" \
      > "$1/rate.json" 2>&1 && grep -oE '"tokens_per_s_per_gpu": [0-9.e+]+' "$1/rate.json" | awk '{print $2}'
  }
  one=$(train_tps "$OUT/train_1gpu" 1)
  many=$(train_tps "$OUT/train_${N}gpu" "$N")
  each=$one  # the one-GPU run on every card, space-separated ("" for a failed one)
  for ((g = 1; g < cards; ++g)); do each="$each $(train_tps "$OUT/train_1gpu_cuda$g" 1)"; done
  if [[ -n ${TRAIN_VARIANTS:-} ]]; then
    IFS=';' read -ra variants <<< "$TRAIN_VARIANTS"
    for k in "${!variants[@]}"; do
      read -ra words <<< "${variants[$k]}"
      settings=() extra=()  # NAME=value: the environment; anything else: tessera train's flags
      for w in "${words[@]}"; do
        if [[ $w != -* && $w == *=* ]]; then settings+=("$w"); else extra+=("$w"); fi
      done
      rm -rf "$OUT/train_${N}gpu_v$k"
      run_limited "$CAP" "$OUT/train_${N}gpu_v$k.txt" env "${settings[@]}" "${launch[@]}" "$TESSERA" \
        "${train_args[@]}" "${extra[@]}" --out "$OUT/train_${N}gpu_v$k"
      rate=$(train_tps "$OUT/train_${N}gpu_v$k" "$N")
      awk -v one="$one" -v r="$rate" -v n="$N" -v what="${variants[$k]}" 'BEGIN {
        if (r == "") printf "  variant %s: failed\n", what
        else printf "  variant %s: %d GPUs %.0f per GPU (%.3fx of 1 GPU)\n", what, n, r, one == "" ? 0 : r / one }'
    done
  fi
  torch_launcher "$N"
  run_limited "$CAP" "$OUT/torch_train_ddp_${N}gpu.txt" "${TORCH_LAUNCH[@]}" benchmarks/cuda/gpt2_train_torch.py \
    --device "$BENCH_DEVICE" --layers "$layers" --heads "$heads" --channels "$channels" --batch "$BENCH_BATCH" \
    --seq "$BENCH_SEQ" --vocab "$BENCH_VOCAB" --grad-accum "$accum" --steps "${TORCH_STEPS:-20}" --warmup 5 \
    --strategies ddp
  torch=$(grep -oE '"tokens_per_s": [0-9.e+]+' "$OUT/torch_train_ddp_${N}gpu.txt" | awk '{print $2}' | tail -1)
  echo "tessera train --dtype bf16, GPT-2 124M shape, B=$BENCH_BATCH x T=$BENCH_SEQ per GPU x $accum micro-batches per step, $steps steps: tokens/s per GPU"
  echo "  (wall clock over steps $((skip + 1))..$steps of metrics.jsonl; logs and runs in $OUT)"
  awk -v one="$one" -v many="$many" -v torch="$torch" -v n="$N" -v cards="$cards" -v each="$each" 'BEGIN {
    printf "  tessera train, 1 GPU:           %s\n", one == "" ? "failed (see train_1gpu.txt)" : sprintf("%.0f", one)
    k = split(each, e, " "); sum = 0
    for (g = 2; g <= cards; ++g)
      printf "  tessera train, 1 GPU (cuda:%d):  %s\n", g - 1, e[g] == "" ? "failed" : sprintf("%.0f", e[g])
    for (g = 1; g <= k; ++g) sum += e[g]
    printf "  tessera train, %d GPUs (launch): %s\n", n, many == "" ? "failed (see train_" n "gpu.txt)" : sprintf("%.0f per GPU", many)
    printf "  PyTorch eager DDP, %d GPUs:      %s\n", n, torch == "" ? "failed (see torch_train_ddp_" n "gpu.txt)" : sprintf("%.0f per GPU", torch)
    if (one != "" && many != "")
      printf "  %d GPUs / 1 GPU (cuda:0):        %.3fx  (goal >= 0.97x: %s)\n", n, many / one, (many / one >= 0.97) ? "met" : "NOT met"
    if (cards > 1 && k == cards && many != "")
      printf "  %d GPUs / mean of the %d cards: %.3fx  (goal >= 0.97x: %s)\n", n, cards, many * cards / sum, (many * cards / sum >= 0.97) ? "met" : "NOT met"
    if (many != "" && torch != "")
      printf "  tessera / PyTorch DDP: %.3fx  (goal >= 1.2x: %s)\n", many / torch, (many / torch >= 1.2) ? "met" : "NOT met"
  }'
  [[ -n $one && -n $many && -n $torch ]] || status=1
fi
exit $status
