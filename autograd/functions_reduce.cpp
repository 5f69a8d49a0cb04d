// Differentiable reductions: sum, mean, amax, amin, var, std_dev, logsumexp, prod, softmax,
// log_softmax. (layer_norm and rms_norm: autograd/functions_norm.cpp; cumsum:
// autograd/functions_select.cpp.)
#include <cmath>

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
using autograd::util::scalar_like;
using Grads = std::vector<Tensor>;

// The gradient of a reduction, broadcast back over the reduced dims of `input_shape`.
static Tensor spread(const Tensor& grad, const Shape& input_shape,
                     const std::vector<int64_t>& dims) {
  return ops::expand(reshape_grad(grad, keepdim_shape(input_shape, dims)), input_shape);
}

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = ops::sum(x, dims, keepdim);
  record("SumBackward", {x}, {y},
         [shape = x.shape(), d = reduced_dims(dims, x.dim(), "sum")](const BackwardArgs& a) {
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
static Tensor extreme(const char* name, bool is_max, const Tensor& x,
                      const std::vector<int64_t>& dims, bool keepdim) {
  Tensor kept = is_max ? ops::amax(x, dims, true) : ops::amin(x, dims, true);
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), name);
  Tensor y = keepdim ? kept : ops::reshape(kept, drop_dims(x.shape(), d));
  if (!autograd::any_requires_grad({x})) return y;
  record(
      name, {x}, {y},
      [name, d, sx = SavedTensor::input(x), sk = SavedTensor::output(kept)](const BackwardArgs& a) {
        const Tensor x = sx.unpack(name);
        Tensor hits = mask_as(ops::binary(BinaryOp::Eq, x, sk.unpack(name)), a.grad().dtype());
        Tensor per_hit =
            ops::div(reshape_grad(a.grad(), keepdim_shape(x.shape(), d)), ops::sum(hits, d, true));
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
Tensor softmax(const Tensor& x, int64_t dim) {
  return softmax_function("SoftmaxBackward", false, x, dim);
}
Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_function("LogSoftmaxBackward", true, x, dim);
}

Tensor var(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), "var");
  int64_t count = 1;
  for (int64_t i : d) count *= x.size(i);
  // Two passes (mean, then squared deviations): composed from differentiable functions, so
  // the gradient 2 (x - mean) / (N - correction) comes from their backward.
  const Tensor centered = x - mean(x, dims, true);
  return sum(square(centered), dims, keepdim) / (static_cast<double>(count) - correction);
}

Tensor std_dev(const Tensor& x, const std::vector<int64_t>& dims, double correction, bool keepdim) {
  const Tensor variance = var(x, dims, correction, keepdim);
  Tensor y = ops::unary(UnaryOp::Sqrt, variance);
  if (!autograd::any_requires_grad({variance})) return y;
  // d sqrt(v) = g / (2 y), and 0 where y == 0 as PyTorch's std_backward: sqrt's inf there
  // times var's zero gradient (x - mean = 0) made a constant feature's gradient NaN.
  record("StdBackward", {variance}, {y}, [sy = SavedTensor::output(y)](const BackwardArgs& a) {
    const Tensor y = sy.unpack("StdBackward");
    const Tensor dv = ops::div(ops::mul(a.grad(), 0.5), y);
    return Grads{ops::where(ops::binary(BinaryOp::Eq, y, 0.0), scalar_like(0.0, dv), dv)};
  });
  return y;
}

Tensor logsumexp(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), "logsumexp");
  Tensor m = x.numel() > 0 ? ops::amax(x, dims, true)
                           : zeros(keepdim_shape(x.shape(), d), {.dtype = x.dtype()});
  // An infinite maximum (a row of -inf, or +inf) shifts by 0 instead, as PyTorch.
  m = ops::where(ops::binary(BinaryOp::Eq, ops::unary(UnaryOp::Abs, m), INFINITY),
                 scalar_like(0.0, m), m);
  Tensor kept = ops::add(
      ops::unary(UnaryOp::Log, ops::sum(ops::unary(UnaryOp::Exp, ops::sub(x, m)), dims, true)), m);
  Tensor y = keepdim ? kept : ops::reshape(kept, autograd::util::drop_dims(x.shape(), d));
  if (!autograd::any_requires_grad({x})) return y;
  // d/dx = softmax over the reduced dims = exp(x - logsumexp).
  record("LogsumexpBackward", {x}, {y},
         [d, sx = SavedTensor::input(x), sk = SavedTensor::output(kept)](const BackwardArgs& a) {
           const Tensor x = sx.unpack("LogsumexpBackward");
           const Tensor g = reshape_grad(a.grad(), keepdim_shape(x.shape(), d));
           return Grads{
               ops::mul(g, ops::unary(UnaryOp::Exp, ops::sub(x, sk.unpack("LogsumexpBackward"))))};
         });
  return y;
}

Tensor prod(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  const std::vector<int64_t> d = reduced_dims(dims, x.dim(), "prod");
  Tensor y = ops::prod(x, dims, keepdim);
  if (!autograd::any_requires_grad({x})) return y;
  // d/dx_i = product of the others: y / x_i without zeros; with one zero in a lane only that
  // element gets the product of the rest; with two or more, none.
  record("ProdBackward", {x}, {y}, [d, sx = SavedTensor::input(x)](const BackwardArgs& a) {
    const Tensor x = sx.unpack("ProdBackward");
    const Tensor g = reshape_grad(a.grad(), keepdim_shape(x.shape(), d));
    const Tensor is_zero = ops::binary(BinaryOp::Eq, x, 0.0);
    const Tensor zeros_in_lane = ops::sum(is_zero, d, true);
    const Tensor others =
        ops::prod(ops::where(is_zero, scalar_like(1.0, x), x), d, true);  // excl. zeros
    const Tensor zero = scalar_like(0.0, x);
    const Tensor at_zero = ops::where(ops::binary(BinaryOp::Eq, zeros_in_lane, 1.0), others, zero);
    const Tensor elsewhere =
        ops::where(ops::binary(BinaryOp::Eq, zeros_in_lane, 0.0),
                   ops::div(others, ops::where(is_zero, scalar_like(1.0, x), x)), zero);
    return Grads{ops::mul(g, ops::where(is_zero, at_zero, elsewhere))};
  });
  return y;
}

}  // namespace tessera
