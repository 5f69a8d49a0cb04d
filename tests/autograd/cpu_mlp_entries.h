// CPU stand-ins for the fused MLP GEMM entries of the fused-kernel table
// (FusedKernelTable::linear_gelu_forward / linear_input_grad_dgelu, which only CUDA fills),
// built from the plain ops. Installed for a test's scope, they make mlp_gelu take its fused
// route on the CPU, so that route's tape node and gradient bookkeeping are tested without a
// GPU (tests/cuda checks the cuBLASLt kernels against float64 references).
#pragma once
#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"

namespace tessera::testing {

class CpuMlpEntries {
 public:
  // linear_gelu_forward calls since the entries were installed.
  static inline int forward_calls = 0;

  CpuMlpEntries() : table_(fused_kernel_table(DeviceType::CPU)), saved_(table_) {
    table_.linear_gelu_forward = linear_gelu_forward;
    table_.linear_input_grad_dgelu = linear_input_grad_dgelu;
    forward_calls = 0;
  }
  ~CpuMlpEntries() { table_ = saved_; }
  CpuMlpEntries(const CpuMlpEntries&) = delete;
  CpuMlpEntries& operator=(const CpuMlpEntries&) = delete;

 private:
  static void linear_gelu_forward(const Tensor& x2d, const Tensor& w, const Tensor& bias,
                                  const Tensor& out, const Tensor& pre_activation) {
    ++forward_calls;
    ops::copy_(pre_activation, ops::matmul(x2d, w));
    if (bias.defined()) ops::binary_(BinaryOp::Add, pre_activation, bias);
    ops::copy_(out, ops::gelu(pre_activation));
  }
  static void linear_input_grad_dgelu(const Tensor& g, const Tensor& w,
                                      const Tensor& pre_activation, const Tensor& dpre,
                                      const Tensor& dbias) {
    ops::copy_(dpre, ops::gelu_backward(pre_activation, ops::matmul(g, ops::transpose(w, 0, 1))));
    if (dbias.defined()) ops::copy_(dbias, ops::sum(dpre, {0}));
  }

  FusedKernelTable& table_;
  FusedKernelTable saved_;
};

}  // namespace tessera::testing
