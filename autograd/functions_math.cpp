// Differentiable element-wise maths beyond the basics (sin, cos, log1p, expm1, erf, the exact
// GELU, reciprocal, clamp, silu, swiglu), comparisons (no gradient), where with scalars, and the reductions
// built from them (var, std_dev, logsumexp, prod, cumsum).
#include <cmath>

#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::keepdim_shape;
using autograd::util::mask_as;
using autograd::util::reduced_dims;
using autograd::util::reshape_grad;
using autograd::util::scalar_like;
using Grads = std::vector<Tensor>;

namespace {

// y = op(x) with dx = derivative(g, x).
Tensor unary_of_input(const char* name, UnaryOp op, const Tensor& x,
                      std::function<Tensor(const Tensor& g, const Tensor& x)> derivative) {
  Tensor y = ops::unary(op, x);
  if (!autograd::any_requires_grad({x})) return y;
  record(name, {x}, {y},
         [name, sx = SavedTensor::input(x), derivative = std::move(derivative)](
             const BackwardArgs& a) { return Grads{derivative(a.grad(), sx.unpack(name))}; });
  return y;
}

}  // namespace

Tensor sin(const Tensor& x) {
  return unary_of_input("SinBackward", UnaryOp::Sin, x, [](const Tensor& g, const Tensor& x) {
    return ops::mul(g, ops::unary(UnaryOp::Cos, x));
  });
}
Tensor cos(const Tensor& x) {
  return unary_of_input("CosBackward", UnaryOp::Cos, x, [](const Tensor& g, const Tensor& x) {
    return ops::unary(UnaryOp::Neg, ops::mul(g, ops::unary(UnaryOp::Sin, x)));
  });
}
Tensor log1p(const Tensor& x) {
  return unary_of_input("Log1pBackward", UnaryOp::Log1p, x, [](const Tensor& g, const Tensor& x) {
    return ops::div(g, ops::add(x, 1.0));
  });
}
Tensor expm1(const Tensor& x) {
  // d/dx = exp(x) = expm1(x) + 1, from x (not the rounded output) for accuracy near 0.
  return unary_of_input("Expm1Backward", UnaryOp::Expm1, x, [](const Tensor& g, const Tensor& x) {
    return ops::mul(g, ops::unary(UnaryOp::Exp, x));
  });
}
Tensor erf(const Tensor& x) {
  return unary_of_input("ErfBackward", UnaryOp::Erf, x, [](const Tensor& g, const Tensor& x) {
    // d/dx erf(x) = 2 / sqrt(pi) exp(-x^2)
    const Tensor bell = ops::unary(UnaryOp::Exp, ops::unary(UnaryOp::Neg, ops::unary(UnaryOp::Square, x)));
    return ops::mul(g, ops::mul(bell, 2.0 / std::sqrt(M_PI)));
  });
}
// PyTorch's order of operations, x * 0.5 * (1 + erf(x * (1 / sqrt 2))), so the f32 results
// round alike; the gradient is the composition's, Phi(x) + x phi(x) up to rounding.
Tensor gelu_erf(const Tensor& x) { return x * 0.5 * (1.0 + erf(x * M_SQRT1_2)); }
Tensor reciprocal(const Tensor& x) {
  return unary_of_input(
      "ReciprocalBackward", UnaryOp::Reciprocal, x, [](const Tensor& g, const Tensor& x) {
        return ops::unary(UnaryOp::Neg, ops::div(g, ops::unary(UnaryOp::Square, x)));
      });
}

Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  TESSERA_CHECK(min || max, "clamp: at least one of min and max must be given");
  Tensor y = x;
  if (min) y = ops::binary(BinaryOp::Maximum, y, *min);
  if (max) y = ops::binary(BinaryOp::Minimum, y, *max);
  if (y.is_same(x)) y = raw::clone(x);
  if (!autograd::any_requires_grad({x})) return y;
  // The gradient passes where min <= x <= max (both ends included, as PyTorch).
  record("ClampBackward", {x}, {y}, [sx = SavedTensor::input(x), min, max](const BackwardArgs& a) {
    const Tensor x = sx.unpack("ClampBackward");
    Tensor g = a.grad();
    if (min) g = ops::mul(g, mask_as(ops::binary(BinaryOp::Ge, x, *min), g.dtype()));
    if (max) g = ops::mul(g, mask_as(ops::binary(BinaryOp::Le, x, *max), g.dtype()));
    return Grads{g};
  });
  return y;
}

Tensor silu(const Tensor& x) {
  Tensor s = ops::unary(UnaryOp::Sigmoid, x);
  Tensor y = ops::mul(x, s);
  if (!autograd::any_requires_grad({x})) return y;
  // d(x s)/dx = s (1 + x (1 - s))
  record("SiluBackward", {x}, {y}, [sx = SavedTensor::input(x)](const BackwardArgs& a) {
    const Tensor x = sx.unpack("SiluBackward");
    const Tensor s = ops::unary(UnaryOp::Sigmoid, x);
    const Tensor slope = ops::mul(s, ops::add(ops::mul(x, ops::sub(scalar_like(1.0, s), s)), 1.0));
    return Grads{ops::mul(a.grad(), slope)};
  });
  return y;
}

// swiglu: autograd/functions_fused.cpp (one kernel each way where the device has it).

// ---- comparisons (bool results, no gradient) ----

Tensor eq(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return ops::binary(BinaryOp::Ge, a, b); }
Tensor eq(const Tensor& a, double b) { return ops::binary(BinaryOp::Eq, a, b); }
Tensor ne(const Tensor& a, double b) { return ops::binary(BinaryOp::Ne, a, b); }
Tensor lt(const Tensor& a, double b) { return ops::binary(BinaryOp::Lt, a, b); }
Tensor le(const Tensor& a, double b) { return ops::binary(BinaryOp::Le, a, b); }
Tensor gt(const Tensor& a, double b) { return ops::binary(BinaryOp::Gt, a, b); }
Tensor ge(const Tensor& a, double b) { return ops::binary(BinaryOp::Ge, a, b); }

// ---- where with scalars ----

Tensor where(const Tensor& cond, const Tensor& a, double b) {
  return where(cond, a, scalar_like(b, a));
}
Tensor where(const Tensor& cond, double a, const Tensor& b) {
  return where(cond, scalar_like(a, b), b);
}

// ---- reductions ----

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
  Tensor y = keepdim ? kept : raw::reshape(kept, autograd::util::drop_dims(x.shape(), d));
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

Tensor cumsum(const Tensor& x, int64_t dim) {
  Tensor y = ops::cumsum(x, dim);
  if (!autograd::any_requires_grad({x})) return y;
  // Element i feeds every output j >= i: the gradient is the running sum from the end.
  record("CumsumBackward", {x}, {y}, [dim](const BackwardArgs& a) {
    return Grads{ops::cumsum(a.grad(), dim, /*reverse=*/true)};
  });
  return y;
}

}  // namespace tessera
