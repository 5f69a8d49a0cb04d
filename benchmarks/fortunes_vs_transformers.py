#!/usr/bin/python3
"""Fortunes topic classification: Tessera's CLI against transformers' Trainer on the CPU.

One data set (`tessera prepare-fortunes`), one initial model directory (`tessera
init-classifier`, seeded, dropout 0) and its WordPiece tokenizer, trained by both with the
same recipe: AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01 on the matrices), a linear
schedule without warmup, gradient clipping at 1.0, the same batch size and epochs, the same
batches (Tessera's Trainer shuffles each epoch with a seeded Philox permutation, which the
transformers side draws too), dynamic padding to the batch's longest row and truncation at
--max-length. Prints accuracy and macro-F1 of each on the held-out split, the training wall
time per epoch of each and their ratio, then one JSON line.

  /usr/bin/python3 benchmarks/fortunes_vs_transformers.py --tessera build-cpu/tessera

Needs /usr/bin/python3 with torch and transformers (Debian's: torch 1.13, transformers
4.46.3) and the fortune files (scripts/setup.sh installs them).
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, **kwargs).stdout


def metrics(logits, labels, num_labels):
    """Accuracy and macro precision/recall/F1 over every class (zero_division=0)."""
    pred = np.asarray(logits).argmax(axis=1)
    labels = np.asarray(labels)
    f1s = []
    for c in range(num_labels):
        tp = np.sum((pred == c) & (labels == c))
        p = tp / max(np.sum(pred == c), 1)
        r = tp / max(np.sum(labels == c), 1)
        f1s.append(2 * p * r / (p + r) if p + r > 0 else 0.0)
    return {"accuracy": float(np.mean(pred == labels)), "f1": float(np.mean(f1s))}


M32 = 0xFFFFFFFF


def philox4x32_10(seed, counter):
    """core/philox.h's Philox4x32-10 block `counter` under key `seed`."""
    c = [counter & M32, (counter >> 32) & M32, 0, 0]
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def tessera_permutation(n, seed, epoch):
    """data::seeded_permutation: the order Tessera's Trainer reads epoch `epoch` in."""
    out = list(range(n))
    for i in range(n - 1, 0, -1):
        word = philox4x32_10(seed, (epoch << 32) + i // 4)[i % 4]
        j = (word * (i + 1)) >> 32
        out[i], out[j] = out[j], out[i]
    return out


class TesseraOrder:
    """A sampler drawing Tessera's permutation of each epoch, so both trainers see the same
    batches (transformers' own RandomSampler would draw another order)."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        order = tessera_permutation(self.n, self.seed, self.epoch)
        self.epoch += 1  # transformers 4.46 calls set_epoch only for some samplers
        return iter(order)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def tessera_run(a, work, env):
    config = {
        "task": "classification", "num_train_epochs": a.epochs, "per_device_train_batch_size": a.batch,
        "learning_rate": a.lr, "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999,
        "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 0,
        "eval_strategy": "no", "save_strategy": "no", "logging_steps": 20, "seed": a.seed,
        "max_length": a.max_length, "report_to": "none",
    }
    with open(os.path.join(work, "tessera_recipe.json"), "w") as f:
        json.dump(config, f)
    start = time.perf_counter()
    run([a.tessera, "train", "--config", os.path.join(work, "tessera_recipe.json"), "--init",
         os.path.join(work, "init"), "--data", os.path.join(work, "data", "train.jsonl"), "--out",
         os.path.join(work, "tessera_run"), "--overwrite-output-dir"], env=env)
    seconds = time.perf_counter() - start
    preds = os.path.join(work, "tessera_preds.jsonl")
    run([a.tessera, "predict", "--model", os.path.join(work, "tessera_run", "model"), "--data",
         os.path.join(work, "data", "val.jsonl"), "--max-length", str(a.max_length), "--out", preds], env=env)
    logits = [row["logits"] for row in read_jsonl(preds)]
    return logits, seconds


def transformers_run(a, work):
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    init = os.path.join(work, "init")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(init)
    model = transformers.BertForSequenceClassification.from_pretrained(init)

    def encode(rows):
        enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=a.max_length)
        return [{"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                 "attention_mask": enc["attention_mask"][i], "labels": r["label"]} for i, r in enumerate(rows)]

    train_set = encode(read_jsonl(os.path.join(work, "data", "train.jsonl")))
    val_set = encode(read_jsonl(os.path.join(work, "data", "val.jsonl")))

    class InOrderTrainer(transformers.Trainer):  # Tessera's order of the batches
        def _get_train_sampler(self):
            return TesseraOrder(len(self.train_dataset), a.seed)

    args = transformers.TrainingArguments(
        output_dir=os.path.join(work, "hf_run"), num_train_epochs=a.epochs,
        per_device_train_batch_size=a.batch, per_device_eval_batch_size=64, learning_rate=a.lr,
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        lr_scheduler_type="linear", warmup_steps=0, optim="adamw_torch", eval_strategy="no",
        save_strategy="no", logging_steps=20, seed=a.seed, report_to=[], use_cpu=True,
        dataloader_drop_last=False)
    trainer = InOrderTrainer(model=model, args=args, train_dataset=train_set,
                             data_collator=transformers.DataCollatorWithPadding(tokenizer))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    out = trainer.predict(val_set)
    return out.predictions, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tessera", default="build-cpu/tessera")
    p.add_argument("--work", default="runs/fortunes_vs_transformers")
    p.add_argument("--files", default="computers,definitions,politics,songs-poems,startrek,zippy")
    p.add_argument("--max-per-class", type=int, default=150)
    p.add_argument("--vocab-size", type=int, default=3000)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    a.tessera = os.path.abspath(a.tessera)
    os.makedirs(a.work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    data = os.path.join(a.work, "data")
    run([a.tessera, "prepare-fortunes", "--files", a.files, "--max-per-class", str(a.max_per_class),
         "--vocab-size", str(a.vocab_size), "--seed", str(a.seed), "--out", data], env=env)
    run([a.tessera, "init-classifier", "--tokenizer", data, "--labels", a.files, "--hidden-size",
         str(a.hidden_size), "--num-layers", str(a.layers), "--num-heads", str(a.heads),
         "--intermediate-size", str(4 * a.hidden_size), "--max-positions", str(a.max_length),
         "--dropout", "0", "--seed", str(a.seed), "--out", os.path.join(a.work, "init")], env=env)
    labels = [r["label"] for r in read_jsonl(os.path.join(data, "val.jsonl"))]
    classes = len(a.files.split(","))
    t_logits, t_seconds = tessera_run(a, a.work, env)
    h_logits, h_seconds = transformers_run(a, a.work)
    t, h = metrics(t_logits, labels, classes), metrics(h_logits, labels, classes)
    logit_gap = float(np.max(np.abs(np.asarray(t_logits) - np.asarray(h_logits))))
    agree = float(np.mean(np.argmax(t_logits, axis=1) == np.argmax(h_logits, axis=1)))
    print(f"\n{len(labels)} held-out fortunes, {classes} classes, {a.epochs} epochs, batch {a.batch}, lr {a.lr}")
    print(f"{'':14}{'accuracy':>10}{'macro-F1':>10}{'s/epoch':>10}")
    print(f"{'tessera':14}{t['accuracy']:10.4f}{t['f1']:10.4f}{t_seconds / a.epochs:10.2f}")
    print(f"{'transformers':14}{h['accuracy']:10.4f}{h['f1']:10.4f}{h_seconds / a.epochs:10.2f}")
    print(f"time per epoch, tessera / transformers: {t_seconds / h_seconds:.3f}")
    print(f"same predicted class on {100 * agree:.1f}% of the rows; largest logit difference {logit_gap:.2e}")
    print(json.dumps({"tessera": dict(t, seconds_per_epoch=t_seconds / a.epochs),
                      "transformers": dict(h, seconds_per_epoch=h_seconds / a.epochs),
                      "time_ratio": t_seconds / h_seconds, "prediction_agreement": agree,
                      "max_logit_difference": logit_gap,
                      "accuracy_gap_points": 100 * abs(t["accuracy"] - h["accuracy"]),
                      "f1_gap_points": 100 * abs(t["f1"] - h["f1"])}))


if __name__ == "__main__":
    sys.exit(main())
