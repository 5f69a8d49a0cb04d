#!/usr/bin/env bash
# ZeRO-3 with the optimizer offloaded to the host, on ONE GPU (issue 42, point 5): a GPT whose
# 16 bytes of training state per parameter would not fit the card next to its activations
# keeps only the bf16 parameters and gradients (and the f32 reduced gradient) on the device,
# while the f32 masters and Adam moments live in host memory and AdamW runs on the host's cores.
# One optimizer step is GRAD_ACCUM micro-batches of BATCH x SEQ tokens (64 x 8 x 1024 = 0.5M
# tokens by default, llm.c's batch); the first step is a warm-up.
#
# MFU counts 6N + 12·L·T·C FLOPs per token (the 6N rule plus attention's T-long products)
# against the card's dense bf16 peak (PEAK_TFLOPS, 989 for an H100/H200 SXM).
#   usage: benchmarks/cuda/bench_offload_one_gpu.sh [BUILD_DIR]       (default build-gpu)
#   env:   LAYERS EMBD HEADS SEQ BATCH GRAD_ACCUM STEPS OFFLOAD PEAK_TFLOPS OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
LAYERS=${LAYERS:-48} EMBD=${EMBD:-3200} HEADS=${HEADS:-25} SEQ=${SEQ:-1024}
BATCH=${BATCH:-8} GRAD_ACCUM=${GRAD_ACCUM:-64} STEPS=${STEPS:-2} OFFLOAD=${OFFLOAD:-optimizer}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
OUT=${OUT:-$PWD/bench_offload_out}
mkdir -p "$OUT"
program="$BUILD/examples/example_gpt_ddp_throughput"
[[ -x $program ]] || program="$BUILD/example_gpt_ddp_throughput"
[[ -x $program ]] || { echo "no example_gpt_ddp_throughput in $BUILD"; exit 2; }

"$BUILD/tessera" plan --device cuda --dtype bf16 --nproc 1 --zero-stage 3 --offload "$OFFLOAD" \
  --n-layer "$LAYERS" --n-embd "$EMBD" --n-head "$HEADS" --seq "$SEQ" --batch "$BATCH" \
  --grad-accum "$GRAD_ACCUM" > "$OUT/plan.txt" 2>&1
echo "== tessera plan:"; sed 's/^/   /' "$OUT/plan.txt" | tail -25

# Host memory and CPU use sampled every 2 s while the job runs.
( while sleep 2; do echo "$(date +%s) $(free -m | awk '/Mem:/{print $3}') MiB used"; done ) > "$OUT/host.txt" &
sampler=$!
start=$SECONDS
"$program" --layers "$LAYERS" --n-embd "$EMBD" --n-head "$HEADS" --seq "$SEQ" --batch "$BATCH" \
  --grad-accum "$GRAD_ACCUM" --steps "$STEPS" --warmup 1 --zero-stage 3 --offload "$OFFLOAD" \
  --memory 1 --profile 1 > "$OUT/run.txt" 2>&1
status=$?
kill $sampler 2>/dev/null
echo "== run: exit status $status after $((SECONDS - start)) s"
grep -vE "^\s*$" "$OUT/run.txt" | tail -12 | sed 's/^/   /'
echo "   host memory used at its peak: $(sort -k2 -n "$OUT/host.txt" | tail -1 | awk '{print $2}') MiB (free -m, sampled every 2 s)"
python3 - "$OUT/run.txt" "$LAYERS" "$EMBD" "$SEQ" "$PEAK_TFLOPS" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
L, C, T, peak = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
m = re.search(r"RESULT .*tokens_per_s_per_gpu=([0-9.]+) ms_per_step=([0-9.]+)", text)
n = re.search(r" (\d+) parameters", text)
if m and n:
    tps, N = float(m.group(1)), int(n.group(1))
    flops = 6 * N + 12 * L * T * C
    print(f"   {N / 1e9:.2f}B parameters: {tps:.0f} tokens/s, {float(m.group(2)) / 1000:.1f} s/step, "
          f"MFU {100 * tps * flops / (peak * 1e12):.1f}% of {peak:.0f} TFLOP/s")
PY
exit $status
