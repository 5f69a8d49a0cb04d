"""Accelerate's gradient accumulation with mixed precision ("workflow 2") in Tessera:

    python3 accumulate_mixed_precision.py [--mixed-precision bf16] [--accum 4] [--steps 12]
    tessera launch --nproc-per-node 2 python3 accumulate_mixed_precision.py

Accelerator(mixed_precision=..., gradient_accumulation_steps=N): inside
`with accelerator.accumulate(model)` the forward runs in the low precision, backward divides the
loss by N, and the optimizer, scheduler and clipping act only on every N-th micro-step
(accelerator.sync_gradients), when the gradients are synchronised across processes. The
parameters are bf16 with f32 master weights in the optimizer; fp16 adds a dynamic loss scale
(a step whose gradients overflow is skipped: accelerator.optimizer_step_was_skipped).
"""
import argparse
import os
import tempfile

import tessera
from tessera import data, nn, optim


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16", "fp16"])
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch and process")
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()

    accelerator = tessera.Accelerator(mixed_precision=args.mixed_precision,
                                      gradient_accumulation_steps=args.accum)
    path = os.path.join(tempfile.gettempdir(), f"tessera_accumulate_{os.getuid()}.bin")
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            data.write_token_file(path, [(i * 5 + i // 3) % 48 for i in range(16000)], vocab_size=64)

    tessera.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(vocab_size=64, block_size=args.seq, n_layer=2, n_head=4, n_embd=64),
                   device=accelerator.device)
    optimizer = optim.AdamW(model.parameters(), lr=3e-3)
    # One epoch: steps x accum micro-batches.
    loader = data.DataLoader(data.TokenFile(path), batch_size=args.batch, seq_len=args.seq,
                             device=accelerator.device, max_batches=args.steps * args.accum)
    scheduler = optim.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                      num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    first_loss = last_loss = None
    step, step_loss = 0, 0.0
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = model.loss(inputs, targets)
            accelerator.backward(loss)
            step_loss += loss.float().item() / args.accum
            if accelerator.sync_gradients:  # the last micro-step of the group
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # acts on syncing micro-steps only
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            mean = accelerator.reduce(tessera.full([1], step_loss, dtype=tessera.float64), "mean").item()
            first_loss = mean if first_loss is None else first_loss
            last_loss = mean
            skipped = " (skipped: overflow)" if accelerator.optimizer_step_was_skipped else ""
            accelerator.print(f"step {step}: loss {mean:.4f} lr {optimizer.lr:.3g} "
                              f"loss scale {accelerator.loss_scale:g}{skipped}")
            step_loss = 0.0
    dtype = str(model.parameters()[0].dtype).split(".")[-1]
    accelerator.print(f"done: {step} optimizer steps of {args.accum} micro-batches, parameters {dtype}, "
                      f"loss {first_loss:.4f} -> {last_loss:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
