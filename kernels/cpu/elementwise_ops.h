// The scalar math of every UnaryOp / BinaryOp, written once on the compute type
// (compute_t<T>) and shared by the CPU kernels. Each op is a compile-time constant
// so the loops that apply it specialise and vectorise.
#pragma once
#include <cmath>
#include <type_traits>
#include <utility>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/fast_math.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {

constexpr int kNumUnaryOps = static_cast<int>(UnaryOp::Erf) + 1;
constexpr int kNumBinaryOps = static_cast<int>(BinaryOp::GeluBackward) + 1;

constexpr bool unary_returns_bool(UnaryOp op) { return op == UnaryOp::LogicalNot; }
constexpr bool binary_returns_bool(BinaryOp op) {
  return op == BinaryOp::Eq || op == BinaryOp::Ne || op == BinaryOp::Lt || op == BinaryOp::Le ||
         op == BinaryOp::Gt || op == BinaryOp::Ge || op == BinaryOp::LogicalAnd ||
         op == BinaryOp::LogicalOr;
}

constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCubic = 0.044715;

// GELU (tanh form): gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// 1 + tanh(u) and 1 - tanh(u) are computed from e = exp(2u) as 2e/(e+1) and 2/(e+1), so
// both stay accurate in the tails where tanh(u) is close to -1 or 1 (1 - tanh^2 computed
// from tanh itself would lose all its digits there). float uses the vectorisable exp.
// Past 2u = 80 tanh(u) is 1 in every float type; `saturated` reports that, so the gradient
// takes its limit 1 there (and 0 where 1 + tanh(u) underflows) instead of inf * 0 = NaN.
constexpr double kGeluSaturation = 80;  // exp(80) is finite in float

template <class C>
inline void gelu_parts(C x, C& one_plus_t, C& one_minus_t, bool& saturated) {
  C two_u = C(2 * kSqrt2OverPi) * (x + C(kGeluCubic) * x * x * x);
  saturated = two_u > C(kGeluSaturation);
  two_u = saturated ? C(kGeluSaturation) : two_u;
  C e;
  if constexpr (std::is_same_v<C, float>) e = fast_exp(two_u);
  else e = std::exp(two_u);
  const C r = C(1) / (e + C(1));
  one_plus_t = C(2) * (e * r);
  one_minus_t = C(2) * r;
}

template <class C>
inline C gelu_forward(C x) {
  C opt, omt;
  bool saturated;
  gelu_parts(x, opt, omt, saturated);
  return opt == C(0) ? C(0) : C(0.5) * x * opt;  // the limit 0 at -inf, not -inf * 0
}

template <class C>
inline C gelu_grad(C x, C dy) {
  C opt, omt;
  bool saturated;
  gelu_parts(x, opt, omt, saturated);
  // 0.5 x sech^2(u) du/dx: below 1e-30 of the result wherever either factor vanishes.
  const bool tail_vanishes = saturated || opt == C(0);
  const C du = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCubic) * x * x);
  const C tail = tail_vanishes ? C(0) : C(0.5) * x * (opt * omt) * du;
  return dy * (C(0.5) * opt + tail);
}

template <UnaryOp op, class C>
inline auto apply_unary(C x) {
  using std::abs;
  if constexpr (op == UnaryOp::Neg) return C(-x);
  else if constexpr (op == UnaryOp::Exp) return C(std::exp(x));
  else if constexpr (op == UnaryOp::Log) return C(std::log(x));
  else if constexpr (op == UnaryOp::Sqrt) return C(std::sqrt(x));
  else if constexpr (op == UnaryOp::Rsqrt) return C(C(1) / std::sqrt(x));
  else if constexpr (op == UnaryOp::Abs) return C(x < C(0) ? -x : x);
  else if constexpr (op == UnaryOp::Tanh) return C(std::tanh(x));
  else if constexpr (op == UnaryOp::Sigmoid) return C(C(1) / (C(1) + std::exp(-x)));
  else if constexpr (op == UnaryOp::Relu) return C(x > C(0) ? x : C(0));
  else if constexpr (op == UnaryOp::Gelu) {
    if constexpr (std::is_floating_point_v<C>) return gelu_forward(x);
    else return C(gelu_forward(double(x)));
  }
  else if constexpr (op == UnaryOp::Sin) return C(std::sin(x));
  else if constexpr (op == UnaryOp::Cos) return C(std::cos(x));
  else if constexpr (op == UnaryOp::Square) return C(x * x);
  else if constexpr (op == UnaryOp::Reciprocal) return C(C(1) / x);
  else if constexpr (op == UnaryOp::Sign) return C((C(0) < x) - (x < C(0)));
  else if constexpr (op == UnaryOp::Floor) return C(std::floor(x));
  else if constexpr (op == UnaryOp::Ceil) return C(std::ceil(x));
  else if constexpr (op == UnaryOp::Round) return C(std::nearbyint(x));  // half to even
  else if constexpr (op == UnaryOp::LogicalNot) return !(x != C(0));
  else if constexpr (op == UnaryOp::Log1p) return C(std::log1p(x));
  else if constexpr (op == UnaryOp::Expm1) return C(std::expm1(x));
  else if constexpr (op == UnaryOp::Erf) return C(std::erf(x));
}

template <class C>
inline C int_pow(C base, C exp) {
  if (exp < 0) return base == 1 ? 1 : (base == -1 ? ((exp & 1) ? -1 : 1) : 0);
  C result = 1;
  while (exp > 0) {
    if (exp & 1) result *= base;
    base *= base;
    exp >>= 1;
  }
  return result;
}

template <BinaryOp op, class C>
inline auto apply_binary(C a, C b) {
  if constexpr (op == BinaryOp::Add) return C(a + b);
  else if constexpr (op == BinaryOp::Sub) return C(a - b);
  else if constexpr (op == BinaryOp::Mul) return C(a * b);
  else if constexpr (op == BinaryOp::Div) {
    if constexpr (std::is_floating_point_v<C>) return C(a / b);
    else return C(b == 0 ? 0 : a / b);  // the front-end divides integers in float
  } else if constexpr (op == BinaryOp::Pow) {
    if constexpr (std::is_floating_point_v<C>) return C(std::pow(a, b));
    else return int_pow(a, b);
  }
  // max/min propagate NaN, as PyTorch's maximum/minimum do
  else if constexpr (op == BinaryOp::Maximum) return C(a != a ? a : (b != b ? b : (a > b ? a : b)));
  else if constexpr (op == BinaryOp::Minimum) return C(a != a ? a : (b != b ? b : (a < b ? a : b)));
  else if constexpr (op == BinaryOp::Eq) return a == b;
  else if constexpr (op == BinaryOp::Ne) return a != b;
  else if constexpr (op == BinaryOp::Lt) return a < b;
  else if constexpr (op == BinaryOp::Le) return a <= b;
  else if constexpr (op == BinaryOp::Gt) return a > b;
  else if constexpr (op == BinaryOp::Ge) return a >= b;
  else if constexpr (op == BinaryOp::LogicalAnd) return (a != C(0)) && (b != C(0));
  else if constexpr (op == BinaryOp::LogicalOr) return (a != C(0)) || (b != C(0));
  else if constexpr (op == BinaryOp::GeluBackward) {
    if constexpr (std::is_floating_point_v<C>) return gelu_grad(a, b);
    else return C(gelu_grad(double(a), double(b)));
  }
}

}  // namespace tessera::cpu
