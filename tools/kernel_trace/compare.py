#!/usr/bin/env python3
"""Compares two kernel traces side by side, by kernel category.

Each input is a file written by libtessera_kernel_trace.so: a summary (<prefix>.rankR.summary.txt)
or a Chrome trace (<prefix>.rankR.json). Typical pairs: one GPU against rank 0 of two GPUs,
or Tessera against torch.compile on the same model. Kernels are put in categories by name
(gemm, attention, nccl, layer norm, optimizer, softmax/loss, the rest); the table gives each
category's count and time in both, and B - A. With --steps the times are divided by the
number of training steps each trace holds, so traces of different lengths compare;
`--steps auto` takes each trace's steps from the replays of its most-replayed CUDA graph
(a `tessera train` step is one graph).

    python3 tools/kernel_trace/compare.py one_gpu.rank0.summary.txt two_gpu.rank0.summary.txt \\
        --labels 1gpu 2gpu --steps 20 20 --top 15

Standard library only.
"""
import argparse
import collections
import decimal
import json
import re
import sys

# First matching category wins, so attention kernels built on CUTLASS are attention, not gemm.
CATEGORIES = [
    ("nccl", ("nccl",)),
    ("attention/flash", ("flash", "attention", "attn", "fmha", "sdpa", "mha_")),
    # triton_tem_: torch.compile's matmul templates (its attention templates matched above).
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "xmma", "matmul", "gemv", "wgmma", "triton_tem_")),
    ("layer_norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm")),
    ("adamw/multi_tensor", ("adam", "multi_tensor", "optimizer")),
    ("softmax/cross_entropy/classifier",
     ("softmax", "cross_entropy", "crossentropy", "nll_loss", "classifier", "logsumexp")),
]
OTHER = "elementwise/other"
CATEGORY_NAMES = [name for name, _ in CATEGORIES] + [OTHER]


def category(kernel_name):
    lower = kernel_name.lower()
    for name, patterns in CATEGORIES:
        if any(pattern in lower for pattern in patterns):
            return name
    return OTHER


class TraceStats:
    """Per-kernel count and total time (µs) of one trace, and its whole-trace figures (ms)."""

    def __init__(self, path):
        self.path = path
        self.kernels = {}  # name -> [count, total_us]
        self.figures = {}  # "busy", "span", "overlap", "exposed communication", "host waits": ms
        self.graph_replays = None  # replays of the most-replayed CUDA graph, when any


def read_summary(path, text):
    stats = TraceStats(path)
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("kernels by total time")),
                 None)
    if start is None or start + 1 >= len(lines) or "total_us" not in lines[start + 1]:
        raise ValueError(f"{path}: no 'kernels by total time' table (is it a kernel trace summary?)")
    for number, line in enumerate(lines[start + 2:], start + 3):
        if not line.strip():
            break
        fields = line.split(None, 4)
        try:
            count, total_us = int(fields[0]), float(fields[1])
            name = fields[4]
        except (IndexError, ValueError):
            raise ValueError(f"{path}:{number}: not a kernel row: {line!r}") from None
        entry = stats.kernels.setdefault(name, [0, 0.0])
        entry[0] += count
        entry[1] += total_us
    patterns = {
        "span": r"^span of kernels \(first start to last end\): ([0-9.]+) ms",
        "busy": r"^device \d+: busy ([0-9.]+) ms",
        "overlap": r"two or more kernels at once ([0-9.]+) ms",
        "exposed communication": r"exposed communication ([0-9.]+) ms",
        "host waits": r"^host waits in CUDA synchronisation: ([0-9.]+) ms",
    }
    for figure, pattern in patterns.items():
        values = [float(v) for v in re.findall(pattern, text, re.MULTILINE)]
        if values:
            stats.figures[figure] = max(values) if figure == "span" else sum(values)
    replays = re.findall(r"^  graph \d+: \d+ kernel records of \d+ nodes, ([0-9.]+) replays$",
                         text, re.MULTILINE)
    if replays:
        stats.graph_replays = max(float(r) for r in replays)
    return stats


def covered(intervals, min_depth=1):
    """Length covered by at least min_depth of the [start, end) intervals."""
    changes = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    total, depth, previous = 0, 0, None
    for time, delta in changes:
        if previous is not None and depth >= min_depth:
            total += time - previous
        previous, depth = time, depth + delta
    return total


def read_chrome_trace(path, text):
    try:
        # Decimal: absolute timestamps in µs keep their nanoseconds.
        trace = json.loads(text, parse_float=decimal.Decimal)
        events = trace["traceEvents"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a Chrome trace with traceEvents ({error})") from None
    stats = TraceStats(path)
    by_device = collections.defaultdict(list)
    communication = collections.defaultdict(list)
    compute = collections.defaultdict(list)
    graphs = collections.defaultdict(lambda: [0, set()])  # graph id -> [records, node ids]
    host_waits = 0
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "sync":
            host_waits += event["dur"]
        if event.get("ph") != "X" or event.get("cat", "kernel") != "kernel":
            continue
        start, duration = event["ts"], event["dur"]
        entry = stats.kernels.setdefault(event["name"], [0, 0.0])
        entry[0] += 1
        entry[1] += float(duration)
        interval = (start, start + duration)
        by_device[event.get("pid", 0)].append(interval)
        is_nccl = "nccl" in event["name"].lower()
        (communication if is_nccl else compute)[event.get("pid", 0)].append(interval)
        args = event.get("args", {})
        if args.get("graph_id"):
            graph = graphs[(event.get("pid", 0), args["graph_id"])]
            graph[0] += 1
            graph[1].add(args.get("graph_node_id", 0))
    if host_waits:
        stats.figures["host waits"] = float(host_waits) / 1000
    if graphs:
        stats.graph_replays = max(records / len(nodes) for records, nodes in graphs.values())
    if by_device:
        starts = [s for intervals in by_device.values() for s, _ in intervals]
        ends = [e for intervals in by_device.values() for _, e in intervals]
        stats.figures["span"] = float(max(ends) - min(starts)) / 1000
        stats.figures["busy"] = sum(float(covered(v)) for v in by_device.values()) / 1000
        stats.figures["overlap"] = sum(float(covered(v, 2)) for v in by_device.values()) / 1000
        exposed = 0
        for device, intervals in communication.items():
            # Communication not overlapped = all busy time minus compute's busy time.
            exposed += covered(intervals + compute[device]) - covered(compute[device])
        stats.figures["exposed communication"] = float(exposed) / 1000
    return stats


def read_stats(path):
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    if text.lstrip().startswith("{"):
        return read_chrome_trace(path, text)
    return read_summary(path, text)


def by_category(stats):
    totals = {name: [0, 0.0] for name in CATEGORY_NAMES}
    for kernel, (count, total_us) in stats.kernels.items():
        entry = totals[category(kernel)]
        entry[0] += count
        entry[1] += total_us
    return totals


def format_tables(a, b, labels, steps, top):
    unit, (steps_a, steps_b) = ("ms/step", steps) if steps else ("ms", (1, 1))
    ms_a = lambda us: us / 1000 / steps_a  # noqa: E731
    ms_b = lambda us: us / 1000 / steps_b  # noqa: E731
    cat_a, cat_b = by_category(a), by_category(b)
    total_a = sum(v[1] for v in cat_a.values())
    total_b = sum(v[1] for v in cat_b.values())
    width = 34
    out = [f"A = {labels[0]}: {a.path}", f"B = {labels[1]}: {b.path}"]
    if steps:
        out.append(f"steps: A {steps_a:g}, B {steps_b:g}")
    out.append("")
    head = f"{'category':<{width}} {'A count':>9} {'A ' + unit:>11} {'A %':>6} " \
           f"{'B count':>9} {'B ' + unit:>11} {'B %':>6} {'B - A':>10} {'B / A':>7}"
    out += [head, "-" * len(head)]

    def row(name, count_a, us_a, count_b, us_b):
        pct_a = 100 * us_a / total_a if total_a else 0.0
        pct_b = 100 * us_b / total_b if total_b else 0.0
        ratio = f"{ms_b(us_b) / ms_a(us_a):7.2f}" if us_a > 0 else f"{'-':>7}"
        return (f"{name:<{width}} {count_a:>9} {ms_a(us_a):>11.3f} {pct_a:>5.1f}% "
                f"{count_b:>9} {ms_b(us_b):>11.3f} {pct_b:>5.1f}% "
                f"{ms_b(us_b) - ms_a(us_a):>+10.3f} {ratio}")

    for name in CATEGORY_NAMES:
        (count_a, us_a), (count_b, us_b) = cat_a[name], cat_b[name]
        if count_a or count_b:
            out.append(row(name, count_a, us_a, count_b, us_b))
    out.append("-" * len(head))
    out.append(row("total kernel time", sum(v[0] for v in cat_a.values()), total_a,
                   sum(v[0] for v in cat_b.values()), total_b))

    figures = {"span": "span (first to last kernel)", "busy": "busy (kernels' union)",
               "overlap": "two or more kernels at once",
               "exposed communication": "exposed communication",
               "host waits": "host blocked in CUDA syncs"}
    if any(f in a.figures or f in b.figures for f in figures):
        out += ["", f"{'whole trace (' + unit + ')':<{width}} {'A':>11} {'B':>11} {'B - A':>10}"]
        for figure, label in figures.items():
            if figure in a.figures and figure in b.figures:
                va, vb = a.figures[figure] / steps_a, b.figures[figure] / steps_b
                out.append(f"{label:<{width}} {va:>11.3f} {vb:>11.3f} {vb - va:>+10.3f}")
    if top:
        names = sorted(set(a.kernels) | set(b.kernels),
                       key=lambda n: -max(ms_a(a.kernels.get(n, [0, 0.0])[1]),
                                          ms_b(b.kernels.get(n, [0, 0.0])[1])))
        out += ["", f"top {top} kernels ({unit}):",
                f"{'A':>11} {'B':>11} {'B - A':>10}  {'category':<20} kernel"]
        for name in names[:top]:
            us_a, us_b = a.kernels.get(name, [0, 0.0])[1], b.kernels.get(name, [0, 0.0])[1]
            out.append(f"{ms_a(us_a):>11.3f} {ms_b(us_b):>11.3f} {ms_b(us_b) - ms_a(us_a):>+10.3f}  "
                       f"{category(name):<20} {name}")
    return "\n".join(out)


def steps_of(values, a, b):
    """(A steps, B steps) from --steps, or None when times are not to be divided."""
    if not values:
        return None
    if values == ["auto"]:
        for stats in (a, b):
            if not stats.graph_replays:
                raise ValueError(f"{stats.path}: no CUDA graph replays to count steps by; "
                                 "give --steps A_STEPS B_STEPS")
        return a.graph_replays, b.graph_replays
    try:
        steps = tuple(float(v) for v in values)
    except ValueError:
        steps = ()
    if len(steps) != 2 or min(steps) <= 0:
        raise ValueError(f"--steps takes two positive numbers or 'auto', got {' '.join(values)}")
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="first summary (.summary.txt) or trace (.json)")
    parser.add_argument("b", help="second summary or trace")
    parser.add_argument("--labels", nargs=2, default=["A", "B"], metavar=("A", "B"))
    parser.add_argument("--steps", nargs="+", metavar="STEPS",
                        help="training steps in each trace (A_STEPS B_STEPS, or auto: the "
                             "replays of each trace's most-replayed CUDA graph); times per step")
    parser.add_argument("--top", type=int, default=0, help="also list the N largest kernels")
    args = parser.parse_args(argv)
    try:
        a, b = read_stats(args.a), read_stats(args.b)
        steps = steps_of(args.steps, a, b)
    except ValueError as error:
        print(f"compare.py: {error}", file=sys.stderr)
        return 2
    print(format_tables(a, b, args.labels, steps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
