#!/usr/bin/env bash
# Regenerates the seed corpus fuzz/corpus/<reader>/ from files the built `tessera` writes
# (so the seeds follow the formats as they change) plus a few hand-made edge cases
# (fuzz/make_seeds.py). Usage: fuzz/make_corpus.sh [TESSERA] (default build-cpu/tessera).
set -euo pipefail
cd "$(dirname "$0")/.."
T=$(realpath "${1:-build-cpu/tessera}")
C=fuzz/corpus
W=$(mktemp -d /tmp/tessera-corpus.XXXXXX)
trap 'rm -rf "$W"' EXIT
rm -rf $C && mkdir -p $C/safetensors $C/text_table $C/token_file $C/tokenizer $C/train_config $C/training_state

python3 - "$W/text.txt" <<'PY'
import random, sys
rng = random.Random(5)
words = "the cat sat on a mat while dogs ran far away over green hills to see the sea".split()
text = " ".join(rng.choice(words) for _ in range(3000)) + "\nnaïve café ☕ 𝄞 \t tabs\n"
open(sys.argv[1], "w", encoding="utf-8").write(text)
PY
$T prepare --input $W/text.txt --tokenizer bpe --vocab 300 --out $W/bpe >/dev/null
$T prepare --input $W/text.txt --tokenizer byte --out $W/byte >/dev/null
cp $W/bpe/tokenizer.json $C/tokenizer/bpe.json
cp $W/byte/tokenizer.json $C/tokenizer/byte.json
# Token files: the first 64 tokens of each (headers and short bodies keep the seeds small).
python3 - $W/bpe/val.bin $C/token_file/v1.bin <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
header = list(struct.unpack("<256i", data[:1024]))
count = min(header[2], 64)
header[2] = count
width = 2 if header[1] == 1 else 4
open(sys.argv[2], "wb").write(struct.pack("<256i", *header) + data[1024:1024 + count * width])
PY
# A tiny run: its model.safetensors, its settings, and the training-state files of its
# checkpoint with the model and data shape fuzz/fuzz_training_state.cpp loads them into
# (1 layer, 2 heads, 4 channels, 13 tokens; batch 2 x 4; cosine schedule), so the seeds
# pass the contents checks and the fuzzer starts deep in them.
python3 - $W/tiny.bin <<'PY'
import struct, sys
tokens = [(i * 7 + i // 5) % 13 for i in range(512)]
open(sys.argv[1], "wb").write(struct.pack("<256i", 20240520, 1, len(tokens), *[0] * 253) +
                              struct.pack("<%dH" % len(tokens), *tokens))
PY
$T train --data $W/tiny.bin --vocab-size 13 --n-layer 1 --n-head 2 --n-embd 4 --seq 4 --batch 2 \
  --steps 4 --warmup 1 --save-every 2 --eval-every 0 --out $W/run >/dev/null
ckpt=$W/run/checkpoint-4
cp $ckpt/model.safetensors $C/safetensors/gpt_tiny.safetensors
for f in model.safetensors optimizer.safetensors accelerator_state.json trainer_state.json; do
  cp $ckpt/$f $C/training_state/$f
done
cp $ckpt/training_args.json $C/train_config/training_args.json
python3 fuzz/make_seeds.py $C
echo "fuzz corpus: $(find $C -type f | wc -l) files, $(du -sb $C | cut -f1) bytes"
