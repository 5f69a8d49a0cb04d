// Differentiable element-wise maths beyond the basics (sin, cos, log1p, expm1, erf, reciprocal,
// clamp), comparisons (no gradient) and where with scalars. (Activations, the exact GELU among
// them: autograd/functions_activation.cpp; var, std_dev, logsumexp, prod:
// autograd/functions_reduce.cpp; cumsum: autograd/functions_select.cpp.)
#include <cmath>

#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::mask_as;
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
    const Tensor bell =
        ops::unary(UnaryOp::Exp, ops::unary(UnaryOp::Neg, ops::unary(UnaryOp::Square, x)));
    return ops::mul(g, ops::mul(bell, 2.0 / std::sqrt(M_PI)));
  });
}
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
  if (y.is_same(x)) y = ops::clone(x);
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

}  // namespace tessera
