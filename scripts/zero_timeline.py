#!/usr/bin/env python3
"""Renders a ZeRO timeline (TESSERA_ZERO_TRACE=FILE, see dist/zero_trace.h) as text, SVG or PNG.

    scripts/zero_timeline.py TRACE [TRACE.rank1 ...] [--step N] [--width 100]
                             [--svg OUT.svg] [--png OUT.png]

One row per (rank, kind of work): the training thread's all-gathers, forwards, backwards,
reduce-scatters, the offload worker's copies and, on a GPU, the compute stream's own forward
and backward times (forward_gpu, backward_gpu: CUDA events). Each span is drawn with its unit's digit
(stage-3 units: the blocks in backward order, the root last), so a gather that starts before
the previous block's forward ended is a prefetch that overlaps compute. Text goes to stdout;
--svg writes a labelled chart (no dependencies); --png needs matplotlib.
"""
import argparse
import json
import sys

ROWS = ["all_gather", "gather_wait", "forward", "backward", "forward_gpu", "backward_gpu",
        "reduce_scatter", "all_reduce",
        "offload_d2h", "offload_step", "clip_and_step", "offload_h2d", "after_step"]
COLOURS = {"all_gather": "#4e79a7", "gather_wait": "#e15759", "forward": "#59a14f",
           "backward": "#8cd17d", "forward_gpu": "#2e7d32", "backward_gpu": "#66bb6a",
           "reduce_scatter": "#f28e2b", "all_reduce": "#f28e2b",
           "offload_d2h": "#b07aa1", "offload_step": "#76b7b2", "clip_and_step": "#9c755f", "offload_h2d": "#d4a6c8",
           "after_step": "#bab0ac"}


def load(paths, step):
    spans = []
    for path in paths:
        with open(path) as f:
            for e in json.load(f)["traceEvents"]:
                if e["args"]["step"] == step:
                    spans.append({"rank": e["pid"], "name": e["name"], "unit": e["args"]["unit"],
                                  "begin": e["ts"], "end": e["ts"] + e["dur"]})
    if not spans:
        sys.exit(f"zero_timeline: no spans of step {step} in {', '.join(paths)}")
    # Long spans first, so that the short ones drawn after them stay visible (the root unit's
    # forward encloses the blocks').
    return sorted(spans, key=lambda s: s["begin"] - s["end"])


def rows_of(spans):
    keys = sorted({(s["rank"], s["name"]) for s in spans},
                  key=lambda k: (k[0], ROWS.index(k[1]) if k[1] in ROWS else len(ROWS)))
    return keys


def text_chart(spans, width):
    t0 = min(s["begin"] for s in spans)
    t1 = max(s["end"] for s in spans)
    scale = width / max(t1 - t0, 1e-9)
    lines = [f"step spans {(t1 - t0) / 1000:.3f} ms; one column = {(t1 - t0) / width / 1000:.3f} ms"]
    for rank, name in rows_of(spans):
        row = [" "] * width
        for s in spans:
            if s["rank"] != rank or s["name"] != name:
                continue
            a = int((s["begin"] - t0) * scale)
            b = max(a + 1, int((s["end"] - t0) * scale))
            mark = str(s["unit"] % 10) if s["unit"] >= 0 else "#"
            for i in range(min(a, width - 1), min(b, width)):
                row[i] = mark
        lines.append(f"r{rank} {name:>14} |{''.join(row)}|")
    return "\n".join(lines)


def svg_chart(spans, path):
    t0 = min(s["begin"] for s in spans)
    t1 = max(s["end"] for s in spans)
    keys = rows_of(spans)
    left, width, height = 170, 900, 22
    scale = width / max(t1 - t0, 1e-9)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" '
           f'height="{height * len(keys) + 50}" font-family="monospace" font-size="11">']
    for i, (rank, name) in enumerate(keys):
        y = 10 + i * height
        out.append(f'<text x="4" y="{y + 15}">rank {rank} {name}</text>')
        for s in spans:
            if s["rank"] != rank or s["name"] != name:
                continue
            x = left + (s["begin"] - t0) * scale
            w = max(1.0, (s["end"] - s["begin"]) * scale)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{height - 4}" '
                       f'fill="{COLOURS.get(name, "#999")}" stroke="#333" stroke-width="0.3">'
                       f'<title>{name} unit {s["unit"]}: {(s["end"] - s["begin"]) / 1000:.3f} ms'
                       f'</title></rect>')
            if w > 10 and s["unit"] >= 0:
                out.append(f'<text x="{x + 2:.1f}" y="{y + 13}" fill="white">{s["unit"]}</text>')
    y = 10 + len(keys) * height + 20
    out.append(f'<text x="{left}" y="{y}">0 ms</text>')
    out.append(f'<text x="{left + width - 80}" y="{y}">{(t1 - t0) / 1000:.2f} ms</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def png_chart(spans, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("zero_timeline: --png needs matplotlib (pip install matplotlib); --svg needs nothing")
    t0 = min(s["begin"] for s in spans)
    keys = rows_of(spans)
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(keys) + 1))
    for i, key in enumerate(keys):
        bars = [((s["begin"] - t0) / 1000, (s["end"] - s["begin"]) / 1000)
                for s in spans if (s["rank"], s["name"]) == key]
        ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=COLOURS.get(key[1], "#999"), edgecolor="#333")
    ax.set_yticks(range(len(keys)), [f"rank {r} {n}" for r, n in keys])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first span")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--step", type=int, default=1, help="traced step to draw (default 1: after warm-up)")
    parser.add_argument("--width", type=int, default=100)
    parser.add_argument("--svg")
    parser.add_argument("--png")
    args = parser.parse_args()
    spans = load(args.traces, args.step)
    print(text_chart(spans, args.width))
    if args.svg:
        svg_chart(spans, args.svg)
    if args.png:
        png_chart(spans, args.png)


if __name__ == "__main__":
    main()
