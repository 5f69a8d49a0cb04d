"""A training loop that test_accelerate.py runs twice: once straight through (saving the
Accelerator state after --save-at optimizer steps), once resumed from that state. Writes the
final weights to OUT/final.npz. Dropout is on, so the generator state must resume too."""
import argparse
import os

import numpy as np

import tessera
from tessera import nn, optim, data

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save-at", type=int, default=3)
p.add_argument("--resume-from", default="")
args = p.parse_args()

accum = 2
acc = tessera.Accelerator(gradient_accumulation_steps=accum)
tessera.manual_seed(3)
model = nn.GPT(nn.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
loader = data.DataLoader(data.TokenFile(args.data), batch_size=4, seq_len=16, shuffle=True, seed=5,
                         max_batches=args.steps * accum)
sched = optim.CosineSchedule(opt, warmup=2, total=args.steps)
acc.prepare(model, opt, loader, sched)
if args.resume_from:
    acc.load_state(args.resume_from)
step = loader.position // accum
for x, y in loader:
    with acc.accumulate(model):
        acc.backward(model.loss(x, y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    if acc.sync_gradients:
        step += 1
        if step == args.save_at and not args.resume_from:
            acc.save_state(f"{args.out}/checkpoint")
acc.print(f"finished at step {step}, lr {opt.lr:.6g}")
if acc.is_main_process:
    os.makedirs(args.out, exist_ok=True)
    np.savez(f"{args.out}/final.npz", **{k: np.asarray(v) for k, v in model.state_dict().items()})
acc.end_training()
