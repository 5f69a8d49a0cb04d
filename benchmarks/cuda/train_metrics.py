"""Helpers of the multi-GPU benchmarks (standard library only: no network, no numpy).

  train_metrics.py tokens OUT.bin --count N [--vocab V] [--seed S]
      writes N random tokens below V in llm.c's token-file layout (256 int32 header words:
      20240520, version, count; then uint16 tokens for V <= 65536, version 1, else uint32,
      version 2), atomically (temporary file, then rename).
  train_metrics.py rate RUN/metrics.jsonl --world W [--skip K]
      the throughput of a `tessera train` run from its metrics.jsonl, after the first K logged
      steps (warm-up): tokens/s per GPU from the wall clock between the record of step K and
      the last one (every cost of the loop counted) and from the steps' own "ms" (the
      training step alone). Prints one JSON line:
      {"steps", "tokens_per_s_per_gpu", "step_tokens_per_s_per_gpu", "ms_per_step"}.
"""
import argparse
import array
import json
import os
import random
import sys

MAGIC = 20240520


def write_tokens(path, count, vocab, seed):
    if count <= 0 or vocab <= 1:
        sys.exit(f"train_metrics.py tokens: --count must be > 0 and --vocab > 1 (got {count}, {vocab})")
    version, code = (1, "H") if vocab <= 65536 else (2, "I")
    header = array.array("i", [0] * 256)
    header[0], header[1], header[2] = MAGIC, version, count
    rng = random.Random(seed)
    # getrandbits per token is slow in Python; draw 32-bit words and keep the low bits of
    # each in range (vocab is not a power of two, so reduce with a multiply-shift).
    tokens = array.array(code, ((rng.getrandbits(32) * vocab) >> 32 for _ in range(count)))
    if sys.byteorder != "little":
        header.byteswap()
        tokens.byteswap()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        header.tofile(f)
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_steps(path):
    steps = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"train_metrics.py rate: {path}:{number}: not JSON ({e})")
            # Train-step records carry "ms"; evaluations do not.
            if isinstance(record, dict) and "ms" in record and "time" in record:
                steps[int(record["step"])] = record
    return steps


def rate(path, world, skip):
    steps = read_steps(path)
    if not steps:
        sys.exit(f"train_metrics.py rate: {path} holds no train-step records")
    first, last = min(steps), max(steps)
    start = skip if skip in steps else first
    timed = [s for s in sorted(steps) if s > start]
    if not timed:
        sys.exit(f"train_metrics.py rate: {path}: no step after the {skip} warm-up steps "
                 f"(steps {first}..{last})")
    # tokens_per_s = tokens of one optimizer step (all ranks) / the step's seconds.
    tokens_per_step = steps[timed[-1]]["tokens_per_s"] * steps[timed[-1]]["ms"] / 1e3
    wall = steps[last]["time"] - steps[start]["time"]
    ms = sum(steps[s]["ms"] for s in timed) / len(timed)
    n = last - start  # logged or not, every step between the two records ran
    print(json.dumps({
        "steps": n,
        "tokens_per_s_per_gpu": tokens_per_step * n / wall / world if wall > 0 else None,
        "step_tokens_per_s_per_gpu": tokens_per_step / (ms / 1e3) / world,
        "ms_per_step": ms,
    }))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("out")
    t.add_argument("--count", type=int, required=True)
    t.add_argument("--vocab", type=int, default=50257)
    t.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("rate")
    r.add_argument("metrics")
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--skip", type=int, default=5)
    args = ap.parse_args()
    if args.command == "tokens":
        write_tokens(args.out, args.count, args.vocab, args.seed)
    else:
        if args.world < 1:
            sys.exit("train_metrics.py rate: --world must be >= 1")
        rate(args.metrics, args.world, args.skip)


if __name__ == "__main__":
    main()
