"""Markdown tables of a bench_scaling.sh sitting, from the logs in its output folder (standard
library only). What a run did not produce (it failed, ran out of time or was skipped) shows as
a dash with the reason, so a cut-short sitting still gives every figure it measured.

  scaling_table.py OUT_DIR --gpus N
"""
import argparse
import datetime
import json
import os
import re
import sys

TESSERA_ROWS = [(0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")]
TORCH_ROWS = [("ddp", "DDP (eager)"), ("zero", "DDP + ZeroRedundancyOptimizer"), ("fsdp", "FSDP FULL_SHARD")]
# Tessera's strategy next to PyTorch's counterpart.
COUNTERPARTS = [(0, "ddp", "DDP / DDP"), (1, "zero", "ZeRO-1 / ZeroRedundancyOptimizer"),
                (3, "fsdp", "ZeRO-3 / FSDP FULL_SHARD")]
RANK_PREFIX = re.compile(r"^\[rank \d+\] ")


def read_lines(path):
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return [RANK_PREFIX.sub("", line.rstrip("\n")) for line in f]


def why_missing(lines):
    """A short reason for a run without figures."""
    if lines is None:
        return "not run"
    text = "\n".join(lines)
    if "skipped: no time left" in text:
        return "skipped (time)"
    if "(time limit)" in text:
        return "time limit"
    if "out of memory" in text.lower() or "OutOfMemory" in text:
        return "out of memory"
    return "failed"


def tessera_results(lines):
    """{stage: tokens/s per GPU} from RESULT lines."""
    out = {}
    for line in lines or []:
        if line.startswith("RESULT "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
            out[int(fields["stage"])] = float(fields["tokens_per_s_per_gpu"])
    return out


def torch_results(lines):
    """({strategy: tokens/s per GPU}, {strategy: error}) from the JSON lines."""
    rates, errors = {}, {}
    for line in lines or []:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        strategy = "ddp" if record.get("strategy") == "single" else record.get("strategy")
        if "error" in record:
            errors[strategy] = record["error"]
        elif "tokens_per_s" in record:
            rates[strategy] = record["tokens_per_s"]
    return rates, errors


def fmt(v):
    return f"{v:,.0f}"


def gpt_section(out_dir, model, worlds, tokens):
    tessera, torch, reasons = {}, {}, {}
    for w in worlds:
        lines = read_lines(os.path.join(out_dir, f"gpt_{model}_tessera_w{w}.log"))
        tessera[w] = tessera_results(lines)
        reasons[("tessera", w)] = why_missing(lines)
        lines = read_lines(os.path.join(out_dir, f"gpt_{model}_torch_w{w}.log"))
        torch[w], errors = torch_results(lines)
        reasons[("torch", w)] = why_missing(lines)
        for strategy, error in errors.items():
            reasons[("torch", w, strategy)] = "error: " + error.split(":")[0]
    if not any(tessera.values()) and not any(torch.values()):
        return [f"### GPT-2 {model}: no results ({reasons[('tessera', worlds[0])]})", ""]
    base_t, base_p = tessera.get(1, {}).get(0), torch.get(1, {}).get("ddp")
    header = "| engine | strategy | " + " | ".join(f"{w} GPU{'s' if w > 1 else ''}" for w in worlds) + " |"
    lines = [f"### GPT-2 {model}, bf16, {tokens} tokens per GPU: tokens/s per GPU",
             "(in brackets: scaling efficiency against the same engine's one-GPU DDP run; for ZeRO "
             "rows also the ratio to DDP at the same world size)", "",
             header, "|" + " --- |" * (len(worlds) + 2)]

    def cell(value, base, ddp_same_w, missing):
        if value is None:
            return f"— ({missing})"
        notes = []
        if base and value is not None:
            notes.append(f"{100 * value / base:.1f}%")
        if ddp_same_w:
            notes.append(f"{value / ddp_same_w:.3f}x DDP")
        return fmt(value) + (f" ({'; '.join(notes)})" if notes else "")

    for stage, name in TESSERA_ROWS:
        cells = []
        for w in worlds:
            value = tessera[w].get(stage)
            ddp = tessera[w].get(0) if stage > 0 else None
            missing = reasons[("tessera", w)] if not tessera[w] or w > 1 or stage == 0 else "not run"
            cells.append(cell(value, base_t, ddp, missing))
        lines.append(f"| Tessera | {name} | " + " | ".join(cells) + " |")
    for strategy, name in TORCH_ROWS:
        cells = []
        for w in worlds:
            value = torch[w].get(strategy)
            ddp = torch[w].get("ddp") if strategy != "ddp" else None
            missing = reasons.get(("torch", w, strategy), reasons[("torch", w)])
            if value is None and w == 1 and strategy != "ddp":
                missing = "not run"
            cells.append(cell(value, base_p, ddp, missing))
        lines.append(f"| PyTorch | {name} | " + " | ".join(cells) + " |")
    for stage, strategy, name in COUNTERPARTS:
        cells = []
        for w in worlds:
            a, b = tessera[w].get(stage), torch[w].get(strategy)
            cells.append(f"{a / b:.3f}x" if a and b else "—")
        lines.append(f"| Tessera / PyTorch | {name} | " + " | ".join(cells) + " |")
    lines.append("")
    if 2 in worlds and tessera[2].get(0):
        ddp = tessera[2][0]
        goals = []
        for stage, goal in ((1, 0.98), (2, 0.98), (3, 0.95)):
            v = tessera[2].get(stage)
            goals.append(f"ZeRO-{stage} {v / ddp:.3f}x DDP (goal >= {goal}: {'met' if v / ddp >= goal else 'NOT met'})"
                         if v else f"ZeRO-{stage} —")
        lines += [f"2 GPUs, {model}: " + "; ".join(goals) + ".", ""]
    return lines


def collective_rows(path):
    """{(op, bytes): busbw} from a bandwidth log."""
    rows = {}
    for line in read_lines(path) or []:
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("all_reduce", "reduce_scatter"):
            try:
                rows[(parts[0], int(float(parts[1])))] = float(parts[4])
            except ValueError:
                continue
    return rows


def collectives_section(out_dir, worlds):
    multi = [w for w in worlds if w > 1]
    data = {(engine, w): collective_rows(os.path.join(out_dir, f"coll_{engine}_w{w}.log"))
            for engine in ("tessera", "torch") for w in multi}
    if not any(data.values()):
        ran = any(os.path.exists(os.path.join(out_dir, f"coll_tessera_w{w}.log")) for w in multi)
        return ["### Collectives: no results", ""] if ran else []
    lines = []
    for op, title in (("all_reduce", "all-reduce"), ("reduce_scatter", "reduce-scatter")):
        sizes = sorted({b for rows in data.values() for (o, b) in rows if o == op})
        if not sizes:
            continue
        lines += [f"### {title}, float32: bus bandwidth GB/s (nccl-tests formula), Tessera vs torch.distributed", "",
                  "| bytes | " + " | ".join(f"{w} GPUs Tessera | {w} GPUs PyTorch | ratio" for w in multi) + " |",
                  "|" + " --- |" * (1 + 3 * len(multi))]
        for b in sizes:
            cells = [f"{b:,}"]
            for w in multi:
                t, p = data[("tessera", w)].get((op, b)), data[("torch", w)].get((op, b))
                cells += [f"{t:.1f}" if t is not None else "—", f"{p:.1f}" if p is not None else "—",
                          f"{t / p:.3f}x" if t and p else "—"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


MEMORY = re.compile(r"^MEMORY stage=(\d+) rank=(\d+) MiB: params ([\d.]+) grads ([\d.]+) optimizer ([\d.]+) "
                    r"communication ([\d.]+) \| formula: params ([\d.]+) grads ([\d.]+) optimizer ([\d.]+) "
                    r"\| device allocated ([\d.]+) peak reserved ([\d.]+)")


def memory_section(out_dir, model, n):
    by_stage = {}
    for line in read_lines(os.path.join(out_dir, f"gpt_{model}_tessera_w{n}.log")) or []:
        m = MEMORY.match(line)
        if m:
            by_stage.setdefault(int(m.group(1)), []).append([float(g) for g in m.groups()[2:]])
    if not by_stage:
        return []
    lines = [f"### Memory per rank, GPT-2 {model}, W = {n}: MiB measured, min-max over the ranks where they differ",
             "(in brackets: ZeRO's formula, 2Ψ parameters + 2Ψ gradients + 12Ψ optimizer state, each divided by W "
             "from the stage that shards it; taken after a step's update, before zero_grad)", "",
             "| stage | ranks | parameters | gradients | optimizer | communication | device allocated |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def span(values):
        lo, hi = min(values), max(values)
        return f"{lo:,.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:,.1f}-{hi:,.1f}"

    for stage, rows in sorted(by_stage.items()):
        column = list(zip(*rows))  # p g o c fp fg fo alloc peak
        cells = []
        for measured, formula in ((0, 4), (1, 5), (2, 6)):
            worst = max(column[measured], key=lambda v: abs(v - column[formula][0]))
            diff = f"; {100 * (worst / column[formula][0] - 1):+.1f}%" if column[formula][0] else ""
            cells.append(f"{span(column[measured])} ({column[formula][0]:,.1f}{diff})")
        cells += [span(column[3]), span(column[7])]
        lines.append(f"| {stage} | {len(rows)} | " + " | ".join(cells) + " |")
    return lines + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--models", default="124M,350M")
    ap.add_argument("--tokens", default="16 x 1024", help="tokens per GPU and step, as written in the title")
    args = ap.parse_args()
    worlds = [1] + [w for w in (2, 4, 8, 16) if w <= args.gpus]
    machine_path = os.path.join(args.out_dir, "machine.txt")
    machine = open(machine_path).read().strip() if os.path.exists(machine_path) else f"{args.gpus} GPUs"
    lines = [f"## Scaling: {machine} ({datetime.date.today().isoformat()}, benchmarks/cuda/bench_scaling.sh "
             f"{args.gpus})", ""]
    models = [m for m in args.models.split(",") if m]
    for model in models:
        lines += gpt_section(args.out_dir, model, worlds, args.tokens)
    lines += collectives_section(args.out_dir, worlds)
    for model in models:
        lines += memory_section(args.out_dir, model, args.gpus)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
