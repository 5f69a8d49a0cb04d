#!/usr/bin/env bash
# The pipeline bubble on the wall clock: GPipe's (p - 1) / (m + p - 1) against what the stages'
# timelines measure, for p = 2, 4 stages and m = 4, 8 micro-batches under both schedules
# (tests/dist/dist_pp_check.cpp --bubble through `tessera launch`, one thread a rank). The
# test suite asserts the logical figure (the recorded orders); the wall-clock figure needs a
# core for every stage, which a 2-core machine does not have, so it is measured here, on a
# machine with at least 4 free cores (a GPU machine's host CPUs will do: no GPU is used).
#   usage: benchmarks/bench_pipeline_bubble.sh [BUILD_DIR (build)] [extra dist_pp_check flags]
#   env: REPS (runs of each configuration, default 3: the median and spread are printed)
# A configuration passes when the median wall-clock figure is within 10% of the theory.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
REPS=${REPS:-3}
cli=$BUILD/tessera
check=$BUILD/tests/dist/dist_pp_check
for f in "$cli" "$check"; do
  [[ -x $f ]] || { echo "bench_pipeline_bubble: $f is not built (targets tessera_cli dist_pp_check)"; exit 2; }
done
cores=$(nproc)
fails=0
printf "%-14s %8s %10s %28s %10s %10s\n" "p m schedule" "theory" "logical" "wall-clock median [min,max]" "replayed" "verdict"
for p in 2 4; do
  if (( cores < p )); then
    echo "p $p: skipped, $p stages need $p cores (this machine has $cores)"
    continue
  fi
  for m in 4 8; do
    for schedule in afab 1f1b; do
      lines=""
      for ((r = 0; r < REPS; ++r)); do
        lines+=$(env OMP_NUM_THREADS=1 "$cli" launch --nproc-per-node "$p" "$check" --bubble \
          --micro-batches "$m" --schedule "$schedule" "$@" 2>&1 | grep '^rank 0: bubble')$'\n'
      done
      # Rank 0's lines: the median and spread of the wall-clock figure, the replayed median.
      python3 - "$p $m $schedule" "$lines" <<'PY' || fails=$((fails + 1))
import re, statistics, sys
name, lines = sys.argv[1], [l for l in sys.argv[2].splitlines() if l]
fig = lambda key: [float(re.search(key + r" ([0-9.]+)", l).group(1)) for l in lines]
if not lines:
    print(f"{name:<14} no figure printed"); sys.exit(1)
theory, logical = fig("theory")[0], fig("logical")[0]
walls, replayed = sorted(fig("wall-clock")), fig("replayed CPU time")
median = statistics.median(walls)
ok = abs(median - theory) <= 0.1 * theory
print(f"{name:<14} {theory:8.4f} {logical:10.4f} {median:10.4f} [{walls[0]:.4f},{walls[-1]:.4f}]"
      f" {statistics.median(replayed):10.4f} {'OK' if ok else 'OUTSIDE 10%':>10}")
sys.exit(0 if ok else 1)
PY
    done
  done
done
echo "bench_pipeline_bubble: $fails configuration(s) outside 10% of the theory"
exit $(( fails > 0 ))
