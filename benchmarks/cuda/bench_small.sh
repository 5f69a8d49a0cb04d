#!/usr/bin/env bash
# Issue 12, small models: nanoGPT's shakespeare_char shape (6 layers, 6 heads, 384 channels,
# context 256, batch 64, vocab 65, bf16, AdamW, clipping at 1.0, no dropout) trained through
# `tessera train` with CUDA graphs off and on (TESSERA_CUDA_GRAPHS), and the same step in
# PyTorch eager and torch.compile (benchmarks/cuda/gpt2_train_torch.py), in one run on one
# GPU. Prints ms/step and tokens/s of each and Tessera's ratios to PyTorch.
# Usage: benchmarks/cuda/bench_small.sh   (BUILD_DIR, default build; STEPS, default 60;
# TESSERA_PYTHON, the interpreter with CUDA PyTorch, default python3). About 1-3 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${BUILD_DIR:-build}/tessera
STEPS=${STEPS:-60}
PY=${TESSERA_PYTHON:-python3}
D=$(mktemp -d /tmp/tessera-small.XXXXXX)
trap 'rm -rf "$D"' EXIT
# Random byte-level tokens in llm.c's token-file layout (the speed does not depend on them).
python3 - "$D" <<'PY'
import random, struct, sys
random.seed(0)
for name, n in (("train.bin", 400_000), ("val.bin", 40_000)):
    header = [20240520, 1, n] + [0] * 253
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{n}H", *(random.randrange(65) for _ in range(n))))
PY
ARGS="--data $D/train.bin --val-data $D/val.bin --n-layer 6 --n-head 6 --n-embd 384 --seq 256 \
  --batch 64 --vocab-size 65 --dtype bf16 --device cuda --lr 1e-3 --warmup 10 --grad-clip 1.0 \
  --dropout 0 --steps $STEPS --eval-every 0 --eval-batches 1"
# Mean ms/step of the steps after the first 10 (start-up, warm-up and the graph's recording).
ms_of() {
  python3 -c "import json,sys;l=[json.loads(x) for x in open(sys.argv[1]) if '\"ms\"' in x][10:];print('%.3f' % (sum(x['ms'] for x in l)/len(l)))" "$1/metrics.jsonl"
}
TOKENS=$((64 * 256))
TESSERA_CUDA_GRAPHS=0 $T train $ARGS --out $D/eager >/dev/null
TESSERA_CUDA_GRAPHS=1 $T train $ARGS --out $D/graphs | grep "cuda graphs" || true
EAGER_MS=$(ms_of $D/eager)
GRAPHS_MS=$(ms_of $D/graphs)
TORCH_ARGS="--steps 30 --warmup 10 --batch 64 --seq 256 --layers 6 --heads 6 --channels 384 --vocab 65"
TORCH_EAGER_MS=$($PY benchmarks/cuda/gpt2_train_torch.py --mode eager $TORCH_ARGS | tail -1 |
  python3 -c "import json,sys;print('%.3f' % json.load(sys.stdin)['ms_per_step'])")
TORCH_COMPILE_MS=$($PY benchmarks/cuda/gpt2_train_torch.py --mode compile $TORCH_ARGS | tail -1 |
  python3 -c "import json,sys;print('%.3f' % json.load(sys.stdin)['ms_per_step'])")
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 - "$TOKENS" "$EAGER_MS" "$GRAPHS_MS" "$TORCH_EAGER_MS" "$TORCH_COMPILE_MS" <<'PY'
import sys
tokens = int(sys.argv[1])
rows = [("tessera train, graphs off", float(sys.argv[2])), ("tessera train, graphs on", float(sys.argv[3])),
        ("pytorch eager", float(sys.argv[4])), ("torch.compile", float(sys.argv[5]))]
print("shakespeare_char shape (6x6x384, T 256, B 64, bf16):")
for name, ms in rows:
    print(f"  {name:28s} {ms:8.2f} ms/step {tokens / ms * 1e3:12.0f} tokens/s")
for name, ms in rows[:2]:
    print(f"  {name}: {rows[2][1] / ms:.2f}x pytorch eager, {rows[3][1] / ms:.2f}x torch.compile")
PY
