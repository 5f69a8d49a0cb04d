"""Accelerate's basic training loop (its quick tour's "workflow 1") in Tessera, line for line:

    python3 accelerate_training_loop.py [--epochs 2] [--steps-per-epoch 20] [--out run]
    tessera launch --nproc-per-node 2 python3 accelerate_training_loop.py

Accelerator(), prepare(model, optimizer, dataloader, scheduler), accelerator.backward(loss),
an evaluation whose losses come back from every process with gather_for_metrics, and
save_model at the end. A small synthetic token file is written by the main process first
(main_process_first), so the example runs anywhere.
"""
import argparse
import os
import tempfile

import numpy as np

import tessera
from tessera import data, nn, optim


def synthetic_tokens(path, count):
    # A repeating pattern with a little noise: a small model learns most of it.
    rng = np.random.default_rng(0)
    tokens = [(i * 7 + i // 5) % 64 for i in range(count)]
    noise = rng.integers(0, 64, count)
    data.write_token_file(path, [n if rng.random() < 0.05 else t for t, n in zip(tokens, noise)], vocab_size=64)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "tessera_accelerate_loop"))
    args = p.parse_args()

    accelerator = tessera.Accelerator()
    train_path, eval_path = os.path.join(args.out, "train.bin"), os.path.join(args.out, "eval.bin")
    with accelerator.main_process_first():  # one process writes, the others find the files
        if accelerator.is_main_process:
            os.makedirs(args.out, exist_ok=True)
            synthetic_tokens(train_path, 20000)
            synthetic_tokens(eval_path, 3000)

    tessera.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=64, block_size=args.seq, n_layer=2, n_head=4, n_embd=64),
                   device=accelerator.device)
    optimizer = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train_dataloader = data.DataLoader(data.TokenFile(train_path), batch_size=args.batch, seq_len=args.seq,
                                       shuffle=True, seed=1, device=accelerator.device,
                                       max_batches=args.steps_per_epoch)
    scheduler = optim.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=5,
                                                      num_training_steps=args.epochs * args.steps_per_epoch)
    model, optimizer, train_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, scheduler)

    eval_rows = data.DataLoader(data.TokenFile(eval_path), batch_size=4, seq_len=args.seq, max_batches=6)
    for epoch in range(args.epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        for inputs, targets in train_dataloader:
            optimizer.zero_grad()
            loss = model.loss(inputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()

        # Evaluation: each process scores its share of the batches; every loss comes back.
        model.eval()
        with tessera.no_grad(), accelerator.split_between_processes(list(range(len(eval_rows)))) as mine:
            losses = [model.loss(*eval_rows.batch_at(k)).reshape([1]) for k in mine]
        losses = accelerator.gather_for_metrics(tessera.cat(losses) if losses else tessera.zeros(0))
        accelerator.print(f"epoch {epoch}: eval loss {float(np.asarray(losses).mean()):.4f} "
                          f"over {losses.shape[0]} batches")

    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(args.out, "model"))
    accelerator.print(f"done: {args.epochs} epochs on {accelerator.num_processes} process(es)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
