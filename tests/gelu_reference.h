// GPT-2's tanh-approximated GELU and its derivative in float64: the reference the GELU
// kernel, autograd and fused-GEMM tests compare against.
#pragma once
#include <cmath>

namespace tessera::test {

inline constexpr double kGeluTanhScale = 0.7978845608028654;  // sqrt(2 / pi)

inline double gelu_tanh(double x) {
  return 0.5 * x * (1 + std::tanh(kGeluTanhScale * (x + 0.044715 * x * x * x)));
}

// d gelu_tanh(x) / dx.
inline double gelu_tanh_grad(double x) {
  const double t = std::tanh(kGeluTanhScale * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kGeluTanhScale * (1 + 3 * 0.044715 * x * x);
}

}  // namespace tessera::test
