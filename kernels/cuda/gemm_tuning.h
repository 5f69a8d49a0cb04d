// How the cuBLASLt GEMMs of matmul.cu (matmul, the Linear helpers of linear.h) choose their
// kernels, beyond the heuristic's first pick. Namespace tessera::cuda, CUDA builds only.
//
// Autotuning among bit-identical algorithms. cublasLtMatmulAlgoGetHeuristic ranks the
// algorithms by a model of the device, and its first pick is not always the fastest for a
// shape. With autotuning on, the first call of a plan (shape, strides, dtypes, alignment,
// epilogue) made outside a graph capture, of at least 1 GFLOP, runs the heuristic's first
// candidates on the call's own operands, keeps those whose every written bit (output, bias
// gradient, GELU input) equals the first pick's, times them and keeps the fastest for the
// plan's lifetime. An algorithm that would change a result is never chosen, so the choice,
// whatever each process measured, cannot make ranks, resumed runs or graph replays differ.
// A plan first met inside a capture keeps the first pick there. The timings are taken on an
// idle device (the tuning first waits for every stream of it, so a data-parallel run's gradient
// exchanges do not run beside them) at working clocks (the first tuning of a process runs the
// first pick for at least 200 ms, or 32,767 calls, before timing), best of 5 rounds in which
// the candidates take turns.

#pragma once
#include <cstdint>

namespace tessera::cuda {

// Default: on; TESSERA_GEMM_AUTOTUNE=0 turns it off. Per process. Plans made while it is off
// are kept apart from those made while it is on (they keep the heuristic's first pick).
void set_gemm_autotune_enabled(bool enabled);
bool gemm_autotune_enabled();

struct GemmTuningCounts {
  int64_t plans_tuned = 0;          // plans whose candidates were compared
  int64_t faster_than_first = 0;    // of those, plans that now run another algorithm
  int64_t candidates_rejected = 0;  // candidates dropped because a written bit differed
};
GemmTuningCounts gemm_tuning_counts();

}  // namespace tessera::cuda
