# Shared by the multi-GPU benchmark scripts (sourced, not run): where the programs are, how
# PyTorch's runs are started, time limits, and the small "dry run" shapes that check the
# scripts on a CPU-only machine.
#   env: TESSERA_PYTHON (a python with torch; default python3)
#        BENCH_DRY_RUN=1: CPU, a tiny GPT, few steps, small buffers; PyTorch's ranks started by
#                         `tessera launch` (same environment as torchrun) instead of torchrun.
# shellcheck shell=bash disable=SC2034  # (the variables are for the scripts that source this)

PY=${TESSERA_PYTHON:-python3}
DRY_RUN=${BENCH_DRY_RUN:-0}
[[ $DRY_RUN == 1 ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # many CPU ranks share few cores
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines

# The path of a program built in BUILD (the tree's layout differs by target), or nothing.
bench_program() {
  local build=$1 name=$2
  if [[ -x $build/$name && ! -d $build/$name ]]; then echo "$build/$name"; return; fi
  find "$build" -maxdepth 3 -type f -name "$name" -perm -u+x 2>/dev/null | head -1
}

# bench_require BUILD NAME VAR: sets VAR to the program's path, or fails naming it.
bench_require() {
  local path
  path=$(bench_program "$1" "$2")
  if [[ -z $path ]]; then
    echo "error: $2 is not built in $1 (build it first)" >&2
    return 1
  fi
  printf -v "$3" '%s' "$path"
}

# torch_launcher N: sets TORCH_LAUNCH to the command that starts a PyTorch script on N ranks
# (torchrun's environment): "${TORCH_LAUNCH[@]}" SCRIPT ARGS...
torch_launcher() {
  if [[ $DRY_RUN == 1 ]]; then
    TORCH_LAUNCH=("$TESSERA" launch --nproc-per-node "$1" "$PY")
  elif [[ $1 == 1 ]]; then
    TORCH_LAUNCH=("$PY")
  else
    TORCH_LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$1")
  fi
}

# The GPT shape of a name (124M, 350M) as "LAYERS HEADS CHANNELS"; the dry run's tiny GPT for any.
gpt_shape() {
  if [[ $DRY_RUN == 1 ]]; then echo "2 2 64"; return; fi
  case $1 in
    124M) echo "12 12 768" ;;
    350M) echo "24 16 1024" ;;
    *) echo "unknown GPT size '$1' (124M or 350M)" >&2; return 1 ;;
  esac
}

# Batch rows, sequence length and vocabulary of every GPT run, and the device.
if [[ $DRY_RUN == 1 ]]; then
  BENCH_BATCH=2 BENCH_SEQ=32 BENCH_VOCAB=512 BENCH_DEVICE=cpu
else
  BENCH_BATCH=16 BENCH_SEQ=1024 BENCH_VOCAB=50304 BENCH_DEVICE=cuda
fi

# Seconds left before DEADLINE (an absolute `date +%s`), or a large number without one.
seconds_left() {
  if [[ -z ${DEADLINE:-} ]]; then echo 100000; return; fi
  echo $((DEADLINE - $(date +%s)))
}

# run_limited CAP LOG CMD...: runs CMD with its output in LOG, for at most CAP seconds and
# never past DEADLINE; a run that would get under 10 s is skipped. Returns CMD's status
# (124 when stopped by the time limit, 125 when skipped).
run_limited() {
  local cap=$1 log=$2 left
  shift 2
  left=$(seconds_left)
  ((left < cap)) && cap=$left
  if ((cap < 10)); then
    echo "skipped: no time left" > "$log"
    echo "  $(basename "$log"): skipped (no time left)" >&2
    return 125
  fi
  local t0=$SECONDS status
  timeout --kill-after=5 "$cap" "$@" > "$log" 2>&1
  status=$?
  ((status == 124 || status == 137)) && echo "stopped after ${cap} s (time limit)" >> "$log"
  echo "  $(basename "$log"): status $status in $((SECONDS - t0)) s" >&2
  return $status
}
