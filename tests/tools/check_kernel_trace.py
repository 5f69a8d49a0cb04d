#!/usr/bin/env python3
"""Runs kernel_trace_probe under libtessera_kernel_trace.so and checks what was recorded.

The probe launches a known set of kernels, copies and a replayed CUDA graph (see
kernel_trace_probe.cu); this checks the Chrome trace holds exactly those, that the summary's
busy, overlap and per-kernel figures equal the ones recomputed here from the trace's events,
that a time window leaves kernels out, and that the traced program is never harmed when
tracing cannot start. Exits 77 (ctest: skipped) when the machine has no CUDA device.
"""
import argparse
import collections
import decimal
import json
import os
import pathlib
import re
import subprocess
import sys

# The interval arithmetic of compare.py (pure Python, independent of the C++ summary checked here).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "kernel_trace"))
from compare import covered  # noqa: E402

SKIP = 77


def run_probe(probe, library, out_dir, prefix, **extra_env):
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "TESSERA_KERNEL_TRACE_START_S",
                 "TESSERA_KERNEL_TRACE_SECONDS", "TESSERA_KERNEL_TRACE"):
        env.pop(name, None)
    env["CUDA_INJECTION64_PATH"] = str(library)
    if prefix is not None:
        env["TESSERA_KERNEL_TRACE"] = str(out_dir / prefix)
    env.update(extra_env)
    result = subprocess.run([str(probe)], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode == SKIP:
        print(result.stdout.strip())
        sys.exit(SKIP)
    if result.returncode != 0:
        sys.exit(f"probe failed (rc {result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def intersection(a, b):
    changes = sorted([(s, 1, 0) for s, e in a] + [(e, -1, 0) for s, e in a] +
                     [(s, 0, 1) for s, e in b] + [(e, 0, -1) for s, e in b])
    total, depth_a, depth_b, previous = 0, 0, 0, None
    for time, da, db in changes:
        if previous is not None and depth_a > 0 and depth_b > 0:
            total += time - previous
        previous, depth_a, depth_b = time, depth_a + da, depth_b + db
    return total


def ms_figure(summary, pattern):
    match = re.search(pattern + r" ([0-9.]+) ms", summary)
    if not match:
        sys.exit(f"summary lacks '{pattern}':\n{summary}")
    return float(match.group(1))


def expect(condition, message):
    if not condition:
        sys.exit("FAILED: " + message)


def check_full_trace(out_dir):
    stem = out_dir / "probe.rank3"  # RANK=3 names the files
    # Decimal keeps the nanoseconds of absolute times that a float would round away.
    trace = json.loads(pathlib.Path(str(stem) + ".json").read_text(), parse_float=decimal.Decimal)
    summary = pathlib.Path(str(stem) + ".summary.txt").read_text()
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kernels = [e for e in events if e["cat"] == "kernel"]
    counts = collections.Counter(e["name"] for e in kernels)
    expected = {"probe_scale<3>": 5, "probe_add": 4, "probe_graph_first": 3,
                "probe_graph_second": 3, "probe_spin": 1, "ncclProbeSpin": 1}
    for name, count in expected.items():
        expect(counts[name] == count, f"{name}: {counts[name]} kernels in the trace, expected {count}")
    expect(all(e["ts"] > 0 and e["dur"] > 0 for e in events if e["cat"] != "sync"),
           "a GPU event with ts or dur <= 0")
    graph_nodes = [e for e in kernels if e["name"].startswith("probe_graph")]
    expect(all(e["args"].get("graph_id", 0) > 0 for e in graph_nodes), "graph nodes without graph_id")
    scale = [e for e in kernels if e["name"] == "probe_scale<3>"]
    add = [e for e in kernels if e["name"] == "probe_add"]
    expect(len({e["tid"] for e in scale}) == 1 and {e["tid"] for e in scale} != {e["tid"] for e in add},
           "stream A's and stream B's kernels should be on one track each")
    expect({e["pid"] for e in kernels} == {300}, "rank 3's GPU 0 should be process track 300")
    expect(scale[0]["args"]["block"] == [256, 1, 1] and scale[0]["args"]["grid"] == [256, 1, 1],
           f"launch shape of probe_scale: {scale[0]['args']}")
    memory = collections.Counter(e["name"] for e in events if e["cat"] == "memory")
    for name in ("memcpy HtoD", "memcpy DtoH", "memset"):
        expect(memory[name] >= 1, f"no {name} in the trace: {dict(memory)}")

    # The summary's figures against the same figures recomputed from the events (us -> ms).
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    figures = {
        "device 0: busy": float(covered(intervals)) / 1000,
        "two or more kernels at once": float(covered(intervals, 2)) / 1000,
        "communication overlapped by compute": float(intersection(nccl, compute)) / 1000,
    }
    for pattern, value in figures.items():
        reported = ms_figure(summary, pattern)
        expect(abs(reported - value) <= 0.002, f"{pattern}: summary {reported} ms, trace {value:.4f} ms")
    # The two 5 ms spins ran side by side.
    expect(figures["communication overlapped by compute"] > 1.0,
           f"the two spinning kernels overlapped only {figures['communication overlapped by compute']} ms")
    for name, count in expected.items():
        expect(re.search(rf"^\s+{count}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+%\s+{re.escape(name)}$", summary,
                         re.MULTILINE), f"summary row for {name} x{count} missing:\n{summary}")
    # The probe's three cudaDeviceSynchronize calls blocked the host.
    syncs = [e for e in events if e["cat"] == "sync" and e["name"] == "cudaDeviceSynchronize"]
    expect(len(syncs) >= 3 and {e["pid"] for e in syncs} == {399},
           f"host waits: {[(e['name'], e['pid']) for e in events if e['cat'] == 'sync']}")
    expect(re.search(r"^host waits in CUDA synchronisation: [0-9.]+ ms in \d+ calls", summary,
                     re.MULTILINE), f"no host waits in the summary:\n{summary}")
    expect(re.search(r"^  graph \d+: 6 kernel records of 2 nodes, 3\.0 replays$", summary, re.MULTILINE),
           f"the graph's 3 replays of 2 nodes are not in the summary:\n{summary}")
    print(f"full trace: {len(kernels)} kernels, busy {figures['device 0: busy']:.3f} ms, "
          f"overlap {figures['two or more kernels at once']:.3f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--library", type=pathlib.Path, required=True)
    parser.add_argument("--probe", type=pathlib.Path, required=True)
    parser.add_argument("--out-dir", type=pathlib.Path, required=True)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for old in args.out_dir.glob("probe*"):
        old.unlink()

    run_probe(args.probe, args.library, args.out_dir, "probe", RANK="3")
    check_full_trace(args.out_dir)

    # A window starting an hour after CUDA initialisation keeps no kernel but says how many
    # it left out.
    run_probe(args.probe, args.library, args.out_dir, "probe_late", LOCAL_RANK="1",
              TESSERA_KERNEL_TRACE_START_S="3600")
    late = json.loads((args.out_dir / "probe_late.rank1.json").read_text())
    expect(not [e for e in late["traceEvents"] if e["ph"] == "X"], "the window kept events")
    late_summary = (args.out_dir / "probe_late.rank1.summary.txt").read_text()
    expect(re.search(r"records: 0 kernels, 0 memcpy, 0 memset, 0 host synchronisations; left out: (\d+) outside", late_summary)
           and int(re.search(r"left out: (\d+) outside", late_summary).group(1)) >= 20,
           f"window summary:\n{late_summary}")

    # Tracing that cannot start (no output prefix; a bad window value) leaves the program
    # running normally.
    result = run_probe(args.probe, args.library, args.out_dir, None)
    expect("TESSERA_KERNEL_TRACE (the output prefix) is not set" in result.stderr, result.stderr)
    result = run_probe(args.probe, args.library, args.out_dir, "probe_bad", RANK="0",
                       TESSERA_KERNEL_TRACE_SECONDS="soon")
    expect("TESSERA_KERNEL_TRACE_SECONDS 'soon' is not a number" in result.stderr, result.stderr)
    expect((args.out_dir / "probe_bad.rank0.json").exists(), "a bad window value stopped tracing")
    expect(not list(args.out_dir.glob("*.tmp*")), "temporary files left behind")
    print("kernel trace checks passed")


if __name__ == "__main__":
    main()
