#!/usr/bin/env bash
# README command (2): install what is missing, build everything (CUDA sources too when
# nvcc is present), run the whole test suite: the C++ suites (ctest; tests labelled heavy are
# left out, `ctest -L heavy` runs them), then the Python one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
BUILD="$(cd "${BUILD_DIR:-build}" && pwd)"
(cd "$BUILD" && ctest --output-on-failure -LE heavy -j "${JOBS:-2}" --timeout 900)
# Then the Python suite (python/tests) against the package the build assembled in
# $BUILD/python (the module is built when pybind11 and Python's headers are present).
if compgen -G "$BUILD/python/tessera/_tessera*.so" >/dev/null; then
  TESSERA_BUILD_DIR="$BUILD" PYTHONPATH="$BUILD/python" OMP_NUM_THREADS=2 \
    "${TESSERA_PYTHON:-/usr/bin/python3}" -m pytest -q python/tests
else
  echo "test: the Python module was not built (needs python3-dev and python3-pybind11); python/tests not run"
  exit 1
fi
