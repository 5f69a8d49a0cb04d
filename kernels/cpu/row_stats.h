// What the CPU row norms (layer_norm.cpp, rms_norm.cpp) and the rotary kernels (rope.cpp) share
// about their saved per-row statistics and tables.
#pragma once
#include <type_traits>

#include "tessera/core/tensor.h"

namespace tessera::cpu {

// The dtype of saved row statistics (mean, rstd) and of rotary tables: f64 for f64 inputs, f32
// for the others (the kernel table's contract).
template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Strides of a [...] per-row tensor (mean/rstd) extended with a 0 for the normalised dim.
inline Shape row_stat_strides(const Tensor& stat) {
  Shape s = stat.strides();
  s.push_back(0);
  return s;
}

}  // namespace tessera::cpu
