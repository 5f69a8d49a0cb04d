#!/usr/bin/env bash
# Installs what Tessera needs from Debian's packages, only what is missing.
# libopenblas0-pthread makes the reference PyTorch use OpenBLAS rather than the slow reference BLAS.
# The CUDA toolkit is optional: when nvcc is present the CUDA backend is built too.
set -euo pipefail
PACKAGES=(build-essential cmake ninja-build pkg-config git
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-torch libopenblas0-pthread
  fortunes)
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
