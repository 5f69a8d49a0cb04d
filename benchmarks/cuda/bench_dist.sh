#!/usr/bin/env bash
# Multi-GPU figures of the dist layer, each next to its reference measured in the same run:
#  1. all-reduce bus bandwidth of Tessera's NCCL process group vs PyTorch's NCCL all-reduce
#     (float32, 1 MiB .. 1 GiB, benchmarks/cuda/allreduce_torch.py under torch.distributed.run);
#  2. GPT-2 124M training throughput per GPU under DDP on N GPUs vs one process on one GPU
#     (examples/gpt_ddp_throughput.cpp, bf16 autocast, batch 16 per GPU), and the same
#     scaling for PyTorch eager DDP (benchmarks/cuda/gpt2_train_torch.py).
#   usage: benchmarks/cuda/bench_dist.sh [BUILD_DIR] [N]   (default build-gpu, 2 GPUs)
#   env: TESSERA_PYTHON (a python with torch; default python3), OUT (logs),
#        DDP_PROFILE=1 (also the synchronised phase times of a step, 1 GPU vs N)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
N=${2:-2}
PY=${TESSERA_PYTHON:-python3}
OUT=${OUT:-$PWD/bench_dist_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
launch="$BUILD/tessera launch --nproc-per-node $N"

$launch "$BUILD/example_allreduce_bandwidth" > "$OUT/allreduce_tessera.txt" 2>&1
$PY -m torch.distributed.run --nproc-per-node "$N" benchmarks/cuda/allreduce_torch.py \
  > "$OUT/allreduce_torch.txt" 2>&1
echo "all-reduce, float32, $N GPUs: bus bandwidth GB/s (nccl-tests formula)"
printf "  %12s %12s %12s %8s\n" bytes tessera pytorch ratio
join <(grep -E '^ +[0-9]' "$OUT/allreduce_tessera.txt" | awk '{print $1, $4}') \
     <(grep -E '^ +[0-9]' "$OUT/allreduce_torch.txt" | awk '{print $1, $4}') |
  awk '{printf "  %12d %12.1f %12.1f %7.3fx\n", $1, $2, $3, $2 / $3}'

one=$("$BUILD/example_gpt_ddp_throughput" "${@:3}" 2>&1 | tee "$OUT/ddp_1gpu.txt" | grep -oE '[0-9.e+]+ tokens/s' | awk '{print $1}')
many=$($launch "$BUILD/example_gpt_ddp_throughput" "${@:3}" 2>&1 | tee "$OUT/ddp_${N}gpu.txt" | grep -oE '[0-9.e+]+ tokens/s' | awk '{print $1}')
echo "GPT-2 124M DDP (bf16 autocast, B=16 per GPU, T=1024): tokens/s per GPU"
awk -v one="$one" -v many="$many" -v n="$N" 'BEGIN {
  if (one == "" || many == "") { print "  (a run failed; see the logs)"; exit 1 }
  printf "  1 GPU: %.0f   %d GPUs: %.0f per GPU   scaling efficiency %.1f%%\n", one, n, many, 100 * many / one }'
# The same scaling for PyTorch eager DDP (bf16 autocast, fused AdamW), in the same run.
torch_tps() {
  grep -oE '"tokens_per_s": [0-9.]+' | awk '{print $2}' | tail -1
}
t_one=$($PY benchmarks/cuda/gpt2_train_torch.py --mode eager 2>&1 | tee "$OUT/torch_ddp_1gpu.txt" | torch_tps)
t_many=$($PY -m torch.distributed.run --nproc-per-node "$N" benchmarks/cuda/gpt2_train_torch.py --mode eager 2>&1 \
  | tee "$OUT/torch_ddp_${N}gpu.txt" | torch_tps)
awk -v one="$t_one" -v many="$t_many" -v n="$N" 'BEGIN {
  if (one == "" || many == "") { print "  pytorch: (a run failed; see the logs)"; exit 0 }
  printf "  pytorch eager DDP: 1 GPU: %.0f   %d GPUs: %.0f per GPU   scaling efficiency %.1f%%\n", one, n, many, 100 * many / one }'

if [[ ${DDP_PROFILE:-0} == 1 ]]; then  # where the per-step time goes, 1 GPU vs N (synchronised phases)
  echo "phases, 1 GPU:"; "$BUILD/example_gpt_ddp_throughput" --profile 1 "${@:3}" 2>&1 | grep -E "^ +[0-9] "
  echo "phases, $N GPUs:"; $launch "$BUILD/example_gpt_ddp_throughput" --profile 1 "${@:3}" 2>&1 | grep -E "^ +[0-9] "
fi
