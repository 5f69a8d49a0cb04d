#!/usr/bin/env bash
# Issue-4 quality bar: the same byte-level GPT (4 layers, 4 heads, 128 channels, context 128,
# batch 32, AdamW lr 1e-3) trained for 60 s by Tessera and by PyTorch on the same cores,
# then both validation losses. Usage: benchmarks/quality_bar.sh TEXT (any text file; the reference
# figures use tinyshakespeare). Needs a built tree (BUILD_DIR, default build).
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=${1:?usage: benchmarks/quality_bar.sh TEXT (a text file to train on)}
CORES=${CORES:-0,1}
SECONDS_BUDGET=${SECONDS_BUDGET:-60}
T=${BUILD_DIR:-build}/tessera
D=$(mktemp -d /tmp/tessera-quality.XXXXXX)
trap 'rm -rf "$D"' EXIT
$T prepare --input "$TEXT" --tokenizer byte --val-fraction 0.1 --out $D/data >/dev/null
ARGS="--data $D/data/train.bin --n-layer 4 --n-head 4 --n-embd 128 --seq 128 --block-size 128 --batch 32 --lr 1e-3 \
  --schedule constant --weight-decay 0.01 --beta1 0.9 --beta2 0.999 --eps 1e-8 --grad-clip 0 --eval-batches 20"
# Pace a few steps, then size a run that fills the time budget.
taskset -c $CORES $T train $ARGS --steps 4 --out $D/pace >/dev/null
MS=$(python3 -c "import json;l=[json.loads(x) for x in open('$D/pace/metrics.jsonl') if '\"loss\"' in x];print(sum(x['ms'] for x in l[1:])/len(l[1:]))")
STEPS=$(python3 -c "print(max(1,int($SECONDS_BUDGET*1000/$MS)))")
echo "tessera pace: $MS ms/step -> $STEPS steps"
taskset -c $CORES $T train $ARGS --steps $STEPS --out $D/run >/dev/null
python3 -c "import json;l=[json.loads(x) for x in open('$D/run/metrics.jsonl')];t=[x for x in l if 'loss' in x];print('tessera: %d steps in %.1f s (%.0f ms/step), train loss %.4f' % (len(t), sum(x['ms'] for x in t)/1000, sum(x['ms'] for x in t)/len(t), t[-1]['loss']))"
echo -n "tessera val: "
taskset -c $CORES $T eval --model $D/run/model --data $D/data/val.bin --batch 32 --seq 128 --batches 20
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  taskset -c $CORES /usr/bin/python3 benchmarks/quality_bar_torch.py $D/data/train.bin $D/data/val.bin $SECONDS_BUDGET 2
else
  echo "pytorch: not installed here"
fi
