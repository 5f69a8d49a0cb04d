// Differentiable Llama-style layers: RMSNorm and rotary position embeddings, each one
// fused kernel forward and one backward (kernels/cpu/rms_norm_rope.cpp and the CUDA row).
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

Tensor rotary_embedding(const Tensor& x, const ops::RopeTables& tables) {
  Tensor y = ops::rope(x, tables);
  // A rotation's gradient is the opposite rotation of the output's gradient.
  record("RotaryEmbeddingBackward", {x}, {y}, [tables](const BackwardArgs& a) {
    return Grads{ops::rope(a.grad(), tables, /*inverse=*/true)};
  });
  return y;
}

}  // namespace tessera
