#!/usr/bin/env bash
# Installs the Python package `tessera` into a virtual environment, whichever python3 comes
# first on PATH (a pyenv or conda one has no NumPy or PyTorch; Debian's has both):
#
#   bash scripts/install_python.sh [--cpu | --cuda] [--venv DIR]
#
# The interpreter: $TESSERA_PYTHON, else Debian's /usr/bin/python3, else python3 on PATH. The
# environment (default .venv) sees that interpreter's packages (--system-site-packages), so
# NumPy and PyTorch are not downloaded again. Backends: --cpu (or TESSERA_CUDA=OFF) builds the
# CPU backend only, minutes instead of a quarter of an hour; --cuda (or TESSERA_CUDA=ON) the
# CUDA backend too; by default CUDA is built only when nvcc is found and a GPU is visible.
# Extra CMake options go in CMAKE_ARGS as for any scikit-build-core project.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
cuda=${TESSERA_CUDA:-auto}
while (($#)); do
  case "$1" in
    --cpu) cuda=OFF ;;
    --cuda) cuda=ON ;;
    --venv) venv=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "install_python: unknown argument '$1' (--cpu, --cuda, --venv DIR)" >&2; exit 2 ;;
  esac
  shift
done
case "$cuda" in
  ON|OFF) ;;
  auto)
    cuda=OFF
    if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
       nvidia-smi -L 2>/dev/null | grep -q GPU; then cuda=ON; fi ;;
  *) echo "install_python: TESSERA_CUDA must be ON or OFF, got '$cuda'" >&2; exit 2 ;;
esac
python=${TESSERA_PYTHON:-}
if [ -z "$python" ]; then
  if [ -x /usr/bin/python3 ]; then python=/usr/bin/python3; else python=$(command -v python3); fi
fi
"$python" -c 'import numpy' 2>/dev/null ||
  echo "install_python: note: $python has no NumPy; pip will download it into $venv" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
launcher=""
if command -v ccache >/dev/null; then
  launcher="-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache"
fi
echo "install_python: $python -> $venv, CUDA backend $cuda"
CMAKE_ARGS="-DTESSERA_CUDA=$cuda $launcher ${CMAKE_ARGS:-}" \
  "$venv/bin/python" -m pip install --disable-pip-version-check .
"$venv/bin/python" -c 'import tessera; print("install_python: tessera", tessera.__version__, "from", tessera.__file__)'
