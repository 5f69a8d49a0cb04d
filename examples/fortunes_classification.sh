#!/usr/bin/env bash
# Topic classification of the Debian fortunes corpus with the `tessera` CLI alone (no Python):
# which fortune file does a fortune come from? Six classes (computers, definitions, politics,
# songs-poems, startrek, zippy), a held-out split fixed by a seeded hash of each text, and two
# models, each printing eval_accuracy and eval_f1 (macro) on the held-out split:
#   1. a small BERT-shaped model, randomly initialised (seeded), its WordPiece vocabulary
#      counted from the training text (data/wordpiece_vocab.h: a frequency count, not HF's
#      WordPiece trainer), fine-tuned for classification;
#   2. a GPT-2-shaped model pretrained first as a language model on the training fortunes
#      (`tessera prepare` + `tessera train`), then fine-tuned for classification: a new score
#      head on the pretrained body.
#
#   TESSERA=build-cpu/tessera OUT=runs/fortunes bash examples/fortunes_classification.sh
#
# Needs the fortune files (/usr/share/games/fortunes; scripts/setup.sh installs them).
# EPOCHS, LM_STEPS and THREADS make it shorter or longer (defaults: 3, 600, 2).
set -euo pipefail
T=${TESSERA:-build/tessera}
OUT=${OUT:-runs/fortunes}
EPOCHS=${EPOCHS:-3}
LM_STEPS=${LM_STEPS:-600}
export OMP_NUM_THREADS=${THREADS:-2}
FILES=computers,definitions,politics,songs-poems,startrek,zippy
mkdir -p "$OUT"

"$T" prepare-fortunes --files "$FILES" --val-fraction 0.15 --seed 0 --vocab-size 4000 --out "$OUT/data"

# The fine-tuning recipe, in Hugging Face's TrainingArguments names.
cat > "$OUT/finetune.json" <<JSON
{"task": "classification", "num_train_epochs": $EPOCHS, "per_device_train_batch_size": 32,
 "learning_rate": 1e-3, "weight_decay": 0.01, "adam_beta2": 0.999, "lr_scheduler_type": "linear",
 "warmup_ratio": 0.1, "eval_strategy": "epoch", "save_strategy": "epoch", "save_total_limit": 1,
 "load_best_model_at_end": true, "metric_for_best_model": "accuracy", "logging_steps": 20,
 "max_length": 128, "shuffle": true, "seed": 0}
JSON

echo "== 1. BERT-shaped, from scratch"
"$T" init-classifier --tokenizer "$OUT/data" --labels "$FILES" --hidden-size 128 --num-layers 2 \
     --num-heads 2 --intermediate-size 512 --max-positions 128 --dropout 0.1 --seed 0 --out "$OUT/bert-init"
"$T" train --config "$OUT/finetune.json" --init "$OUT/bert-init" --data "$OUT/data/train.jsonl" \
     --val-data "$OUT/data/val.jsonl" --out "$OUT/bert-run" --overwrite-output-dir
echo -n "bert held-out: "
"$T" eval --task classification --model "$OUT/bert-run/model" --data "$OUT/data/val.jsonl"

echo "== 2. GPT-2-shaped: pretrained on the training fortunes, then fine-tuned"
"$T" prepare --input "$OUT/data/train.txt" --tokenizer bpe --vocab 2048 --out "$OUT/lm-data"
"$T" train --data "$OUT/lm-data/train.bin" --val-data "$OUT/lm-data/val.bin" --n-layer 2 --n-head 2 \
     --n-embd 128 --block-size 128 --seq 128 --batch 16 --steps "$LM_STEPS" --lr 2e-3 --warmup 50 \
     --shuffle --out "$OUT/gpt2-lm" --overwrite-output-dir
# The language model's config.json names no labels: they come from the training labels, here
# the topic names (sorted, so the same ids as the label column). Its byte-level BPE has no pad
# token: id 0 (the NUL byte, in no fortune) pads the batches.
"$T" train --config "$OUT/finetune.json" --init "$OUT/gpt2-lm/model" --pad-token-id 0 \
     --label-column topic --data "$OUT/data/train.jsonl" --val-data "$OUT/data/val.jsonl" \
     --out "$OUT/gpt2-run" --overwrite-output-dir
echo -n "gpt2 held-out: "
"$T" eval --task classification --model "$OUT/gpt2-run/model" --data "$OUT/data/val.jsonl" --label-column topic
