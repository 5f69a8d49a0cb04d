// Differentiable element-wise functions: arithmetic (broadcasting), unary maths (relu, sigmoid
// and tanh among them), pow, maximum/minimum, where, masked_fill, dropout. (GELU, SiLU, SwiGLU:
// autograd/functions_activation.cpp.)
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::mask_as;
using autograd::util::scalar_like;
using autograd::util::sum_to_shape;
using Grads = std::vector<Tensor>;

// ---- tensor ⊗ tensor ----

Tensor operator+(const Tensor& a, const Tensor& b) {
  Tensor y = ops::add(a, b);
  record("AddBackward", {a, b}, {y}, [sa = a.shape(), sb = b.shape()](const BackwardArgs& x) {
    return Grads{x.needs(0) ? sum_to_shape(x.grad(), sa) : Tensor(),
                 x.needs(1) ? sum_to_shape(x.grad(), sb) : Tensor()};
  });
  return y;
}

Tensor operator-(const Tensor& a, const Tensor& b) {
  Tensor y = ops::sub(a, b);
  record("SubBackward", {a, b}, {y}, [sa = a.shape(), sb = b.shape()](const BackwardArgs& x) {
    return Grads{x.needs(0) ? sum_to_shape(x.grad(), sa) : Tensor(),
                 x.needs(1) ? sum_to_shape(ops::unary(UnaryOp::Neg, x.grad()), sb) : Tensor()};
  });
  return y;
}

Tensor operator*(const Tensor& a, const Tensor& b) {
  Tensor y = ops::mul(a, b);
  if (!autograd::any_requires_grad({a, b})) return y;
  // Each side's gradient needs the other side's values only.
  SavedTensor saved_a = b.requires_grad() ? SavedTensor::input(a) : SavedTensor();
  SavedTensor saved_b = a.requires_grad() ? SavedTensor::input(b) : SavedTensor();
  record("MulBackward", {a, b}, {y},
         [saved_a, saved_b, sa = a.shape(), sb = b.shape()](const BackwardArgs& x) {
           return Grads{
               x.needs(0) ? sum_to_shape(ops::mul(x.grad(), saved_b.unpack("MulBackward")), sa)
                          : Tensor(),
               x.needs(1) ? sum_to_shape(ops::mul(x.grad(), saved_a.unpack("MulBackward")), sb)
                          : Tensor()};
         });
  return y;
}

Tensor operator/(const Tensor& a, const Tensor& b) {
  Tensor y = ops::div(a, b);
  if (!autograd::any_requires_grad({a, b})) return y;
  SavedTensor saved_b = SavedTensor::input(b);
  SavedTensor saved_y = b.requires_grad() ? SavedTensor::output(y) : SavedTensor();
  record("DivBackward", {a, b}, {y},
         [saved_b, saved_y, sa = a.shape(), sb = b.shape()](const BackwardArgs& x) {
           const Tensor b = saved_b.unpack("DivBackward");
           const Tensor grad_a =
               ops::div(x.grad(), b);  // d(a/b)/db = -(a/b)/b, so db = -grad_a * y
           Tensor grad_b;
           if (x.needs(1))
             grad_b = ops::unary(UnaryOp::Neg, ops::mul(grad_a, saved_y.unpack("DivBackward")));
           return Grads{x.needs(0) ? sum_to_shape(grad_a, sa) : Tensor(),
                        x.needs(1) ? sum_to_shape(grad_b, sb) : Tensor()};
         });
  return y;
}

// ---- tensor ⊗ scalar ----

// y = a + s or a - s: the gradient passes through unchanged.
static Tensor shift(const char* name, const Tensor& a, Tensor y) {
  record(name, {a}, {y}, [](const BackwardArgs& x) { return Grads{x.grad()}; });
  return y;
}
// y = a * s (also a / s = a * (1/s) in the backward): the gradient is scaled.
static Tensor scale(const char* name, const Tensor& a, Tensor y, double factor) {
  record(name, {a}, {y},
         [factor](const BackwardArgs& x) { return Grads{ops::mul(x.grad(), factor)}; });
  return y;
}

Tensor operator+(const Tensor& a, double b) {
  return shift("AddScalarBackward", a, ops::add(a, b));
}
Tensor operator-(const Tensor& a, double b) {
  return shift("SubScalarBackward", a, ops::binary(BinaryOp::Sub, a, b));
}
Tensor operator*(const Tensor& a, double b) {
  return scale("MulScalarBackward", a, ops::mul(a, b), b);
}
Tensor operator/(const Tensor& a, double b) {
  return scale("DivScalarBackward", a, ops::binary(BinaryOp::Div, a, b), 1.0 / b);
}
Tensor operator+(double a, const Tensor& b) { return b + a; }
Tensor operator*(double a, const Tensor& b) { return b * a; }
Tensor operator-(double a, const Tensor& b) {
  return scale("RsubScalarBackward", b, ops::sub(scalar_like(a, b), b), -1.0);
}
Tensor operator/(double a, const Tensor& b) {
  Tensor y = ops::div(scalar_like(a, b), b);
  if (!autograd::any_requires_grad({b})) return y;
  // d(a/b)/db = -y/b
  record(
      "RdivScalarBackward", {b}, {y},
      [saved_b = SavedTensor::input(b), saved_y = SavedTensor::output(y)](const BackwardArgs& x) {
        Tensor t = ops::div(ops::mul(x.grad(), saved_y.unpack("RdivScalarBackward")),
                            saved_b.unpack("RdivScalarBackward"));
        return Grads{ops::unary(UnaryOp::Neg, t)};
      });
  return y;
}

// ---- unary ----

namespace {
enum class Saves { Nothing, Input, Output };

// y = op(x) with dx = derivative(g, x or y). `saves` says which the derivative reads.
Tensor unary_function(const char* name, UnaryOp op, const Tensor& x, Saves saves,
                      std::function<Tensor(const Tensor& g, const Tensor& saved)> derivative) {
  Tensor y = ops::unary(op, x);
  if (!autograd::any_requires_grad({x})) return y;
  SavedTensor saved = saves == Saves::Input    ? SavedTensor::input(x)
                      : saves == Saves::Output ? SavedTensor::output(y)
                                               : SavedTensor();
  record(name, {x}, {y}, [name, saved, derivative = std::move(derivative)](const BackwardArgs& a) {
    return Grads{derivative(a.grad(), saved.unpack(name))};
  });
  return y;
}
}  // namespace

Tensor neg(const Tensor& x) {
  return unary_function("NegBackward", UnaryOp::Neg, x, Saves::Nothing,
                        [](const Tensor& g, const Tensor&) { return ops::unary(UnaryOp::Neg, g); });
}
Tensor operator-(const Tensor& x) { return neg(x); }

Tensor exp(const Tensor& x) {
  return unary_function("ExpBackward", UnaryOp::Exp, x, Saves::Output,
                        [](const Tensor& g, const Tensor& y) { return ops::mul(g, y); });
}
Tensor log(const Tensor& x) {
  return unary_function("LogBackward", UnaryOp::Log, x, Saves::Input,
                        [](const Tensor& g, const Tensor& x) { return ops::div(g, x); });
}
Tensor sqrt(const Tensor& x) {
  return unary_function(
      "SqrtBackward", UnaryOp::Sqrt, x, Saves::Output,
      [](const Tensor& g, const Tensor& y) { return ops::div(ops::mul(g, 0.5), y); });
}
Tensor rsqrt(const Tensor& x) {
  // d(x^-1/2)/dx = -1/2 x^-3/2 = -1/2 y^3
  return unary_function(
      "RsqrtBackward", UnaryOp::Rsqrt, x, Saves::Output, [](const Tensor& g, const Tensor& y) {
        return ops::mul(ops::mul(g, ops::mul(ops::unary(UnaryOp::Square, y), y)), -0.5);
      });
}
Tensor tanh(const Tensor& x) {
  return unary_function(
      "TanhBackward", UnaryOp::Tanh, x, Saves::Output, [](const Tensor& g, const Tensor& y) {
        // dy (1 - y^2) for f16/bf16 in f32, rounded once as PyTorch's tanh_backward: the three
        // ops in the dtype itself rounded three times.
        const DType dt = y.dtype();
        const bool half = dt == DType::f16 || dt == DType::bf16;
        const Tensor yc = half ? ops::to(y, y.device(), DType::f32) : y;
        const Tensor gc = half ? ops::to(g, g.device(), DType::f32) : g;
        const Tensor d =
            ops::mul(gc, ops::sub(scalar_like(1.0, yc), ops::unary(UnaryOp::Square, yc)));
        return half ? ops::to(d, d.device(), dt) : d;
      });
}
Tensor sigmoid(const Tensor& x) {
  return unary_function("SigmoidBackward", UnaryOp::Sigmoid, x, Saves::Output,
                        [](const Tensor& g, const Tensor& y) {
                          return ops::mul(ops::mul(g, y), ops::sub(scalar_like(1.0, y), y));
                        });
}
Tensor relu(const Tensor& x) {
  return unary_function("ReluBackward", UnaryOp::Relu, x, Saves::Output,
                        [](const Tensor& g, const Tensor& y) {
                          return ops::mul(g, mask_as(ops::binary(BinaryOp::Gt, y, 0.0), g.dtype()));
                        });
}
Tensor abs(const Tensor& x) {
  return unary_function(
      "AbsBackward", UnaryOp::Abs, x, Saves::Input,
      [](const Tensor& g, const Tensor& x) { return ops::mul(g, ops::unary(UnaryOp::Sign, x)); });
}
Tensor square(const Tensor& x) {
  return unary_function(
      "SquareBackward", UnaryOp::Square, x, Saves::Input,
      [](const Tensor& g, const Tensor& x) { return ops::mul(ops::mul(g, x), 2.0); });
}

// ---- pow, maximum, minimum ----

Tensor pow(const Tensor& base, double exponent) {
  Tensor y = ops::binary(BinaryOp::Pow, base, exponent);
  record("PowScalarBackward", {base}, {y},
         [saved = SavedTensor::input(base), exponent](const BackwardArgs& a) {
           const Tensor x = saved.unpack("PowScalarBackward");
           return Grads{ops::mul(ops::mul(a.grad(), ops::binary(BinaryOp::Pow, x, exponent - 1.0)),
                                 exponent)};
         });
  return y;
}

Tensor pow(const Tensor& base, const Tensor& exponent) {
  Tensor y = ops::binary(BinaryOp::Pow, base, exponent);
  if (!autograd::any_requires_grad({base, exponent})) return y;
  record("PowBackward", {base, exponent}, {y},
         [sb = SavedTensor::input(base), se = SavedTensor::input(exponent),
          sy = SavedTensor::output(y), base_shape = base.shape(),
          exp_shape = exponent.shape()](const BackwardArgs& a) {
           const Tensor b = sb.unpack("PowBackward"), e = se.unpack("PowBackward");
           Tensor grad_base, grad_exp;
           if (a.needs(0)) {  // e * b^(e-1)
             Tensor e_minus_1 = ops::binary(BinaryOp::Sub, e, 1.0);
             grad_base = sum_to_shape(
                 ops::mul(ops::mul(a.grad(), e), ops::binary(BinaryOp::Pow, b, e_minus_1)),
                 base_shape);
           }
           if (a.needs(1)) {  // b^e * ln(b)
             grad_exp = sum_to_shape(ops::mul(ops::mul(a.grad(), sy.unpack("PowBackward")),
                                              ops::unary(UnaryOp::Log, b)),
                                     exp_shape);
           }
           return Grads{grad_base, grad_exp};
         });
  return y;
}

// The share of the gradient that goes to `a` of max(a, b) (or min): 1 where a wins,
// 1/2 on ties, 0 where b wins; b gets the rest.
static Tensor extremum(const char* name, BinaryOp op, BinaryOp a_wins, const Tensor& a,
                       const Tensor& b) {
  Tensor y = ops::binary(op, a, b);
  if (!autograd::any_requires_grad({a, b})) return y;
  record(name, {a, b}, {y},
         [name, a_wins, sa = SavedTensor::input(a), sb = SavedTensor::input(b), a_shape = a.shape(),
          b_shape = b.shape()](const BackwardArgs& x) {
           const Tensor va = sa.unpack(name), vb = sb.unpack(name);
           const DType dt = x.grad().dtype();
           Tensor share_a = ops::add(mask_as(ops::binary(a_wins, va, vb), dt),
                                     ops::mul(mask_as(ops::binary(BinaryOp::Eq, va, vb), dt), 0.5));
           Tensor grad_a = ops::mul(x.grad(), share_a);
           return Grads{x.needs(0) ? sum_to_shape(grad_a, a_shape) : Tensor(),
                        x.needs(1) ? sum_to_shape(ops::sub(x.grad(), grad_a), b_shape) : Tensor()};
         });
  return y;
}
Tensor maximum(const Tensor& a, const Tensor& b) {
  return extremum("MaximumBackward", BinaryOp::Maximum, BinaryOp::Gt, a, b);
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return extremum("MinimumBackward", BinaryOp::Minimum, BinaryOp::Lt, a, b);
}

// ---- selection ----

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor y = ops::where(cond, a, b);
  if (!autograd::any_requires_grad({a, b})) return y;
  record("WhereBackward", {cond, a, b}, {y},
         [saved_cond = SavedTensor::input(cond), sa = a.shape(),
          sb = b.shape()](const BackwardArgs& x) {
           const Tensor c = saved_cond.unpack("WhereBackward");
           const Tensor zero = scalar_like(0.0, x.grad());
           return Grads{Tensor(),
                        x.needs(1) ? sum_to_shape(ops::where(c, x.grad(), zero), sa) : Tensor(),
                        x.needs(2) ? sum_to_shape(ops::where(c, zero, x.grad()), sb) : Tensor()};
         });
  return y;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  Tensor y = ops::masked_fill(x, mask, value);
  record("MaskedFillBackward", {x, mask}, {y},
         [saved_mask = SavedTensor::input(mask), sx = x.shape()](const BackwardArgs& a) {
           return Grads{
               sum_to_shape(
                   ops::masked_fill(a.grad(), saved_mask.unpack("MaskedFillBackward"), 0.0), sx),
               Tensor()};
         });
  return y;
}

// ---- dropout ----

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  TESSERA_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  // Where the device has the fused entries (dropout_takes): one pass that draws the mask from
  // the numbers rand() would have drawn here (the same blocks reserved) and multiplies, and one
  // pass back that draws it again: the composition's bits, no mask kept.
  if (dropout_takes(x)) {
    Generator& g = gen ? *gen : default_generator();
    const DropoutDraw draw{p, g.seed(), g.reserve((static_cast<uint64_t>(x.numel()) + 3) / 4)};
    const FusedKernelTable& fused = fused_kernel_table(x.device().type);
    Tensor y = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
    if (x.numel() > 0) fused.dropout_forward(x, draw, y);
    if (!autograd::any_requires_grad({x})) return y;
    record("DropoutBackward", {x}, {y},
           [draw, backward = fused.dropout_backward, device = x.device(),
            dtype = x.dtype()](const BackwardArgs& a) {
             const Tensor dy = ops::contiguous(ops::to(a.grad(), device, dtype));
             Tensor dx = empty(dy.shape(), {.dtype = dy.dtype(), .device = dy.device()});
             if (dx.numel() > 0) backward(dy, draw, dx);
             return Grads{dx};
           });
    return y;
  }
  // mask = keep / (1 - p) in x's dtype; the same mask scales the gradient.
  Tensor uniform = rand(x.shape(), {.dtype = DType::f32, .device = x.device()}, gen);
  Tensor keep = mask_as(ops::binary(BinaryOp::Ge, uniform, p), x.dtype());
  Tensor mask = p < 1.0 ? ops::mul(keep, 1.0 / (1.0 - p)) : keep;
  Tensor y = ops::mul(x, mask);
  record("DropoutBackward", {x}, {y},
         [mask](const BackwardArgs& a) { return Grads{ops::mul(a.grad(), mask)}; });
  return y;
}

}  // namespace tessera
