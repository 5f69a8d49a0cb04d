// Differentiable reductions and normalisations: sum, mean, amax, amin, softmax,
// log_softmax, layer_norm (alone or after a residual add).
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::drop_dims;
using autograd::util::keepdim_shape;
using autograd::util::mask_as;
using autograd::util::reduced_dims;
using autograd::util::reshape_grad;
using Grads = std::vector<Tensor>;

// The gradient of a reduction, broadcast back over the reduced dims of `input_shape`.
static Tensor spread(const Tensor& grad, const Shape& input_shape, const std::vector<int64_t>& dims) {
  return raw::expand(reshape_grad(grad, keepdim_shape(input_shape, dims)), input_shape);
}

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = ops::sum(x, dims, keepdim);
  record("SumBackward", {x}, {y}, [shape = x.shape(), d = reduced_dims(dims, x.dim(), "sum")](const BackwardArgs& a) {
    return Grads{spread(a.grad(), shape, d)};
  });
  return y;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = ops::mean(x, dims, keepdim);
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), "mean");
  int64_t count = 1;
  for (int64_t i : d) count *= x.size(i);
  record("MeanBackward", {x}, {y}, [shape = x.shape(), d, count](const BackwardArgs& a) {
    return Grads{spread(ops::mul(a.grad(), 1.0 / static_cast<double>(count)), shape, d)};
  });
  return y;
}

// amax/amin: the gradient goes to every position holding the extreme value, split evenly.
static Tensor extreme(const char* name, bool is_max, const Tensor& x, const std::vector<int64_t>& dims,
                      bool keepdim) {
  Tensor kept = is_max ? ops::amax(x, dims, true) : ops::amin(x, dims, true);
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), name);
  Tensor y = keepdim ? kept : raw::reshape(kept, drop_dims(x.shape(), d));
  if (!autograd::any_requires_grad({x})) return y;
  record(name, {x}, {y}, [name, d, sx = SavedTensor::input(x), sk = SavedTensor::output(kept)](const BackwardArgs& a) {
    const Tensor x = sx.unpack(name);
    Tensor hits = mask_as(ops::binary(BinaryOp::Eq, x, sk.unpack(name)), a.grad().dtype());
    Tensor per_hit = ops::div(reshape_grad(a.grad(), keepdim_shape(x.shape(), d)), ops::sum(hits, d, true));
    return Grads{ops::mul(hits, per_hit)};
  });
  return y;
}
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme("AmaxBackward", true, x, dims, keepdim);
}
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return extreme("AminBackward", false, x, dims, keepdim);
}

static Tensor softmax_function(const char* name, bool log, const Tensor& x, int64_t dim) {
  Tensor y = log ? ops::log_softmax(x, dim) : ops::softmax(x, dim);
  record(name, {x}, {y}, [name, log, dim, sy = SavedTensor::output(y)](const BackwardArgs& a) {
    return Grads{ops::softmax_backward(sy.unpack(name), a.grad(), dim, log)};
  });
  return y;
}
Tensor softmax(const Tensor& x, int64_t dim) { return softmax_function("SoftmaxBackward", false, x, dim); }
Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_function("LogSoftmaxBackward", true, x, dim);
}

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

}  // namespace tessera
