// The GEMMs of a Linear layer with the bias work fused into cuBLASLt epilogues
// (namespace tessera::cuda, raw tensors, no autograd). Implemented in matmul.cu beside the
// plain matmul, whose cuBLASLt plans (descriptors + heuristic algorithm, cached per shape,
// strides, dtypes, alignment and epilogue) they share.
//
// Where cuBLASLt refuses an epilogue for a dtype/shape/alignment (no heuristic result or
// CUBLAS_STATUS_NOT_SUPPORTED), each function falls back to the plain GEMM followed by
// ops::binary_ / ops::sum: results are the same up to rounding, only slower.
#pragma once
#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera::cuda {

// out[M, N] = x2d[M, K] @ w[K, N] (+ bias[N] broadcast over the rows).
// x2d and w: f32, f16 or bf16 of out's dtype, any strides cuBLAS can describe (transposed
// views included; others are copied). out: contiguous. bias: undefined, or [N] in out's
// dtype (f32 also accepted for f16/bf16 outputs, as under autocast). The bias is added
// by CUBLASLT_EPILOGUE_BIAS. f64 is accepted and always takes the fallback.
void linear_forward(const Tensor& x2d, const Tensor& w, const Tensor& bias, const Tensor& out);

// dw[K, N] = x2d[M, K]^T @ g[M, N], and when dbias is defined also dbias[N] = sum of g's rows,
// computed in the same GEMM by CUBLASLT_EPILOGUE_BGRADA (the reduction over the GEMM's k = M
// of cuBLASLt's A operand, which is g). dw and dbias are overwritten (not accumulated),
// contiguous, in g's dtype.
void linear_weight_grad(const Tensor& x2d, const Tensor& g, const Tensor& dw,
                        const Tensor& dbias);

// ---- visible to tests and benchmarks ----
// When false, linear_forward/linear_weight_grad never use an epilogue (always the fallback);
// for testing the fallback and for comparing. Default true. Per process.
void set_linear_epilogues_enabled(bool enabled);
bool linear_epilogues_enabled();

// How many linear_forward/linear_weight_grad calls (this process) took each path.
struct LinearPathCounts {
  int64_t fused = 0;     // bias / bias-gradient done in the cuBLASLt epilogue
  int64_t fallback = 0;  // plain GEMM + separate bias add / reduction
};
LinearPathCounts linear_path_counts();

}  // namespace tessera::cuda
