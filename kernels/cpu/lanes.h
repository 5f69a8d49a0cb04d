// Walking the 1-D "lanes" of a strided tensor along one dimension, and the
// arithmetic type each storage type is computed in.
//
// for_each_lane<N>(shape, dim, {strides...}, fn) calls fn(offsets, len, steps) once per
// combination of the indices of every dimension except `dim`: offsets[k] is operand k's
// element offset of the lane's first element, len = shape[dim], steps[k] its stride along
// dim. Lanes run in parallel under OpenMP when there is enough work. Softmax, layer norm,
// cross-entropy, arg-reductions and index_add are all "one lane at a time" computations.
#pragma once
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cpu/strided.h"

namespace tessera::cpu {

// f16/bf16 are read into float, computed there and rounded once on store; f64 stays f64;
// integers compute in int64 (bool in int64 too, so that e.g. true + true is true).
template <class T>
using compute_t = std::conditional_t<
    std::is_same_v<T, double>, double,
    std::conditional_t<std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                           std::is_same_v<T, BFloat16>,
                       float, int64_t>>;

template <class T>
constexpr bool is_float_type_v = std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                                 std::is_same_v<T, BFloat16>;

// Calls fn(std::integral_constant<E, value>{}) for the runtime enum `value`.
template <class E, int Count, class Fn>
void with_enum_constant(E value, Fn&& fn) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((static_cast<int>(value) == I ? (fn(std::integral_constant<E, static_cast<E>(I)>{}), 0) : 0),
     ...);
  }(std::make_integer_sequence<int, Count>{});
}
template <int N, class Fn>
void for_each_lane(const Shape& shape, int64_t dim, const std::array<const Shape*, N>& strides,
                   Fn&& fn) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  Shape outer;
  std::array<Shape, N> outer_strides;
  std::array<int64_t, N> steps{};
  for (int64_t d = 0; d < ndim; ++d) {
    for (int k = 0; k < N; ++k) {
      if (d == dim) steps[k] = (*strides[k])[d];
    }
    if (d == dim) continue;
    outer.push_back(shape[d]);
    for (int k = 0; k < N; ++k) outer_strides[k].push_back((*strides[k])[d]);
  }
  const int64_t len = ndim == 0 ? 1 : shape[dim];
  const int64_t lanes = shape_numel(outer);
  if (lanes == 0 || len == 0) return;
  const int64_t od = static_cast<int64_t>(outer.size());
  const bool parallel = lanes > 1 && lanes * len >= kParallelGrain;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t lane = 0; lane < lanes; ++lane) {
    std::array<int64_t, N> off{};
    int64_t rem = lane;
    for (int64_t d = od - 1; d >= 0; --d) {
      const int64_t i = rem % outer[d];
      rem /= outer[d];
      for (int k = 0; k < N; ++k) off[k] += i * outer_strides[k][d];
    }
    fn(off, len, steps);
  }
}

}  // namespace tessera::cpu
