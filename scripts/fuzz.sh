#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with AddressSanitizer + UBSan) and runs each
# for SECONDS (default 60), starting from the seed corpus fuzz/corpus/<reader>/; prints the
# executions, coverage and findings of every target. New inputs go to
# $FUZZ_BUILD_DIR/corpus/<reader>/, crashing inputs to $FUZZ_BUILD_DIR/findings/<reader>/.
#   scripts/fuzz.sh [SECONDS] [READER...]   readers: safetensors text_table token_file
#                                           tokenizer train_config training_state
#                                           deepspeed_config (default: all)
#   FUZZ_PARALLEL=N   targets run at once (default 1)
#   FUZZ_BUILD_DIR    build folder (default build-fuzz)
#   FUZZ_BUILD_ONLY=1 build the targets, run nothing
#   FUZZ_NO_BUILD=1   run the targets as built (while another build uses the folder)
#   FUZZ_KEEP_GOING=1 keep fuzzing after a finding (libFuzzer's fork mode), collecting them all
# Exits non-zero when a target found a crash, leak or sanitizer report.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
READERS=("$@")
[ ${#READERS[@]} -gt 0 ] || READERS=(safetensors text_table token_file tokenizer train_config training_state deepspeed_config)
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
PARALLEL=${FUZZ_PARALLEL:-1}
CLANG_VERSION=${CLANG_VERSION:-14}
CXX=$(command -v clang++-$CLANG_VERSION || command -v clang++)
CC=$(command -v clang-$CLANG_VERSION || command -v clang)
if [ -z "$CXX" ] || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long) { return 0; }' |
     "$CXX" -x c++ -fsanitize=fuzzer,address - -o /dev/null 2>/dev/null; then
  echo "fuzz.sh: needs clang with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev libomp-dev)"
  exit 2
fi
# Debug (assertions on) at -O1: fast enough to fuzz, quick to compile.
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined"
flags+=" -fno-omit-frame-pointer -O1"
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [ "${FUZZ_NO_BUILD:-0}" != 1 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_C_COMPILER="$CC" "${launcher[@]}" \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" -DTESSERA_FUZZ=ON -DTESSERA_CUDA=OFF \
    -DTESSERA_MPI=OFF -DTESSERA_CHECK_LAYERS=OFF -DTESSERA_BUILD_TESTS=OFF \
    -DTESSERA_BUILD_BENCHMARKS=OFF >/dev/null
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${READERS[@]/#/fuzz_}"
fi
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0

# One thread: the CPU kernels are built without OpenMP's pragmas (see fuzz/CMakeLists.txt).
export OMP_NUM_THREADS=1
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
run_one() {
  local reader=$1 work="$BUILD_DIR/corpus/$1" findings="$BUILD_DIR/findings/$1/"
  local scratch
  scratch=$(mktemp -d "${FUZZ_TMP:-/dev/shm}/tessera-fuzz-$reader.XXXXXX" 2>/dev/null ||
            mktemp -d "/tmp/tessera-fuzz-$reader.XXXXXX")
  rm -rf "$findings"  # findings of this run only
  mkdir -p "$work" "$findings"
  # Inputs up to 64 KiB; 2 GiB resident or one 1 GiB allocation counts as a finding (a size
  # taken from the file and trusted).
  local keep_going=()
  if [ "${FUZZ_KEEP_GOING:-0}" = 1 ]; then
    keep_going=(-fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1)
  fi
  TMPDIR=$scratch "$BUILD_DIR/fuzz/fuzz_$reader" "${keep_going[@]}" \
    -max_total_time="$SECONDS_EACH" -max_len=65536 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$findings" "$work" "fuzz/corpus/$reader" >"$BUILD_DIR/fuzz_$reader.log" 2>&1 || true
  rm -rf "$scratch"
}
mkdir -p "$BUILD_DIR"
running=0
for reader in "${READERS[@]}"; do
  run_one "$reader" &
  running=$((running + 1))
  if [ "$running" -ge "$PARALLEL" ]; then wait -n || true; running=$((running - 1)); fi
done
wait

status=0
printf "%-16s %12s %8s %8s %8s %s\n" reader execs exec/s cov features findings
for reader in "${READERS[@]}"; do
  log="$BUILD_DIR/fuzz_$reader.log"
  # The last status line ("#EXECS ... cov: N ft: N"), in either mode.
  execs=$(grep -oE '^#[0-9]+' "$log" | tr -d '#' | tail -1)
  rate=$(grep -oE 'exec/s:? [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  found=$(find "$BUILD_DIR/findings/$reader" -type f | wc -l)
  printf "%-16s %12s %8s %8s %8s %s\n" "$reader" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "$found"
  if [ "$found" -gt 0 ] || [ -z "$execs" ]; then
    status=1
    echo "  see $log and $BUILD_DIR/findings/$reader/"
  fi
done
exit $status
