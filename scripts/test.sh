#!/usr/bin/env bash
# README command (2): install what is missing, build everything (CUDA sources too when
# nvcc is present), run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${JOBS:-2}" --timeout 900
