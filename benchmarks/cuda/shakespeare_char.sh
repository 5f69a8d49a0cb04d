#!/usr/bin/env bash
# Quality on a GPU: nanoGPT's shakespeare_char recipe through `tessera train` (6 layers, 6 heads,
# 384 channels, context 256, batch 64, bf16, AdamW lr 1e-3 cosine to 1e-4 over 5000 steps, warmup
# 100, beta2 0.99, weight decay 0.1, clipping at 1.0, dropout 0.2, rows at random offsets as
# nanoGPT's get_batch; validation every 250 steps over 200 batches) on byte tokens of a text
# file split 90/10 as nanoGPT splits its characters. Prints the best validation loss and its
# step, the run's steps and wall time, and where the loss curve (loss.png) lies.
#   usage: benchmarks/cuda/shakespeare_char.sh TEXT [OUT]   (the figures use tinyshakespeare)
#   env: BUILD_DIR (default build), DEVICE (default cuda), STEPS (default 5000), SEED (default 1337)
set -euo pipefail
cd "$(dirname "$0")/../.."
TEXT=${1:?usage: benchmarks/cuda/shakespeare_char.sh TEXT [OUT]}
OUT=${2:-$PWD/shakespeare_char_out}
T=${BUILD_DIR:-build}/tessera
STEPS=${STEPS:-5000}
rm -rf "$OUT"
mkdir -p "$OUT"
"$T" prepare --input "$TEXT" --tokenizer byte --val-fraction 0.1 --out "$OUT/data" > /dev/null
start=$(date +%s.%N)
"$T" train --data "$OUT/data/train.bin" --n-layer 6 --n-head 6 --n-embd 384 --seq 256 --batch 64 \
  --dtype bf16 --device "${DEVICE:-cuda}" --steps "$STEPS" --lr 1e-3 --min-lr 1e-4 --warmup 100 \
  --schedule cosine --beta2 0.99 --weight-decay 0.1 --grad-clip 1.0 --dropout 0.2 --sampling random \
  --eval-every 250 --eval-batches 200 --seed "${SEED:-1337}" --out "$OUT/run" > "$OUT/train.log"
end=$(date +%s.%N)
python3 - "$OUT/run" "$start" "$end" <<'PY'
import json, sys
run, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
steps = [r for r in records if "loss" in r]
evals = [r for r in records if "eval_loss" in r]
best = min(evals, key=lambda r: r["eval_loss"])
print(f"steps: {len(steps)}; wall time {end - start:.1f} s (training steps {sum(r['ms'] for r in steps) / 1e3:.1f} s, "
      f"{sum(r['ms'] for r in steps) / len(steps):.2f} ms/step)")
print(f"best validation loss: {best['eval_loss']:.4f} at step {best['step']} (nanoGPT publishes 1.4697)")
print("validation loss by step: " + ", ".join(f"{r['step']}: {r['eval_loss']:.3f}" for r in evals))
print(f"loss curve: {run}/loss.png")
PY
