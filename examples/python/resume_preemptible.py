"""Training that survives preemption ("workflow 7" of Accelerate's guides) in Tessera:

    python3 resume_preemptible.py --out run            # trains; killed? run it again
    python3 resume_preemptible.py --out run --stop-after 7   # simulates a preemption

Every --checkpoint-every optimizer steps the whole state is saved with
accelerator.save_state(run/checkpoints/step_N): weights, optimizer and scheduler, the
DataLoader's position, the random generators, and a registered object (the step counter, via
register_for_checkpointing). On start, the newest complete checkpoint is loaded
(load_state), the epoch continues where it stopped (skip_first_batches), and the run ends
with the same weights as one that was never interrupted. Dropout is on, so the generator
state must resume too.
"""
import argparse
import os
import sys

import numpy as np

import tessera
from tessera import data, nn, optim


class Progress:
    """The optimizer steps done; saved and restored with the Accelerator's state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def newest_checkpoint(folder):
    if not os.path.isdir(folder):
        return None
    # Only complete ones: save_state writes checksums.json last.
    steps = [int(name.split("_")[1]) for name in os.listdir(folder)
             if name.startswith("step_") and os.path.isfile(os.path.join(folder, name, "checksums.json"))]
    return os.path.join(folder, f"step_{max(steps)}") if steps else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--stop-after", type=int, default=0, help="exit after this many steps (a preemption)")
    p.add_argument("--seq", type=int, default=16)
    args = p.parse_args()

    accelerator = tessera.Accelerator(gradient_accumulation_steps=2)
    path = os.path.join(args.out, "tokens.bin")
    with accelerator.main_process_first():
        if accelerator.is_main_process and not os.path.exists(path):
            os.makedirs(args.out, exist_ok=True)
            data.write_token_file(path, np.random.default_rng(0).integers(0, 64, 12000), vocab_size=64)

    tessera.manual_seed(3)
    model = nn.GPT(nn.GPTConfig(vocab_size=64, block_size=args.seq, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    optimizer = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    micro_per_epoch = args.steps_per_epoch * accelerator.gradient_accumulation_steps
    loader = data.DataLoader(data.TokenFile(path), batch_size=4, seq_len=args.seq, shuffle=True, seed=5,
                             max_batches=micro_per_epoch)
    scheduler = optim.get_cosine_schedule_with_warmup(optimizer, 2, args.epochs * args.steps_per_epoch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = os.path.join(args.out, "checkpoints")
    resume = newest_checkpoint(checkpoints)
    starting_epoch, resume_step = 0, 0
    if resume:
        accelerator.load_state(resume)  # also puts the loader where it was
        starting_epoch, done = divmod(progress.step, args.steps_per_epoch)
        resume_step = done * accelerator.gradient_accumulation_steps  # micro-batches into the epoch
        accelerator.print(f"resumed from {resume} at step {progress.step} (epoch {starting_epoch})")

    for epoch in range(starting_epoch, args.epochs):
        loader.set_epoch(epoch)
        active = accelerator.skip_first_batches(loader, resume_step) if epoch == starting_epoch else loader
        for inputs, targets in active:
            with accelerator.accumulate(model):
                accelerator.backward(model.loss(inputs, targets))
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            if progress.step % args.checkpoint_every == 0:
                accelerator.save_state(os.path.join(checkpoints, f"step_{progress.step}"))
            if progress.step == args.stop_after:
                accelerator.print(f"preempted after step {progress.step}")
                accelerator.end_training()
                sys.exit(0)
    accelerator.save_model(model, os.path.join(args.out, "model"))
    accelerator.print(f"done: {progress.step} optimizer steps on {accelerator.num_processes} process(es)")
    accelerator.end_training()


if __name__ == "__main__":
    main()
