"""Overhead of Python: the CPU GPT training step of bench_cpu_gpt_train (4 layers, 4 heads, 128
channels, context 128, batch 32, vocab 65, fp32, AdamW + clipping, the same seeds) driven from
Python through `import tessera`, against the same loop in C++ (bench_cpu_gpt_train --no-torch),
alternating rounds in one invocation on the same cores. Prints ms/step of each and the ratio
(goal: Python <= 1.05x C++).

    PYTHONPATH=build/python python3 benchmarks/python_overhead.py [--cpp build/bench_cpu_gpt_train]
                                                                  [--steps 10] [--warmup 3] [--rounds 3]
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


class PythonLoop:
    """The loop of bench_cpu_gpt_train, line for line, with the same generator draws."""

    def __init__(self):
        gen = tessera.Generator(0)
        self.model = nn.GPT(nn.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=HEADS,
                                         n_embd=CHANNELS), generator=gen)
        self.opt = optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        self.idx = tessera.randint(0, VOCAB, [BATCH, SEQ], generator=gen)
        self.targets = tessera.randint(0, VOCAB, [BATCH, SEQ], generator=gen)
        self.params = self.model.parameters()
        self.last_loss = None

    def step(self):
        self.opt.zero_grad()
        loss = self.model.loss(self.idx, self.targets)
        loss.backward()
        optim.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.last_loss = loss.item()

    def time(self, steps, warmup):
        for _ in range(warmup):
            self.step()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) * 1000 / steps


def cpp_round(program, steps, warmup):
    out = subprocess.run([program, "--no-torch", "--steps", str(steps), "--warmup", str(warmup)],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\s*tessera\s+([0-9.]+)\s+[0-9]+\s+\(loss ([0-9.]+)\)", out, re.M)
    if not m:
        raise SystemExit("python_overhead: unexpected output of " + program + ":\n" + out)
    return float(m.group(1)), float(m.group(2))


def main():
    p = argparse.ArgumentParser()
    default_cpp = os.path.join(os.environ.get("BUILD_DIR", "build"), "benchmarks", "bench_cpu_gpt_train")
    p.add_argument("--cpp", default=default_cpp, help="the bench_cpu_gpt_train program")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if not os.path.exists(a.cpp):
        raise SystemExit(f"python_overhead: {a.cpp} not found (build the bench_cpu_gpt_train target, or pass --cpp)")

    # Same first round on both sides: fresh model, warm-up + steps from the same seeds, so the
    # final losses must agree (the Python side is the same computation, only driven from Python).
    cpp_ms, py_ms = [], []
    cpp_loss = py_loss = None
    for r in range(a.rounds):
        ms, loss = cpp_round(a.cpp, a.steps, a.warmup)
        cpp_ms.append(ms)
        loop = PythonLoop()
        py_ms.append(loop.time(a.steps, a.warmup))
        if r == 0:
            cpp_loss, py_loss = loss, loop.last_loss
    threads = os.environ.get("OMP_NUM_THREADS", "all cores")
    print(f"CPU GPT training step ({LAYERS} layers, {HEADS} heads, {CHANNELS} channels, context {SEQ}, "
          f"batch {BATCH}, vocab {VOCAB}, fp32, AdamW); OMP threads: {threads}; {a.rounds} rounds of "
          f"{a.steps} steps after {a.warmup} warm-up, alternating")
    print(f"  C++    ms/step: {' '.join(f'{v:.2f}' for v in cpp_ms)}  median {statistics.median(cpp_ms):.2f}"
          f"  (loss {cpp_loss:.4f})")
    print(f"  Python ms/step: {' '.join(f'{v:.2f}' for v in py_ms)}  median {statistics.median(py_ms):.2f}"
          f"  (loss {py_loss:.4f})")
    print(f"  python/c++ time ratio: {statistics.median(py_ms) / statistics.median(cpp_ms):.3f}x "
          f"(goal <= 1.05x)")


if __name__ == "__main__":
    main()
