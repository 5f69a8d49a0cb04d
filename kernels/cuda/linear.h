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

// dw[K, N] = x2d[M, K]^T @ g[M, N], and when dbias is defined also dbias[N] = sum of g's rows:
// by column_sums (fused.h) beside a plain GEMM where g is a contiguous, aligned matrix of
// f32/f16/bf16 with N a multiple of 8, else in the same GEMM by CUBLASLT_EPILOGUE_BGRADA (the
// reduction over the GEMM's k = M of cuBLASLt's A operand, which is g). dw and dbias are
// overwritten (not accumulated), contiguous, in g's dtype.
void linear_weight_grad(const Tensor& x2d, const Tensor& g, const Tensor& dw,
                        const Tensor& dbias);

// GPT-2's MLP up-projection with its activation: pre_activation[M, N] = x2d @ w (+ bias), kept
// for the backward, and out[M, N] = gelu_tanh(pre_activation). Operands as linear_forward's;
// pre_activation: contiguous, out's shape, dtype and device. By default (set_gelu_epilogues)
// one GEMM (CUBLASLT_EPILOGUE_GELU_AUX_BIAS, or GELU_AUX without a bias), which takes GELU from
// the f32 accumulator (not from pre_activation rounded to a 16-bit dtype) and needs N divisible
// by 8 (the aux matrix's leading dimension); otherwise, and with the forward's epilogue off,
// linear_forward into pre_activation, then the GELU kernel.
void linear_gelu_forward(const Tensor& x2d, const Tensor& w, const Tensor& bias, const Tensor& out,
                         const Tensor& pre_activation);

// The input gradient of the next Linear through the GELU:
// dpre[M, H] = (g[M, N] @ w[H, N]ᵀ) * gelu_tanh'(pre_activation[M, H]), and when dbias is
// defined dbias[H] = the column sums of dpre (the gradient of the bias that made
// pre_activation). dpre, dbias: contiguous, written (not accumulated), in g's dtype;
// pre_activation contiguous. By default one GEMM (CUBLASLT_EPILOGUE_DGELU, which applies gelu'
// to the f32 accumulator; needs H divisible by 8), then a column-sum pass over dpre for dbias;
// without the backward's epilogue a plain GEMM into dpre, then one pass that applies gelu' in
// place and sums the bias gradient (gelu_backward_with_bias_grad, fused.h).
void linear_input_grad_dgelu(const Tensor& g, const Tensor& w, const Tensor& pre_activation,
                             const Tensor& dpre, const Tensor& dbias);

// ---- visible to tests and benchmarks ----
// When false, the functions above never use an epilogue (always the fallback);
// for testing the fallback and for comparing. Default true. Per process.
void set_linear_epilogues_enabled(bool enabled);
bool linear_epilogues_enabled();
// Which of the two functions above take cuBLASLt's GELU epilogues (also needs the switch above
// on). Default: both, measured faster on an H100 than the separate passes.
// TESSERA_GELU_EPILOGUES=0 / forward / 1 picks none / the forward's / both. Per process.
enum class GeluEpilogues { none, forward, both };
void set_gelu_epilogues(GeluEpilogues which);
// true: both, false: none.
void set_gelu_epilogues_enabled(bool enabled);

// How many linear_forward/linear_weight_grad calls (this process) took each path.
struct LinearPathCounts {
  int64_t fused = 0;     // bias / bias-gradient done in the cuBLASLt epilogue
  int64_t fallback = 0;  // plain GEMM + separate bias add / reduction
};
LinearPathCounts linear_path_counts();
// The same for linear_gelu_forward/linear_input_grad_dgelu calls: fused = the GELU (and bias)
// work done in a cuBLASLt epilogue, fallback = the default route with separate passes. (The
// forward's linear_forward is counted above too.)
LinearPathCounts linear_gelu_path_counts();

}  // namespace tessera::cuda
