// The exact GELU and its slope, one element at a time, for the fused kernels of the CPU
// (kernels/cpu/fused_elementwise.cpp) and of CUDA (kernels/cuda/fused_elementwise.cu):
//   gelu(x)  = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
//   gelu'(x) = Phi(x) + x phi(x),   phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
// (PyTorch's gelu(approximate='none'), Hugging Face's "gelu": BERT, DistilBERT). A is the
// arithmetic type: float for 16- and 32-bit tensors, double for f64.
#pragma once
#include <cmath>
#include <type_traits>

#include "tessera/core/half.h"

namespace tessera {

template <class A>
TESSERA_HD A gelu_erf_cdf(A x) {
  if constexpr (std::is_same_v<A, float>)
    return 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  else
    return 0.5 * (1.0 + erf(x * 0.70710678118654752440));
}

// In PyTorch's order, (x * 0.5) * (1 + erf(x * (1 / sqrt 2))), each step rounded to A: in f32
// the bits of autograd::gelu_erf's composition (and of PyTorch's f32 GELU) where erff is the
// same function; 16-bit tensors round once, at the end, instead of after every step.
template <class A>
TESSERA_HD A gelu_erf_value(A x) {
  if constexpr (std::is_same_v<A, float>)
    return (x * 0.5f) * (1.0f + erff(x * 0.70710678118654752f));
  else
    return (x * 0.5) * (1.0 + erf(x * 0.70710678118654752440));
}

template <class A>
TESSERA_HD A gelu_erf_slope(A x) {
  if constexpr (std::is_same_v<A, float>)
    return gelu_erf_cdf(x) + x * (expf(-0.5f * x * x) * 0.39894228040143268f);
  else
    return gelu_erf_cdf(x) + x * (exp(-0.5 * x * x) * 0.39894228040143267794);
}

}  // namespace tessera
