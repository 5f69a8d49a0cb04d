"""Fine-tuning a sequence classifier with transformers' Trainer API ("workflows 5 and 6" of the
Hugging Face guides) in Tessera:

    python3 finetune_classifier.py [--out run] [--epochs 4] [--train-rows 160]
    tessera launch --nproc-per-node 2 python3 finetune_classifier.py

A small BERT-shaped classifier (BertForSequenceClassification) learns generated labelled text:
reviews of neutral words with a few positive or negative ones, labelled by their kind.
Trainer(model=..., args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
data_collator=DataCollatorWithPadding(tokenizer), tokenizer=..., compute_metrics=...,
callbacks=[EarlyStoppingCallback(early_stopping_patience=2), LogPrinter()]) trains it with an
evaluation every epoch (accuracy and macro F1 from compute_metrics, computed here with NumPy
from the EvalPrediction), stops early when eval_f1 stops improving, and reloads the best
checkpoint. trainer.evaluate() and trainer.predict() follow.
"""
import argparse
import json
import os
import tempfile

import numpy as np

import tessera
from tessera import data, nn

POSITIVE = ["good", "great", "fine", "lovely", "superb", "bright", "happy", "warm", "clever", "neat"]
NEGATIVE = ["bad", "poor", "awful", "dull", "grim", "sad", "cold", "weak", "messy", "slow"]
NEUTRAL = ["the", "film", "was", "and", "a", "plot", "with", "cast", "very", "quite", "story", "it"]


def write_reviews(path, rows, seed):
    """JSON Lines of {"text", "label"}: 1-3 positive (label 1) or negative (label 0) words among
    neutral ones, with one word of the other kind in a fifth of the reviews."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            label = int(rng.integers(0, 2))
            own, other = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
            words = list(rng.choice(own, rng.integers(1, 4))) + list(rng.choice(NEUTRAL, rng.integers(2, 8)))
            if rng.random() < 0.2:
                words.append(rng.choice(other))
            rng.shuffle(words)
            f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")


def write_vocab(path):
    with open(path, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + POSITIVE + NEGATIVE + NEUTRAL) + "\n")


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


class LogPrinter:
    """A transformers-style callback: on_log sees every log dict (loss, learning_rate, epoch,
    eval_*)."""

    def __init__(self, is_main):
        self.is_main, self.evaluations = is_main, []

    def on_log(self, logs):
        if "eval_f1" in logs:
            self.evaluations.append(logs)
            if self.is_main:
                print(f"epoch {logs.get('epoch', 0):.2f}: eval_loss {logs['eval_loss']:.4f} "
                      f"eval_accuracy {logs['eval_accuracy']:.3f} eval_f1 {logs['eval_f1']:.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "tessera_finetune"))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--train-rows", type=int, default=160)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--patience", type=int, default=2)
    args = p.parse_args()

    state = tessera.PartialState()
    with state.main_process_first():
        if state.is_main_process:
            os.makedirs(args.out, exist_ok=True)
            write_vocab(os.path.join(args.out, "vocab.txt"))
            write_reviews(os.path.join(args.out, "train.jsonl"), args.train_rows, seed=1)
            write_reviews(os.path.join(args.out, "eval.jsonl"), args.eval_rows, seed=2)
    tokenizer = data.WordPieceTokenizer.from_vocab_file(os.path.join(args.out, "vocab.txt"))
    train_set = data.ExampleDataset(os.path.join(args.out, "train.jsonl"), tokenizer)
    eval_set = data.ExampleDataset(os.path.join(args.out, "eval.jsonl"), tokenizer)

    tessera.manual_seed(0)
    model = nn.BertForSequenceClassification(nn.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=2, id2label={0: "negative", 1: "positive"}))
    training_args = tessera.TrainingArguments(
        output_dir=os.path.join(args.out, "run"), num_train_epochs=args.epochs, per_device_train_batch_size=16,
        per_device_eval_batch_size=32, learning_rate=1e-2, warmup_ratio=0.1, weight_decay=0.01,
        eval_strategy="epoch", save_strategy="epoch", logging_steps=5, load_best_model_at_end=True,
        metric_for_best_model="f1", report_to="none", seed=0)
    printer = LogPrinter(state.is_main_process)
    trainer = tessera.Trainer(
        model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
        data_collator=data.DataCollatorWithPadding(tokenizer), tokenizer=tokenizer,
        compute_metrics=compute_metrics,
        callbacks=[tessera.EarlyStoppingCallback(early_stopping_patience=args.patience), printer])
    trainer.train()

    metrics = trainer.evaluate()
    prediction = trainer.predict(eval_set)
    predicted = np.argmax(prediction.predictions, axis=-1)
    state.print(f"evaluate: eval_accuracy {metrics['eval_accuracy']:.3f} eval_f1 {metrics['eval_f1']:.3f}")
    state.print(f"predict: {prediction.predictions.shape[0]} rows, test_accuracy "
                f"{prediction.metrics['test_accuracy']:.3f}, first labels {predicted[:8].tolist()}")
    state.print(f"done: {trainer.state['global_step']} steps, {len(printer.evaluations)} evaluations "
                f"on {state.num_processes} process(es)")


if __name__ == "__main__":
    main()
