"""The portable training template in Python (examples/train_template.cpp line for line): the
same program runs as one process, under ``tessera launch --nproc-per-node N`` or torchrun.

    python3 train_template.py [--data train.bin] [--steps 40] [--accum 2] [--batch 4]
                              [--seq 32] [--out checkpoints]

Gradient accumulation, per-rank seeding, logging on the main process only and a checkpoint
(Accelerator.save_state) at the end of every epoch. Without --data a small synthetic token
file is written first, so the template runs anywhere.
"""
import argparse
import os
import tempfile

import tessera
from tessera import nn, optim, data


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", default="checkpoints")
    args = p.parse_args()

    acc = tessera.Accelerator(gradient_accumulation_steps=args.accum)
    data_path = args.data
    if not data_path:
        # A repeating pattern a small model can learn; the main process writes it, all wait.
        data_path = os.path.join(tempfile.gettempdir(), "tessera_template_tokens.bin")
        if acc.is_main_process:
            data.write_token_file(data_path, [(i * 7 + i // 5) % 64 for i in range(20000)], vocab_size=256)
        acc.wait_for_everyone()

    # Same weights everywhere come from DDP's broadcast; the per-rank seed is for whatever
    # each rank draws on its own (dropout).
    tessera.manual_seed(42 + acc.process_index)
    model = nn.GPT(nn.GPTConfig(vocab_size=256, block_size=args.seq, n_layer=2, n_head=4, n_embd=64),
                   device=acc.device)
    opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = data.DataLoader(data.TokenFile(data_path), batch_size=args.batch, seq_len=args.seq,
                             device=acc.device, max_batches=args.steps * args.accum)
    sched = optim.CosineSchedule(opt, warmup=min(5, args.steps // 2), total=args.steps)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    # An epoch: the optimizer steps that read the whole file once.
    tokens_per_step = loader.tokens_per_step() * args.accum
    steps_per_epoch = max(1, len(loader.file) // tokens_per_step)
    step, step_loss = 0, 0.0
    for x, y in loader:
        with acc.accumulate(model):
            loss = model.loss(x, y)
            acc.backward(loss)
            step_loss += loss.item() / args.accum
            # On accumulating micro-steps the prepared optimizer and schedule skip these
            # calls (and clipping returns 0).
            norm = acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if not acc.sync_gradients:
            continue
        # Logged loss: this rank's share; the mean over ranks costs one small all_reduce.
        mean_loss = acc.reduce(tessera.full([1], step_loss, dtype=tessera.float64), "mean").item()
        if step % 5 == 0:
            acc.print(f"step {step}  loss {mean_loss:.6f}  grad_norm {norm:.4f}  lr {opt.lr:.6g}")
        step_loss = 0.0
        step += 1
        if step % steps_per_epoch == 0:
            acc.save_state(f"{args.out}/epoch_{step // steps_per_epoch}")
            acc.print(f"saved {args.out}/epoch_{step // steps_per_epoch}")
    acc.wait_for_everyone()
    acc.save_state(f"{args.out}/last")
    acc.print(f"done: {step} optimizer steps on {acc.num_processes} process(es)")
    acc.end_training()


if __name__ == "__main__":
    main()
