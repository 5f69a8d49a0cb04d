"""Topic classification of the Debian fortunes corpus from Python, with transformers' Trainer
API in Tessera (the Python side of examples/fortunes_classification.sh):

    python3 fortunes_classification.py [--model bert|gpt2|both] [--epochs 3] [--out DIR]
    tessera launch --nproc-per-node 2 python3 fortunes_classification.py

Which fortune file does a fortune come from? Six classes (computers, definitions, politics,
songs-poems, startrek, zippy; /usr/share/games/fortunes, which scripts/setup.sh installs), the
fortunes split on their "%" lines and held out by the seeded FNV-1a hash of each text, the same
split as `tessera prepare-fortunes --val-fraction 0.15 --seed 0`. A WordPiece vocabulary is
counted from the training texts (data.build_wordpiece_vocab), and two models learn the task
from scratch, each with the same Trainer recipe:
  1. a BERT-shaped BertForSequenceClassification;
  2. a GPT-2-shaped classifier: a GPT body saved with save_pretrained and loaded by
     AutoModelForSequenceClassification.from_pretrained(dir, num_labels=..., id2label=...,
     pad_token_id=...), so that its score head is new, as transformers does for a language model.
     (The shell example pretrains this body on the fortunes first; here it starts from random.)
compute_metrics computes accuracy and macro F1 with NumPy from the EvalPrediction; the best
epoch by accuracy is restored at the end (load_best_model_at_end), then trainer.evaluate() prints
the held-out figures and the training time per epoch.
"""
import argparse
import json
import os
import tempfile
import time

import numpy as np

import tessera
from tessera import data, nn

FILES = ["computers", "definitions", "politics", "songs-poems", "startrek", "zippy"]
MASK64 = (1 << 64) - 1


def read_fortunes(path):
    """The fortunes of one file: the stretches between lines holding only "%", trimmed, with
    bytes that are not UTF-8 replaced (U+FFFD)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    fortunes, current = [], []
    for line in text.split("\n") + ["%"]:
        line = line[:-1] if line.endswith("\r") else line
        if line == "%":
            fortune = "\n".join(current).strip(" \t\n")
            if fortune:
                fortunes.append(fortune)
            current = []
        else:
            current.append(line)
    return fortunes


def split_hash(seed, text):
    """FNV-1a of the seed and the text's UTF-8 bytes as a fraction in [0, 1) (prepare-fortunes'
    split_hash): the same text always lands in the same split."""
    h = 1469598103934665603 ^ ((seed * 0x9E3779B97F4A7C15) & MASK64)
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 1099511628211) & MASK64
    h ^= h >> 33
    return (h >> 11) / float(1 << 53)


def write_split(fortunes_dir, out, val_fraction, seed):
    """train.jsonl and val.jsonl ({"text", "label", "topic"}); returns the training texts."""
    train_texts = []
    with open(os.path.join(out, "train.jsonl"), "w") as train, open(os.path.join(out, "val.jsonl"), "w") as val:
        for label, name in enumerate(FILES):
            for text in read_fortunes(os.path.join(fortunes_dir, name)):
                row = json.dumps({"text": text, "label": label, "topic": name}) + "\n"
                if split_hash(seed, text) < val_fraction:
                    val.write(row)
                else:
                    train.write(row)
                    train_texts.append(text)
    return train_texts


def compute_metrics(eval_pred):
    """transformers' hook: the EvalPrediction of the whole evaluation set -> named metrics."""
    logits, labels = eval_pred
    predictions = np.argmax(logits, axis=-1)
    f1 = []
    for c in range(logits.shape[1]):  # macro F1, as sklearn's f1_score(average="macro")
        tp = np.sum((predictions == c) & (labels == c))
        fp, fn = np.sum((predictions == c) & (labels != c)), np.sum((predictions != c) & (labels == c))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": float(np.mean(predictions == labels)), "f1": float(np.mean(f1))}


def make_model(kind, tokenizer, out, args):
    id2label = dict(enumerate(FILES))
    tessera.manual_seed(args.seed)
    if kind == "bert":
        return nn.BertForSequenceClassification(nn.BertConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=2, intermediate_size=4 * args.hidden, max_position_embeddings=args.max_length,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=len(FILES), id2label=id2label))
    body = os.path.join(out, "gpt2-body")
    nn.GPT(nn.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.max_length, n_layer=args.layers,
                        n_head=2, n_embd=args.hidden, dropout=0.1)).save_pretrained(body)
    return nn.AutoModelForSequenceClassification.from_pretrained(
        body, num_labels=len(FILES), id2label=id2label, pad_token_id=tokenizer.pad_token_id)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "tessera_fortunes"))
    p.add_argument("--fortunes-dir", default="/usr/share/games/fortunes")
    p.add_argument("--model", choices=["bert", "gpt2", "both"], default="both")
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (tests)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    state = tessera.PartialState()
    with state.main_process_first():
        if state.is_main_process:
            os.makedirs(args.out, exist_ok=True)
            train_texts = write_split(args.fortunes_dir, args.out, val_fraction=0.15, seed=args.seed)
            vocab = data.build_wordpiece_vocab(train_texts, vocab_size=args.vocab_size)
            data.WordPieceTokenizer.from_vocab_list(vocab).save_pretrained(os.path.join(args.out, "tokenizer"))
    tokenizer = data.WordPieceTokenizer.from_vocab_file(os.path.join(args.out, "tokenizer", "vocab.txt"))
    train_set = data.ExampleDataset(os.path.join(args.out, "train.jsonl"), tokenizer, max_length=args.max_length)
    val_set = data.ExampleDataset(os.path.join(args.out, "val.jsonl"), tokenizer, max_length=args.max_length)
    state.print(f"data: {len(train_set)} training and {len(val_set)} held-out fortunes, {len(FILES)} topics, "
                f"vocabulary {tokenizer.vocab_size}")

    for kind in ["bert", "gpt2"] if args.model == "both" else [args.model]:
        model = make_model(kind, tokenizer, args.out, args)
        training_args = tessera.TrainingArguments(
            output_dir=os.path.join(args.out, kind + "-run"), overwrite_output_dir=True,
            num_train_epochs=args.epochs, max_steps=args.max_steps, per_device_train_batch_size=32,
            per_device_eval_batch_size=64, learning_rate=1e-3, weight_decay=0.01, warmup_ratio=0.1,
            lr_scheduler_type="linear", eval_strategy="epoch", save_strategy="epoch", save_total_limit=1,
            load_best_model_at_end=True, metric_for_best_model="accuracy", logging_steps=20,
            report_to="none", seed=args.seed)
        trainer = tessera.Trainer(
            model=model, args=training_args, train_dataset=train_set, eval_dataset=val_set,
            data_collator=data.DataCollatorWithPadding(tokenizer), tokenizer=tokenizer,
            compute_metrics=compute_metrics)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        epochs = max(trainer.state["epoch"], 1e-9)
        metrics = trainer.evaluate()
        state.print(f"{kind} held-out: eval_accuracy {metrics['eval_accuracy']:.4f} eval_f1 "
                    f"{metrics['eval_f1']:.4f} after {trainer.state['global_step']} steps "
                    f"({seconds / epochs:.1f} s per epoch on {state.num_processes} process(es))")


if __name__ == "__main__":
    main()
