"""PyTorch reference for bench_bert_classify: transformers' BertForSequenceClassification
(SDPA attention) on the same padded batches (the same hash of the batch and row numbers gives
the lengths, token ids and labels), bf16 autocast with f32 parameters, fused AdamW, global-norm
clipping at 1.0, eager or torch.compile (dynamic shapes: every batch has its own padded
length), timed as the C++ side times (warm-up steps, then the mean over the timed steps between
device synchronisations; peak memory over the timed steps). Prints one JSON line:
  {"mode", "ms_per_step", "tokens_per_s", "samples_per_s", "peak_gib", "loss", "torch"}
(tokens_per_s counts padded positions). --device cpu is for checking the script without a GPU.
"""
import argparse
import json
import time

import torch


def mix(x):
    """Murmur3's 32-bit finaliser of x folded to 32 bits (bench_bert_classify.cpp's mix)."""
    h = (x ^ (x >> 32)) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def make_batches(args, device):
    batches = []
    for b in range(args.batches):
        lengths = [32 + mix(b * args.batch + r) % (args.max_len - 31) for r in range(args.batch)]
        T = min(args.max_len, (max(lengths) + 7) // 8 * 8)
        ids = torch.zeros(args.batch, T, dtype=torch.long)
        mask = torch.zeros(args.batch, T, dtype=torch.long)
        labels = torch.zeros(args.batch, dtype=torch.long)
        for r in range(args.batch):
            row = b * args.batch + r
            labels[r] = mix(row * 7919 + 1) % 2
            for t in range(lengths[r]):
                ids[r, t] = 101 if t == 0 else 1000 + mix(row * 100003 + t) % (args.vocab - 1000)
            mask[r, : lengths[r]] = 1
        batches.append((ids.to(device), mask.to(device), labels.to(device)))
    return batches


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()

    from transformers import BertConfig, BertForSequenceClassification

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=args.vocab, hidden_size=args.channels,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     intermediate_size=4 * args.channels, max_position_embeddings=args.max_len,
                     hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                     num_labels=2)
    try:  # SDPA attention where this transformers offers the choice (older ones: eager only)
        model = BertForSequenceClassification(cfg, attn_implementation="sdpa")
    except TypeError:
        model = BertForSequenceClassification(cfg)
    model = model.to(device).train()
    options = dict(lr=2e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if args.device == "cuda":
        options["fused"] = True
    opt = torch.optim.AdamW(model.parameters(), **options)
    step_model = torch.compile(model, dynamic=True) if args.mode == "compile" else model
    batches = make_batches(args, device)
    autocast_dtype = torch.bfloat16

    def step(i):
        ids, mask, labels = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=autocast_dtype):
            loss = step_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, ids.numel()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(i)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    padded = 0
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        loss, n = step(i)
        padded += n
    sync()
    seconds = time.perf_counter() - start
    ms = 1e3 * seconds / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    print(json.dumps({"mode": args.mode, "ms_per_step": ms, "tokens_per_s": padded / seconds,
                      "samples_per_s": args.batch * args.steps / seconds, "peak_gib": peak,
                      "loss": float(loss), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
