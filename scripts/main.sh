#!/usr/bin/env bash
# README command (1): install what is missing, build, then train a small GPT on a text
# corpus for about a minute and print samples from it.
#
#   bash scripts/main.sh               # the Debian `fortunes` collection (setup installs it)
#   bash scripts/main.sh my_text.txt   # any text file
#
# Everything goes to ${RUN_DIR:-runs/main}: the tokenized data, the run (metrics.jsonl,
# loss.png, checkpoints) and the final model. On a machine with a GPU that Tessera sees,
# a larger model trains on it for the same minute.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
TESSERA="${BUILD_DIR:-build}/tessera"
RUN_DIR=${RUN_DIR:-runs/main}
mkdir -p "$RUN_DIR"

CORPUS=${1:-}
if [ -z "$CORPUS" ]; then
  FORTUNES=/usr/share/games/fortunes
  [ -d "$FORTUNES" ] || { echo "main: $FORTUNES is missing (Debian package 'fortunes'); name a text file instead" >&2; exit 1; }
  CORPUS="$RUN_DIR/corpus.txt"
  # The fortune text files, without their .dat indexes and .u8 links; '%' lines separate fortunes.
  find -L "$FORTUNES" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -print0 | sort -z | xargs -0 cat >"$CORPUS"
fi
[ -s "$CORPUS" ] || { echo "main: corpus '$CORPUS' is empty or missing" >&2; exit 1; }

echo "== prepare: byte-level tokens of $CORPUS"
"$TESSERA" prepare --input "$CORPUS" --tokenizer byte --val-fraction 0.05 --out "$RUN_DIR/data"

# About a minute of training: a 4-layer, 128-channel character-level GPT on the 2-core CPU;
# a wider, deeper one on a GPU.
if "$TESSERA" version | grep -Eq 'devices visible: [1-9]'; then
  SHAPE=(--device cuda --n-layer 6 --n-head 6 --n-embd 384 --seq 256 --batch 32 --steps 1500 --lr 1e-3)
else
  SHAPE=(--device cpu --n-layer 4 --n-head 4 --n-embd 128 --seq 64 --batch 16 --steps ${STEPS:-800} --lr 2e-3)
fi
echo "== train: ${SHAPE[*]}"
"$TESSERA" train --data "$RUN_DIR/data/train.bin" "${SHAPE[@]}" --warmup 50 --schedule cosine \
  --eval-every 100 --eval-batches 8 --save-every 200 --keep-last 2 --out "$RUN_DIR/run"

echo "== eval on the held-out text"
"$TESSERA" eval --model "$RUN_DIR/run/model" --data "$RUN_DIR/data/val.bin" --batches 20 \
  ${SHAPE[0]} ${SHAPE[1]}

echo "== samples"
for seed in 1 2 3; do
  echo "--- seed $seed"
  "$TESSERA" sample --model "$RUN_DIR/run/model" --prompt "A " --max-new-tokens 300 --temperature 0.8 \
    --top-k 40 --seed "$seed" ${SHAPE[0]} ${SHAPE[1]}
done
echo "== loss curve: $RUN_DIR/run/loss.png, metrics: $RUN_DIR/run/metrics.jsonl"
