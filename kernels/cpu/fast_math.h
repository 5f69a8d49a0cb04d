// Vectorisable float exp for the hot loops (softmax, GELU, cross-entropy).
//
// std::exp is an opaque library call, so a loop over it runs one element at a time.
// This is plain arithmetic (range reduction + polynomial, exponent by bit
// manipulation), so the compiler turns `#pragma omp simd` loops over them into vector
// code. fast_exp is within ~1e-7 relative of exp (it saturates at ~2.4e38 instead of inf and
// returns 0 below the normal range).
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace tessera::cpu {

inline float fast_exp(float x) {
  // Below this exp(x) is under the smallest normal float: return an exact 0 (so masked
  // -inf logits give exactly zero probability) instead of a denormal.
  constexpr float kLow = -87.3365447504f;
  const bool underflow = x < kLow;
  // Clamp to the range where the result is a finite normal float.
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < kLow ? kLow : x;
  // exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2].
  // Round to nearest by adding and removing 1.5 * 2^23 (floorf would not vectorise).
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693359375f;  // ln2 split in a high part exact in float ...
  r = r - n * -2.12194440e-4f;     // ... and the low remainder (Cody-Waite)
  // Minimax polynomial for exp(r) on that interval (Cephes expf coefficients).
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n built in the exponent bits (a bit cast, not memcpy, so the loop stays vectorisable).
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

// exp in a kernel's compute type: the vectorisable one for float, the exact one for double.
template <class C>
inline C exp_c(C x) {
  if constexpr (std::is_same_v<C, float>) return fast_exp(x);
  else return std::exp(x);
}

}  // namespace tessera::cpu
