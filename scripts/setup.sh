#!/usr/bin/env bash
# Installs what Tessera needs from Debian's packages, only what is missing.
# libopenblas0-pthread makes the reference PyTorch use OpenBLAS rather than the slow reference BLAS.
# The CUDA toolkit is optional: when nvcc is present the CUDA backend is built too.
set -euo pipefail
PACKAGES=(build-essential cmake ninja-build pkg-config git
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-torch libopenblas0-pthread
  unzip python3-pip fortunes)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: dependencies present"

# The cuDNN frontend (header-only C++ graph API behind the cuDNN attention path) is not a
# Debian package: it ships inside NVIDIA's pip wheel. Its headers are the same on every
# platform and Python, so one pinned wheel is fetched (pip only downloads, installs nothing)
# and its include/ folder unpacked into the checkout's ignored .deps/. Only with CUDA.
CUDNN_FRONTEND_VERSION=1.32.0
frontend_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps/cudnn_frontend"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  if [ ! -f "$frontend_dir/include/cudnn_frontend.h" ]; then
    wheel_dir="$(mktemp -d)"
    if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp --platform manylinux_2_28_x86_64 -d "$wheel_dir" \
         "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION" >/dev/null 2>&1 &&
       mkdir -p "$frontend_dir" &&
       unzip -q -o "$wheel_dir"/nvidia_cudnn_frontend-*.whl 'include/*' -d "$frontend_dir"; then
      echo "setup: cuDNN frontend $CUDNN_FRONTEND_VERSION headers in $frontend_dir/include"
    else
      echo "setup: could not fetch the cuDNN frontend headers; the cuDNN attention path is not built"
    fi
    rm -rf "$wheel_dir"
  fi
fi
