"""Overhead of Python: the CPU GPT training step of bench_cpu_gpt_train (4 layers, 4 heads, 128
channels, context 128, batch 32, vocab 65, fp32, AdamW + clipping, the same seeds) written in
Python over `import tessera`, against the same step in C++.

Both run in this one process on the same model: the C++ step (tessera._tessera._cpp_training_step,
bench_cpu_gpt_train's loop body) and the Python step alternate one by one, so memory, threads and
whatever else the machine is doing weigh on both alike. Prints ms/step of each (median and best)
and the ratio of the totals (goal: Python <= 1.05x C++). With --cpp (the bench_cpu_gpt_train
program) it also checks that the Python loop from fresh seeds ends at the very loss the C++
program prints: the same computation, only driven from Python.

    PYTHONPATH=build/python python3 benchmarks/python_overhead.py [--steps 20] [--warmup 3]
        [--cpp build/benchmarks/bench_cpu_gpt_train]
"""
import argparse
import os
import re
import statistics
import subprocess
import time

import tessera
from tessera import nn, optim

BATCH, SEQ, VOCAB, LAYERS, HEADS, CHANNELS = 32, 128, 65, 4, 4, 128


class Setup:
    """bench_cpu_gpt_train's model, optimizer and batch, from the same generator draws."""

    def __init__(self):
        gen = tessera.Generator(0)
        self.model = nn.GPT(nn.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS,
                                         n_embd=CHANNELS), generator=gen)
        self.opt = optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.idx = tessera.randint(0, VOCAB, [BATCH, SEQ], generator=gen)
        self.targets = tessera.randint(0, VOCAB, [BATCH, SEQ], generator=gen)
        self.params = self.model.parameters()

    def python_step(self):
        self.opt.zero_grad()
        loss = self.model.loss(self.idx, self.targets)
        loss.backward()
        optim.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return loss.item()

    def cpp_step(self):
        return tessera._tessera._cpp_training_step(self.model, self.opt, self.idx, self.targets, self.params)


def timed(step):
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1000


def check_against_program(program, steps, warmup):
    """The Python loop from fresh seeds vs the C++ program: the same final loss."""
    out = subprocess.run([program, "--no-torch", "--steps", str(steps), "--warmup", str(warmup)],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s*tessera\s+([0-9.]+)\s+[0-9]+\s+\(loss ([0-9.]+)\)", out, re.M)
    if not m:
        raise SystemExit("python_overhead: unexpected output of " + program + ":\n" + out)
    fresh = Setup()
    loss = [fresh.python_step() for _ in range(warmup + steps)][-1]
    print(f"  {os.path.basename(program)} after {warmup + steps} steps: loss {m.group(2)} ({m.group(1)} ms/step); "
          f"the Python loop: loss {loss:.4f}  {'same' if f'{loss:.4f}' == m.group(2) else 'DIFFERENT'}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpp", default="", help="bench_cpu_gpt_train, for the loss cross-check")
    a = p.parse_args()

    s = Setup()
    for _ in range(a.warmup):
        s.cpp_step()
        s.python_step()
    cpp_ms, py_ms = [], []
    for i in range(a.steps):
        # Alternate which goes first, so neither always follows the other.
        if i % 2 == 0:
            cpp_ms.append(timed(s.cpp_step))
            py_ms.append(timed(s.python_step))
        else:
            py_ms.append(timed(s.python_step))
            cpp_ms.append(timed(s.cpp_step))
    threads = os.environ.get("OMP_NUM_THREADS", "all cores")
    print(f"CPU GPT training step ({LAYERS} layers, {HEADS} heads, {CHANNELS} channels, context {SEQ}, "
          f"batch {BATCH}, vocab {VOCAB}, fp32, AdamW + clipping); OMP threads: {threads}; "
          f"{a.steps} steps of each, alternating, after {a.warmup} warm-up")
    for name, ms in (("C++", cpp_ms), ("Python", py_ms)):
        print(f"  {name:<7} ms/step: median {statistics.median(ms):9.2f}   best {min(ms):9.2f}   "
              f"mean {statistics.mean(ms):9.2f}")
    print(f"  python/c++ time ratio: {sum(py_ms) / sum(cpp_ms):.3f}x of the totals, "
          f"{statistics.median(py_ms) / statistics.median(cpp_ms):.3f}x of the medians, "
          f"{min(py_ms) / min(cpp_ms):.3f}x of the best (goal <= 1.05x)")
    if a.cpp:
        check_against_program(a.cpp, 4, 1)


if __name__ == "__main__":
    main()
