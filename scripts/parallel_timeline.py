#!/usr/bin/env python3
"""Draws, as text, the timelines of one pipeline-parallel step and one tensor-parallel step
taken from real runs (docs/mesh.md shows their output).

  scripts/parallel_timeline.py --build build-cpu [--pp 4] [--micro-batches 8] [--tp 2]

- Pipeline: `tessera launch` runs tests/dist/dist_pp_check --bubble --timeline (GPT-2, 2
  blocks per stage, d = 128, 1F1B) on --pp ranks; each stage prints the ops of its last step in the
  order it ran them, with their wall-clock times and CPU times. The chart places that order
  on a clock where each op lasts its CPU time and starts once its stage is free and its input
  has arrived (a forward: the previous stage's forward of the micro-batch; a backward: the
  next stage's backward of it): the replay behind PipelineParallelCausalLM::bubble's
  "replayed" figure (dist/pipeline_parallel.h, replay_pipeline), which rank 0 prints; the run's
  own order and work, with a processor per stage. The wall-clock rows follow (on a machine with fewer cores than ranks they show
  the ranks waiting for the cores as much as for each other).
- Tensor parallelism: dist_tp_check --timeline on --tp ranks (GPT-2, 2 blocks); each rank
  prints the collectives of its last step (all-reduces of the f and g functions) with their
  start and end; the time between them is compute.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(build, nproc, program, args):
    cmd = [str(build / "tessera"), "launch", "--nproc-per-node", str(nproc),
           str(build / "tests" / "dist" / program)] + args
    out = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1",
                                                                   "PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        sys.exit("parallel_timeline: %s failed:\n%s%s" % (" ".join(cmd), out.stdout, out.stderr))
    return out.stdout + out.stderr


def draw(rows, span, width=100, label="stage"):
    """rows: [[(text, start, end)]] -> lines of a text chart `width` columns wide."""
    scale = width / span
    lines = []
    for r, ops in enumerate(rows):
        line = [" "] * width
        for text, start, end in ops:
            a, b = int(start * scale), max(int(start * scale) + 1, int(end * scale))
            for i in range(a, min(b, width)):
                line[i] = "-"
            for i, ch in enumerate(text[: max(1, b - a)]):
                if a + i < width:
                    line[a + i] = ch
        lines.append("%s %d |%s|" % (label, r, "".join(line)))
    return lines


def pipeline(build, pp, m):
    text = run(build, pp, "dist_pp_check", ["--bubble", "--timeline", "--schedule", "1f1b",
                                             "--micro-batches", str(m), "--steps", "3",
                                             "--width", "128"])
    replayed, wall, bubble = {}, {}, None
    for line in text.splitlines():
        t = re.search(r"rank (\d+) timeline \(ms\):(.*)", line)
        if t:
            ops = re.findall(r"([FB])(\d+)\[([\d.]+),([\d.]+) cpu ([\d.]+)\]", t.group(2))
            wall[int(t.group(1))] = [(k + i, float(a), float(b)) for k, i, a, b, _ in ops]
        r = re.search(r"replayed stage (\d+) \(ms\):(.*)", line)
        if r:
            ops = re.findall(r"([FB])(\d+)\[([\d.]+),([\d.]+)\]", r.group(2))
            replayed[int(r.group(1))] = [(k + i, float(a), float(b)) for k, i, a, b in ops]
        b = re.search(r"rank 0: bubble .*", line)
        if b:
            bubble = b.group(0)
    rows = [replayed[s] for s in range(pp)]
    span = max(b for ops in rows for _, _, b in ops)
    print("1F1B, %d stages, %d micro-batches: each op for its CPU time (ms), in the order the "
          "stages ran them; F = forward, B = backward of micro-batch n" % (pp, m))
    for line in draw(rows, span):
        print(line)
    print("span %.1f ms; %s" % (span, bubble.replace("rank 0: ", "") if bubble else ""))
    wall_span = max(b for ops in wall.values() for _, _, b in ops)
    print("\nThe same step on the wall clock (ms 0-%.1f):" % wall_span)
    for line in draw([wall[s] for s in range(pp)], wall_span):
        print(line)


def tensor(build, tp):
    text = run(build, tp, "dist_tp_check", ["--model", "gpt", "--steps", "3", "--width", "256",
                                             "--tokens", "16", "--f64", "--rtol", "1e-10",
                                             "--timeline"])
    ranks = {}
    for line in text.splitlines():
        t = re.search(r"rank (\d+) tp timeline \(ms\): loss ([\d.]+) backward ([\d.]+)(.*)", line)
        if t:
            ops = re.findall(r"(\w+) (\d+) \[([\d.]+),([\d.]+)\]", t.group(4))
            ranks[int(t.group(1))] = (float(t.group(2)), float(t.group(3)),
                                      [(k, int(n), float(a), float(b)) for k, n, a, b in ops])
    loss, end, ops = ranks[0]
    print("Tensor parallelism, GPT-2 with 2 blocks split over %d ranks, one training step "
          "(float64): rank 0's collectives" % tp)
    print("%4s %-10s %9s %9s %9s  %s" % ("#", "kind", "bytes", "start ms", "end ms", "phase"))
    for i, (k, n, a, b) in enumerate(ops):
        print("%4d %-10s %9d %9.3f %9.3f  %s" % (i, k, n, a, b, "forward" if b <= loss else "backward"))
    print("forward (loss) ends at %.3f ms, backward at %.3f ms; %d all-reduces (4L + 4 = 12)"
          % (loss, end, len(ops)))
    rows = [[("AR", a, b) for _, _, a, b in ranks[r][2]] for r in sorted(ranks)]
    for line in draw(rows, max(v[1] for v in ranks.values()), label="rank"):
        print(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"), help="the build folder")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    a = parser.parse_args()
    build = Path(a.build).resolve()
    pipeline(build, a.pp, a.micro_batches)
    print()
    tensor(build, a.tp)


if __name__ == "__main__":
    main()
