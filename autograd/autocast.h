// Mixed precision by scope: under an AutocastGuard(bf16 or f16) the compute-heavy
// differentiable functions (matmul, linear, attention) cast their floating-point operands
// to the compute dtype before running, through the differentiable to(dtype), so their
// gradients flow back converted to the operands' own dtype (fp32 master parameters get
// fp32 gradients). Everything else (reductions, softmax statistics, layer_norm, the loss)
// keeps the dtype it is given: fp32 parameters and activations stay fp32 there.
//
// The policy is thread-local (like PyTorch's torch.autocast) and nests: an inner guard
// replaces the outer policy until it ends. AutocastGuard(DType::f32) turns autocast off.
#pragma once
#include <optional>

#include "tessera/core/tensor.h"

namespace tessera::autograd {

class AutocastGuard {
 public:
  // compute: bf16, f16 (autocast on) or f32 (off inside this scope).
  explicit AutocastGuard(DType compute);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> previous_;
};

// The compute dtype in effect on this thread, or nullopt when autocast is off.
std::optional<DType> autocast_dtype();

// x cast (differentiably) to the compute dtype when autocast is on and x is a floating
// tensor of another dtype (f64 is left alone: it asks for precision, not speed); x
// itself otherwise. Undefined tensors pass through.
Tensor autocast(const Tensor& x);

}  // namespace tessera::autograd
