#!/usr/bin/env python3
"""Writes the memory tables of the docs from `tessera plan` runs and short real CPU runs.

    scripts/memory_tables.py --tessera BUILD/tessera [--check] [--tables fast|heavy|all|NAME,...]

A table lives in a Markdown file between two marker comments,

    <!-- memory-table: NAME -->
    | ... the table this script writes ... |
    <!-- /memory-table -->

and everything between them is this script's: a figure in it is never typed by hand, so the
docs cannot drift from what `tessera plan` predicts and what the allocator counts. Without
--check the tables of every docs/*.md file are rewritten in place; with --check nothing is
written and the exit status is 1 when a table differs from what the script produces (each one
named, with a diff), 2 when a marker names a table the script does not know or is not closed.

Tables are "fast" (seconds: small GPTs planned and trained on the CPU, 1-3 processes) or
"heavy" (minutes: the dry runs of 6-21 billion parameter models); --tables picks them (default
all). ctest runs `--check --tables fast` as docs.MemoryTables and the heavy ones as
heavy.docs.MemoryTables (label heavy, which scripts/test.sh leaves out).

Measured figures come from `tessera train --steps 2 --memory-report` (the allocator's
per-category counters, MiB to 3 decimals as the report prints them) under `tessera launch`
(TCP between the ranks); planned ones from `tessera plan`'s machine-readable lines. Both are
deterministic: a table that changes means the code's memory changed.
"""
import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = float(1 << 20)
GIB = float(1 << 30)
CATEGORIES = ["parameters", "gradients", "optimizer", "activations", "communication", "other"]
# A marker is a line of its own (one quoted in prose is not).
MARKER = re.compile(r"^<!-- memory-table: ([A-Za-z0-9_.-]+) -->\n(.*?)^<!-- /memory-table -->$",
                    re.S | re.M)


class Runner:
    """Runs tessera (plans, prepares, trains) and remembers each command's output."""

    def __init__(self, tessera, scratch):
        self.tessera = tessera
        self.scratch = Path(scratch)
        self.cache = {}
        self.runs = 0

    def run(self, args, launch=0):
        key = (tuple(args), launch)
        if key in self.cache:
            return self.cache[key]
        command = [self.tessera]
        if launch:
            command += ["launch", "--nproc-per-node", str(launch), self.tessera]
        command += args
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            sys.exit("memory_tables.py: `%s` failed (%d):\n%s%s" %
                     (" ".join(command), done.returncode, done.stdout, done.stderr))
        self.cache[key] = done.stdout
        return done.stdout

    def byte_data(self):
        """A byte-level token file of a small generated corpus (only its vocabulary matters)."""
        data = self.scratch / "data_byte"
        if not (data / "train.bin").exists():
            corpus = self.scratch / "corpus.txt"
            words = ["The cat", "A dog", "sees", "likes", "the moon.", "a book.", "green tea."]
            corpus.write_text(" ".join(words[(i * 5 + i // 7) % len(words)] for i in range(40000)))
            self.run(["prepare", "--input", str(corpus), "--tokenizer", "byte", "--out", str(data)])
        return data / "train.bin"

    def train(self, name, flags, nproc=1):
        """`tessera train --steps 2 --memory-report` (under `tessera launch` for nproc > 1)."""
        out = self.scratch / ("run_%d_%s" % (self.runs, name))
        self.runs += 1
        args = ["train", "--data", str(self.byte_data()), "--steps", "2", "--memory-report",
                "--eval-batches", "1", "--out", str(out)] + flags
        return self.run(args, launch=nproc if nproc > 1 else 0)

    def plan(self, flags):
        return self.run(["plan"] + flags)


def numbers_after(text, label, count):
    at = text.find(label)
    if at < 0:
        sys.exit("memory_tables.py: no '%s' in:\n%s" % (label, text))
    found = re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text[at + len(label):])
    return [float(v) for v in found[:count]]


def report_row(text, label):
    """The 6 categories and the total of a memory report row, in bytes (as printed: MiB)."""
    return [v * MIB for v in numbers_after(text, label + " ", 7)]


def plan_line(text, name, count=1):
    values = numbers_after(text, "\n" + name + " ", count)
    return values if count > 1 else values[0]


def mib(b):
    return "%.3f" % (b / MIB)


def gib(b):
    return "%.3f" % (b / GIB)


def percent(planned, measured):
    return "%+.2f %%" % (100.0 * (planned - measured) / measured) if measured else "-"


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


STAGE_NAMES = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]

# ---- fast tables: small GPTs on the CPU ----

CPU_SHAPE = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--seq", "64", "--batch", "8"]


def cpu_stage_runs(r, stage):
    measured = r.train("cpu_stage%d" % stage, CPU_SHAPE + ["--zero-stage", str(stage)], nproc=2)
    vocab = int(numbers_after(measured, "vocab ", 1)[0])
    planned = r.plan(["--device", "cpu", "--nproc", "2", "--zero-stage", str(stage), "--vocab",
                      str(vocab)] + CPU_SHAPE)
    return measured, planned


def cpu_phase(r, label, total_line, columns, with_formula):
    """Rank 0's split at a phase's peak in the 4-block GPT's real 2-rank runs (the report's
    `label` rows), its measured and planned totals, and ZeRO's formula when asked."""
    rows = []
    for stage in range(4):
        measured, planned = cpu_stage_runs(r, stage)
        got = report_row(measured, label)
        total = plan_line(planned, total_line)
        row = [STAGE_NAMES[stage]] + [mib(got[c]) for c in columns]
        row += [mib(got[6]), mib(total), percent(total, got[6])]
        if with_formula:
            row.append(mib(report_row(measured, "ZeRO formula")[6]))
        rows.append(row)
    header = ["stage"] + [CATEGORIES[c] for c in columns]
    header += ["measured peak", "`tessera plan`", "plan vs real"]
    return table(header + (["formula P+G+O"] if with_formula else []), rows)


def cpu_stages(r):
    """The steps' peak of the 4-block GPT on 2 ranks, measured and planned, by category."""
    return cpu_phase(r, "rank 0 peak", "step_peak_bytes", [0, 1, 2, 3, 4], True)


def cpu_construction(r):
    """The construction phase (built and prepared; stage 3 by sharded construction)."""
    return cpu_phase(r, "rank 0 construction", "setup_peak_bytes", [0, 1, 2, 5], False)


CHECKPOINT_SHAPE = ["--n-layer", "4", "--n-head", "2", "--n-embd", "64", "--seq", "64", "--batch",
                    "4"]


def checkpointing(r):
    """Activations at the step's peak under each recompute policy (1 process, fp32)."""
    rows = []
    for policy in ["none", "attention", "mlp", "every_k:2", "full"]:
        flag = [] if policy == "none" else ["--gradient-checkpointing", policy]
        measured = r.train("checkpointing_" + policy.replace(":", ""), CHECKPOINT_SHAPE + flag)
        vocab = int(numbers_after(measured, "vocab ", 1)[0])
        planned = r.plan(["--device", "cpu", "--nproc", "1", "--vocab", str(vocab)] +
                         CHECKPOINT_SHAPE + flag)
        got = report_row(measured, "rank 0 peak")[3]
        want = plan_line(planned, "step_peak_bytes_by_category", 6)[3]
        rows.append(["`%s`" % policy, mib(got), mib(want), percent(want, got)])
    return table(["policy", "activations at the step's peak, measured (MiB)",
                  "`tessera plan` (MiB)", "plan vs real"], rows)


# ---- heavy tables: billions of parameters, planned ----

def big_plan(r, shape, stage, extra=()):
    return r.plan(["--device", "cuda", "--dtype", "bf16", "--vocab", "50304", "--batch", "1",
                   "--zero-stage", str(stage)] + shape + list(extra))


GPT_13B = ["--nproc", "8", "--n-layer", "40", "--n-head", "40", "--n-embd", "5120", "--seq", "2048"]
GPT_6B = ["--nproc", "2", "--n-layer", "48", "--n-head", "25", "--n-embd", "3200", "--seq", "1024"]


def term(text, name):
    """A line of the plan's "terms of the peak" (GiB)."""
    return numbers_after(text, "\n  " + name + " ", 1)[0]


def gradient_lifetime(r):
    """The 12.9B GPT on 8 ranks and the 6.06B GPT on 2, bf16, batch 1: each stage's peak."""
    columns = [[big_plan(r, shape, s) for s in range(4)] for shape in (GPT_13B, GPT_6B)]

    def cell(stage, plans):
        text = plans[stage]
        peak = plan_line(text, "peak_bytes")
        setup, step = plan_line(text, "setup_peak_bytes"), plan_line(text, "step_peak_bytes")
        note = ""
        if stage == 2:
            grads = plan_line(text, "step_peak_bytes_by_category", 6)[1]
            shard = plan_line(text, "shard_gradient_bytes")
            note = " (gradients %s: shard %s + %s in flight)" % (gib(grads), gib(shard),
                                                                 gib(grads - shard))
        if setup > step:
            return "%s construction, %s steps" % (gib(setup), gib(step))
        return gib(peak) + note

    rows = [[STAGE_NAMES[s]] + [cell(s, plans) for plans in columns] for s in range(4)]
    rows.append(["ZeRO-3 construction / steps' peak"] +
                ["%s / %s" % (gib(plan_line(p[3], "setup_peak_bytes")),
                              gib(plan_line(p[3], "step_peak_bytes"))) for p in columns])
    rows.append(["ZeRO-3 formula 16Ψ/W"] +
                [re.search(r"ZeRO's formula 16Ψ/W = ([\d.]+)", p[3]).group(1) for p in columns])
    rows.append(["ZeRO-3 activations / gathered / in flight"] +
                ["%.3f / %.3f / %.3f" % (term(p[3], "activations"), term(p[3], "gathered / reducing"),
                                         term(p[3], "buckets in flight")) for p in columns])
    rows.append(["ZeRO-3 steps' peak / (formula + activations + two units + in flight)"] +
                ["%.3f" % numbers_after(p[3], "steps' peak / that = ", 1)[0] for p in columns])
    return table(["GiB per rank", "12.9B, W = 8", "6.06B, W = 2"], rows)


# The peaks the allocator counted on 2 H100s (benchmarks/cuda/NOTES.md: bf16, gradients
# averaged in f32, 8 x 1024 rows per GPU; 124M on 2026-11-27, 350M on 2026-11-26, when DDP's
# tied embedding still had a gradient buffer of its own), GiB: measured, not planned. Stages 2
# and 3 then kept the averaged gradient shard between steps, through the forward.
H100_PEAKS = {"124M": [5.376, 4.057, 4.405, 4.468], "350M": [13.534, 9.568, 10.559, 10.421]}
GPT2_SHAPES = {"124M": ["--n-layer", "12", "--n-head", "12", "--n-embd", "768"],
               "350M": ["--n-layer", "24", "--n-head", "16", "--n-embd", "1024"]}


def gpu_route(r):
    """GPT-2 124M and 350M on the GPU's routes, 2 ranks, next to the H100 measurements."""
    rows = []
    for model, shape in GPT2_SHAPES.items():
        for stage in range(4):
            text = r.plan(["--device", "cuda", "--dtype", "bf16", "--reduce-dtype", "fp32",
                           "--nproc", "2", "--zero-stage", str(stage), "--vocab", "50257",
                           "--seq", "1024", "--batch", "8"] + shape)
            formula = float(re.search(r"ZeRO's formula [^=]*= ([\d.]+)", text).group(1))
            rows.append([model, STAGE_NAMES[stage], gib(plan_line(text, "peak_bytes")),
                         "%.3f" % H100_PEAKS[model][stage], "%.3f" % formula,
                         "%.3f" % term(text, "activations")])
    return table(["model", "stage", "`tessera plan` GiB / rank", "measured on 2 H100s",
                  "formula P+G+O", "activations"], rows, ["---", "---"] + ["---:"] * 4)


def terms_13b(r):
    """The terms of the 12.9B GPT's ZeRO-3 peak on 8 ranks, as `tessera plan` prints them."""
    text = big_plan(r, GPT_13B, 3)
    start = text.index("terms of the peak per rank")
    end = text.index("\npeak ", start)
    return "```\n" + text[start:end + 1] + "```\n"


# What the 6.06B runs on 2 H100s did (benchmarks/cuda/NOTES.md): measured, not planned.
H100_OUTCOMES = {
    "DDP": "out of memory at once",
    "ZeRO-3": "out of memory in the first step, before the gradient's lifetime was bounded "
              "and construction sharded; not measured since",
    "ZeRO-3 + offload optimizer": "trained",
}


def all_strategies(r):
    """`tessera plan --all-strategies` for the 6.06B GPT on 2 GPUs, f32 reduce as those runs."""
    text = r.plan(["--all-strategies", "--device", "cuda", "--dtype", "bf16", "--reduce-dtype",
                   "fp32", "--vocab", "50304", "--batch", "1", "--max-memory", "80GiB"] + GPT_6B)
    rows = []
    for line in text.splitlines():
        m = re.match(r"(DDP|ZeRO-[123](?: \+ offload \w+)?)\s+([\d.]+)\s+([\d.]+)\s+(.*)$", line)
        if m:
            verdict = m.group(4).replace(" a 80 GiB card", "").replace(" GiB", "")
            rows.append([m.group(1), m.group(2), m.group(3), verdict,
                         H100_OUTCOMES.get(m.group(1), "—")])
    return table(["strategy", "predicted peak GiB / rank", "host GiB / rank", "verdict at 80 GiB",
                  "measured on 2 H100s"], rows, ["---", "---:", "---:", "---", "---"])


def fit(r):
    """`tessera plan --fit`: the deepest 5120-channel GPT per strategy, 8 ranks, 80 GiB."""
    text = r.plan(["--fit", "--device", "cuda", "--dtype", "bf16", "--vocab", "50304", "--batch",
                   "1", "--nproc", "8", "--n-head", "40", "--n-embd", "5120", "--seq", "2048",
                   "--max-memory", "80GiB"])
    rows = []
    for line in text.splitlines():
        m = re.match(r"(DDP|ZeRO-[123](?: \+ offload \w+)?)\s+(\d+|none)\s+(\d+|-)\s+([\d.]+)\s+(\S+)$",
                     line)
        if m:
            params = "%.2f B" % (int(m.group(3)) / 1e9) if m.group(3) != "-" else "-"
            rows.append([m.group(1), m.group(2), params, m.group(4),
                         "—" if m.group(5) == "-" else m.group(5)])
    return table(["strategy", "blocks", "parameters", "planned peak GiB / rank",
                  "DeepSpeed's estimator GiB / GPU"], rows)


TABLES = {
    "cpu-stages": ("fast", cpu_stages),
    "cpu-construction": ("fast", cpu_construction),
    "checkpointing-policies": ("fast", checkpointing),
    "gpu-route-gpt2": ("heavy", gpu_route),
    "terms-13b": ("heavy", terms_13b),
    "gradient-lifetime": ("heavy", gradient_lifetime),
    "all-strategies-6b": ("heavy", all_strategies),
    "fit-5120": ("heavy", fit),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tessera", required=True, help="the tessera program to run")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each table that differs")
    parser.add_argument("--tables", default="all",
                        help="fast, heavy, all, or table names separated by commas")
    parser.add_argument("--docs", default=str(ROOT / "docs"), help="folder of the Markdown files")
    a = parser.parse_args()
    if a.tables in ("fast", "heavy"):
        wanted = {n for n, (kind, _) in TABLES.items() if kind == a.tables}
    elif a.tables == "all":
        wanted = set(TABLES)
    else:
        wanted = set(a.tables.split(","))
        unknown = wanted - set(TABLES)
        if unknown:
            sys.exit("memory_tables.py: --tables names no table %s (there are: %s)" %
                     (", ".join(sorted(unknown)), ", ".join(TABLES)))
    if not os.access(a.tessera, os.X_OK):
        sys.exit("memory_tables.py: --tessera '%s' is not an executable program" % a.tessera)

    differ, found = [], set()
    with tempfile.TemporaryDirectory(prefix="memory_tables_") as scratch:
        runner = Runner(os.path.abspath(a.tessera), scratch)
        for doc in sorted(Path(a.docs).glob("*.md")):
            text = doc.read_text()
            opened = len(re.findall(r"^<!-- memory-table:", text, re.M))
            if opened != len(MARKER.findall(text)):
                print("memory_tables.py: %s: a memory-table marker is not closed by "
                      "<!-- /memory-table -->" % doc, file=sys.stderr)
                return 2
            for name, _ in MARKER.findall(text):
                if name not in TABLES:
                    print("memory_tables.py: %s names table '%s', which this script does not "
                          "make (it makes: %s)" % (doc, name, ", ".join(TABLES)), file=sys.stderr)
                    return 2

            for name, old in MARKER.findall(text):
                if name not in wanted:
                    continue
                found.add(name)
                new = TABLES[name][1](runner)
                if new == old:
                    continue
                differ.append(name)
                if a.check:
                    sys.stdout.writelines(difflib.unified_diff(
                        old.splitlines(True), new.splitlines(True),
                        "%s (%s, in the file)" % (doc.name, name),
                        "%s (%s, produced now)" % (doc.name, name)))
                    continue
                # Written at once (a heavy table takes minutes), into the file as it is now.
                now = doc.read_text()
                block = re.compile(r"^(<!-- memory-table: %s -->\n).*?^(<!-- /memory-table -->)$" %
                                   re.escape(name), re.S | re.M)
                doc.write_text(block.sub(lambda m: m.group(1) + new + m.group(2), now, count=1))
    missing = wanted - found
    if missing and a.tables not in ("fast", "heavy", "all"):
        print("memory_tables.py: no doc holds table(s) %s" % ", ".join(sorted(missing)),
              file=sys.stderr)
        return 2
    if differ:
        verb = "differ from what the script produces" if a.check else "rewritten"
        print("memory_tables.py: %s: %s" % (verb, ", ".join(differ)),
              file=sys.stderr if a.check else sys.stdout)
        return 1 if a.check else 0
    print("memory_tables.py: %d table(s) as produced (%s)" % (len(found), ", ".join(sorted(found))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
