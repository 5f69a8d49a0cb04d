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

#include "tessera/kernels/cpu/strided.h"

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
// The lanes of `shape` along `dim` for N operands: offsets(lane) gives each operand's element
// offset of the lane's first element, steps[k] its stride along dim.
template <int N>
struct LaneIndexer {
  Shape outer;
  std::array<Shape, N> outer_strides;
  std::array<int64_t, N> steps{};
  int64_t len = 1, lanes = 1;

  LaneIndexer(const Shape& shape, int64_t dim, const std::array<const Shape*, N>& strides) {
    const int64_t ndim = static_cast<int64_t>(shape.size());
    for (int64_t d = 0; d < ndim; ++d) {
      if (d == dim) {
        for (int k = 0; k < N; ++k) steps[k] = (*strides[k])[d];
        continue;
      }
      outer.push_back(shape[d]);
      for (int k = 0; k < N; ++k) outer_strides[k].push_back((*strides[k])[d]);
    }
    len = ndim == 0 ? 1 : shape[dim];
    lanes = shape_numel(outer);
  }

  std::array<int64_t, N> offsets(int64_t lane) const {
    std::array<int64_t, N> off{};
    for (int64_t d = static_cast<int64_t>(outer.size()) - 1; d >= 0; --d) {
      const int64_t i = lane % outer[d];
      lane /= outer[d];
      for (int k = 0; k < N; ++k) off[k] += i * outer_strides[k][d];
    }
    return off;
  }
};

template <int N, class Fn>
void for_each_lane(const Shape& shape, int64_t dim, const std::array<const Shape*, N>& strides,
                   Fn&& fn) {
  const LaneIndexer<N> lanes(shape, dim, strides);
  if (lanes.lanes == 0 || lanes.len == 0) return;
  const bool parallel = lanes.lanes > 1 && lanes.lanes * lanes.len >= kParallelGrain;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t lane = 0; lane < lanes.lanes; ++lane) fn(lanes.offsets(lane), lanes.len, lanes.steps);
}

// Calls fn(std::true_type{}) when every step is 1, else fn(std::false_type{}): a lane
// function written once with `const int64_t s = unit ? 1 : step;` gets a unit-stride
// instantiation the compiler vectorises and a strided one for everything else.
template <size_t N, class Fn>
decltype(auto) with_unit_stride(const std::array<int64_t, N>& steps, Fn&& fn) {
  bool unit = true;
  for (int64_t s : steps) unit = unit && s == 1;
  if (unit) return fn(std::true_type{});
  return fn(std::false_type{});
}

}  // namespace tessera::cpu
