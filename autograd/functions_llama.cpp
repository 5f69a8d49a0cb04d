// Differentiable Llama-style layers: RMSNorm (alone or after a residual add) and rotary
// position embeddings, each one fused kernel forward and one backward
// (kernels/cpu/rms_norm_rope.cpp and the CUDA row).
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  ops::RmsNormOutput r = ops::rms_norm(x, weight, eps);
  if (!autograd::any_requires_grad({x, weight})) return r.out;
  record("RmsNormBackward", {x, weight}, {r.out},
         [sx = SavedTensor::input(x), sw = SavedTensor::input(weight),
          rstd = r.rstd](const BackwardArgs& a) {
           ops::RmsNormGrads g =
               ops::rms_norm_backward(a.grad(), sx.unpack("RmsNormBackward"),
                                      sw.unpack("RmsNormBackward"), rstd, a.needs(1));
           return Grads{a.needs(0) ? g.dx : Tensor(), g.dweight};
         });
  return r.out;
}

std::pair<Tensor, Tensor> residual_rms_norm(const Tensor& x, const Tensor& residual,
                                            const Tensor& weight, double eps) {
  ops::ResidualRmsNormOutput r = ops::residual_rms_norm(x, residual, weight, eps);
  if (!autograd::any_requires_grad({x, residual, weight})) return {r.sum, r.out};
  record("ResidualRmsNormBackward", {x, residual, weight}, {r.sum, r.out},
         [ssum = SavedTensor::output(r.sum), sw = SavedTensor::input(weight),
          rstd = r.rstd](const BackwardArgs& a) {
           const char* op = "ResidualRmsNormBackward";
           // The sum's own gradient (the residual stream) joins the norm's in one pass; both
           // terms of the sum get the total.
           ops::RmsNormGrads g =
               ops::rms_norm_backward_residual(a.grad_outputs.at(1), ssum.unpack(op), sw.unpack(op),
                                               rstd, a.grad_outputs.at(0), a.needs(2));
           return Grads{a.needs(0) ? g.dx : Tensor(), a.needs(1) ? g.dx : Tensor(), g.dweight};
         });
  return {r.sum, r.out};
}

Tensor rotary_embedding(const Tensor& x, const ops::RopeTables& tables) {
  Tensor y = ops::rope(x, tables);
  // A rotation's gradient is the opposite rotation of the output's gradient.
  record("RotaryEmbeddingBackward", {x}, {y}, [tables](const BackwardArgs& a) {
    return Grads{ops::rope(a.grad(), tables, /*inverse=*/true)};
  });
  return y;
}

}  // namespace tessera
