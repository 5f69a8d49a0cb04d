#!/usr/bin/env python3
"""Where a traced GPU sat idle, and between what.

Reads a Chrome trace written by libtessera_kernel_trace.so (<prefix>.rankR.json). On each
device the kernels, memsets and memcpys are merged into busy stretches; every idle stretch
between two of them is put down to the pair (the activity that ended the busy stretch, the
activity that started the next one), and the pairs are listed by their idle time. A memset
or memcpy is named "memset" / "memcpy <kind>" with its bytes, since a copy-engine node
inside a CUDA graph shows up as idle time on both of its sides.

    python3 tools/kernel_trace/gaps.py /tmp/kt.rank0.json --steps auto --top 20

--steps divides by the number of training steps in the window (auto: the replays of its
most-replayed CUDA graph, as compare.py counts them). Standard library only.
"""
import argparse
import collections
import decimal
import json
import sys


def activity_name(event):
    if event.get("cat") == "memory":
        nbytes = event.get("args", {}).get("bytes")
        return f"{event['name']} {nbytes} B" if nbytes is not None else event["name"]
    return event["name"]


def read_activities(path):
    """{device: [(start, end, name), ...]} and the graph replays of the trace (or None)."""
    try:
        with open(path, encoding="utf-8") as handle:
            trace = json.load(handle, parse_float=decimal.Decimal)
        events = trace["traceEvents"]
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a Chrome trace with traceEvents ({error})") from None
    devices = collections.defaultdict(list)
    graphs = collections.defaultdict(lambda: [0, set()])  # (device, graph) -> [records, nodes]
    for event in events:
        if event.get("ph") != "X" or event.get("cat", "kernel") not in ("kernel", "memory"):
            continue
        start = event["ts"]
        device = event.get("pid", 0)
        devices[device].append((start, start + event["dur"], activity_name(event)))
        args = event.get("args", {})
        if event.get("cat", "kernel") == "kernel" and args.get("graph_id"):
            graph = graphs[(device, args["graph_id"])]
            graph[0] += 1
            graph[1].add(args.get("graph_node_id", 0))
    replays = max((records / len(nodes) for records, nodes in graphs.values()), default=None)
    return devices, replays


def idle_by_pair(activities):
    """(span, idle, {(before, after): [count, idle]}) of one device's activities (µs)."""
    activities = sorted(activities)
    pairs = collections.defaultdict(lambda: [0, 0])
    idle = 0
    end, last = None, None
    for start, finish, name in activities:
        if end is not None and start > end:
            gap = start - end
            idle += gap
            entry = pairs[(last, name)]
            entry[0] += 1
            entry[1] += gap
        if end is None or finish > end:
            end, last = finish, name
    span = end - activities[0][0] if activities else 0
    return span, idle, pairs


def format_report(devices, steps, top):
    per = f" per step ({float(steps):.1f} steps)" if steps else ""
    divide = float(steps) if steps else 1.0
    lines = []
    for device in sorted(devices):
        span, idle, pairs = idle_by_pair(devices[device])
        lines.append(f"device {device}: span {float(span) / 1000 / divide:.3f} ms, idle "
                     f"{float(idle) / 1000 / divide:.3f} ms{per}")
        lines.append(f"  {'idle ms':>9} {'gaps':>7} {'mean us':>8}  before -> after")
        ranked = sorted(pairs.items(), key=lambda item: (-item[1][1], item[0]))
        for (before, after), (count, gap) in ranked[:top]:
            lines.append(f"  {float(gap) / 1000 / divide:9.3f} {count / divide:7.1f} "
                         f"{float(gap) / count:8.2f}  {before} -> {after}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a Chrome trace (.json) of the kernel tracer")
    parser.add_argument("--steps", help="training steps in the trace (a number, or auto)")
    parser.add_argument("--top", type=int, default=15, help="pairs listed per device")
    args = parser.parse_args(argv)
    try:
        devices, replays = read_activities(args.trace)
        steps = None
        if args.steps == "auto":
            if not replays:
                raise ValueError(f"{args.trace}: no CUDA graph replays to count steps by; "
                                 "give --steps N")
            steps = replays
        elif args.steps is not None:
            try:
                steps = float(args.steps)
            except ValueError:
                steps = 0
            if steps <= 0:
                raise ValueError(f"--steps takes a positive number or 'auto', got {args.steps}")
    except ValueError as error:
        print(f"gaps.py: {error}", file=sys.stderr)
        return 2
    print(format_report(devices, steps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
