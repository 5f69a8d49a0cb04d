#!/usr/bin/env python3
"""Merges the Chrome traces of several ranks into one file for a single Perfetto view.

    python3 tools/kernel_trace/merge.py /tmp/kt.rank0.json /tmp/kt.rank1.json -o /tmp/kt.both.json

The tracer already gives rank R's GPU D the track "pid" 100 * R + D, so ranks stay apart;
files that would collide (traces named by process id, or the same rank twice) are moved to
tracks of their own. Timestamps are CUPTI's, which all processes of one machine share, so
the ranks line up in time; the merged file counts time from its earliest event.
Standard library only.
"""
import argparse
import decimal
import json
import os
import sys


def merge(traces):
    """One trace holding every event of `traces` (JSON parsed with Decimal numbers), pids kept
    apart and times counted from the earliest event, so floats keep their nanoseconds."""
    times = [e["ts"] for trace in traces for e in trace["traceEvents"] if "ts" in e]
    base = min(times) if times else 0
    merged = {"displayTimeUnit": "ms",
              "otherData": {"tool": "tessera_kernel_trace", "merged": [], "base_us": str(base)},
              "kernelNames": {}, "traceEvents": []}
    used = set()
    for trace in traces:
        pids = {event.get("pid", 0) for event in trace["traceEvents"]}
        shift = 0
        while {pid + shift for pid in pids} & used:
            shift += 10000
        used |= {pid + shift for pid in pids}
        merged["otherData"]["merged"].append(trace.get("otherData", {}).get("process", "?"))
        merged["kernelNames"].update(trace.get("kernelNames", {}))
        for event in trace["traceEvents"]:
            event = dict(event)
            event["pid"] = event.get("pid", 0) + shift
            if "ts" in event:
                event["ts"] = float(event["ts"] - base)
            if "dur" in event:
                event["dur"] = float(event["dur"])
            merged["traceEvents"].append(event)
    return merged


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="<prefix>.rankR.json files")
    parser.add_argument("-o", "--output", required=True, help="merged trace to write")
    args = parser.parse_args(argv)
    traces = []
    for path in args.traces:
        try:
            with open(path, encoding="utf-8") as handle:
                trace = json.load(handle, parse_float=decimal.Decimal)
            trace["traceEvents"]  # noqa: B018 (the key must be there)
        except OSError as error:
            print(f"merge.py: cannot read {path}: {error.strerror}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError):
            print(f"merge.py: {path} is not a Chrome trace with traceEvents", file=sys.stderr)
            return 2
        traces.append(trace)
    temporary = f"{args.output}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(merge(traces), handle)
    os.replace(temporary, args.output)
    print(f"merge.py: {len(traces)} traces -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
