"""Distributed batch inference (examples/batch_inference.cpp in Python): each process completes
its share of the prompts (split_between_processes with padding, so every process runs the same
number of batches) and the main process prints all completions, gathered in order with the
padding dropped (gather_for_metrics).

    tessera launch --nproc-per-node 3 python3 batch_inference.py [--model DIR] [--new 8]

Without --model a small randomly initialised GPT is used (same seed on every rank).
"""
import argparse

import tessera
from tessera import nn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="")
    p.add_argument("--new", type=int, default=8)
    args = p.parse_args()

    acc = tessera.Accelerator()
    if args.model:
        model = nn.GPT.from_pretrained(args.model, device=acc.device)
    else:
        tessera.manual_seed(1)  # identical weights on every process
        model = nn.GPT(nn.GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=32),
                       device=acc.device)
    model.eval()

    # 10 prompts of 6 tokens each: prompt p is p, p+1, ..., p+5.
    prompt_len, num_prompts = 6, 10
    with acc.split_between_processes(list(range(num_prompts)), apply_padding=True) as mine:
        idx = tessera.tensor([[(p + t) % 128 for t in range(prompt_len)] for p in mine], dtype=tessera.int64)
        out = model.generate(idx, args.new, temperature=0)  # greedy: deterministic

    # Rows of every process in rank order, padding rows dropped: one per prompt.
    everything = acc.gather_for_metrics(out)
    if acc.is_main_process:
        for p, row in enumerate(everything.tolist()):
            print(f"prompt {p}: " + " ".join(map(str, row[:prompt_len])) + " | " +
                  " ".join(map(str, row[prompt_len:])))
        print(f"completed {everything.shape[0]} prompts on {acc.num_processes} process(es)")
    acc.end_training()


if __name__ == "__main__":
    main()
