// Differentiable row norms over the last dim: layer_norm and rms_norm, each alone or after
// the residual add of a pre-norm block (residual_layer_norm, residual_rms_norm), one fused
// kernel forward and one backward (kernels/ops_norm.cpp; kernels/cpu/layer_norm.cpp,
// rms_norm.cpp; kernels/cuda/layer_norm.cu, rms_norm.cu).
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  ops::LayerNormOutput r = ops::layer_norm(x, weight, bias, eps);
  if (!autograd::any_requires_grad({x, weight, bias})) return r.out;
  record("LayerNormBackward", {x, weight, bias}, {r.out},
         [sx = SavedTensor::input(x), sw = SavedTensor::input(weight), mean = r.mean, rstd = r.rstd](const BackwardArgs& a) {
           const bool weight_grads = a.needs(1) || a.needs(2);
           ops::LayerNormGrads g = ops::layer_norm_backward(a.grad(), sx.unpack("LayerNormBackward"),
                                                            sw.unpack("LayerNormBackward"), mean, rstd, weight_grads);
           return Grads{a.needs(0) ? g.dx : Tensor(), a.needs(1) ? g.dweight : Tensor(),
                        a.needs(2) ? g.dbias : Tensor()};
         });
  return r.out;
}

std::pair<Tensor, Tensor> residual_layer_norm(const Tensor& x_in, const Tensor& residual_in,
                                              const Tensor& weight, const Tensor& bias, double eps,
                                              const Tensor& x_bias_in) {
  const char* op = "residual_layer_norm";
  TESSERA_CHECK(x_in.defined() && residual_in.defined(), op, ": x (",
                x_in.defined() ? "defined" : "undefined", ") and residual (",
                residual_in.defined() ? "defined" : "undefined", ") must both be tensors");
  // Two float dtypes (an f32 residual stream and a bf16 block output under autocast) add in
  // the promoted dtype, as x + residual would: the narrower operand is converted first
  // (differentiably, so its gradient goes back in its own dtype). x_bias joins x's dtype.
  Tensor x = x_in, residual = residual_in, x_bias = x_bias_in;
  if (x.dtype() != residual.dtype() && is_floating(x.dtype()) && is_floating(residual.dtype())) {
    const DType common = promote_types(x.dtype(), residual.dtype());
    x = x.to(common);
    residual = residual.to(common);
  }
  if (x_bias.defined() && x_bias.dtype() != x.dtype() && is_floating(x_bias.dtype()) &&
      is_floating(x.dtype()))
    x_bias = x_bias.to(x.dtype());
  ops::ResidualLayerNormOutput r = ops::residual_layer_norm(x, residual, weight, bias, eps, x_bias);
  if (!autograd::any_requires_grad({x, residual, weight, bias, x_bias})) return {r.sum, r.out};
  const std::shared_ptr<autograd::Node> node = record(
      "ResidualLayerNormBackward", {x, residual, weight, bias, x_bias}, {r.sum, r.out},
      [ssum = SavedTensor::output(r.sum), sw = SavedTensor::input(weight), mean = r.mean,
       rstd = r.rstd](const BackwardArgs& a) {
           const char* name = "ResidualLayerNormBackward";
           const Tensor sum = ssum.unpack(name);
           // Undefined gradients (takes_undefined_grads): the sum unused (the residual stream
           // ends at the last norm, ln_f) adds nothing; the norm unused is a zero dy.
           const Tensor dy = a.grad_outputs.at(1).defined()
                                 ? a.grad_outputs.at(1)
                                 : zeros(sum.shape(), {.dtype = sum.dtype(), .device = sum.device()});
           // The sum's own gradient (the residual stream) joins the norm's in one pass; every
           // term of the sum gets the total, x_bias its column sums (from the same pass).
           ops::LayerNormGrads g = ops::layer_norm_backward_residual(
               dy, sum, sw.unpack(name), mean, rstd, a.grad_outputs.at(0), a.needs(2) || a.needs(3),
               a.needs(4));
           return Grads{a.needs(0) ? g.dx : Tensor(), a.needs(1) ? g.dx : Tensor(),
                        a.needs(2) ? g.dweight : Tensor(), a.needs(3) ? g.dbias : Tensor(),
                        a.needs(4) ? g.dx_bias : Tensor()};
         });
  if (node) node->takes_undefined_grads = true;
  return {r.sum, r.out};
}

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

}  // namespace tessera
