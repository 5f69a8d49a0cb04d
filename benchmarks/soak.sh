#!/usr/bin/env bash
# Soak test of `tessera train` (issue 14): a tiny GPT trained for 20,000 steps on the CPU with
# an evaluation and a checkpoint every 500 steps, killed with SIGKILL at random moments and
# resumed each time; the final weights must equal an uninterrupted run's byte for byte, and
# the uninterrupted run's resident memory (growth < 2% after warm-up) and open descriptors
# must stay flat.
#   benchmarks/soak.sh                      # CPU, 20,000 steps
#   benchmarks/soak.sh --device cuda        # GPU: 2,000 steps of a larger GPT (4 layers, 128
#                                           # channels); the caching allocator's reserved
#                                           # bytes (every 100 steps) must not grow after
#                                           # warm-up (the first evaluation and checkpoint)
#   benchmarks/soak.sh --help               # every option
# Needs a built tree (BUILD_DIR, default build) or --tessera PATH. Exits non-zero when a
# check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 benchmarks/soak.py --tessera "${TESSERA:-${BUILD_DIR:-build}/tessera}" "$@"
