// Walking several same-shaped strided tensors on the CPU.
//
// for_each_row<N>(shape, {strides...}, fn) merges dimensions that are laid out
// contiguously for every operand, then calls
//   fn(offsets, n, inner_strides)
// once per row of the last (merged) dimension (a long row may come as several consecutive
// pieces, so that threads share it): offsets[k] is operand k's element
// offset of the row's first element, n the row length, inner_strides[k] its step.
// Rows (or pieces of long rows) run in parallel under OpenMP when there is enough work.
#pragma once
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::cpu {

constexpr int64_t kParallelGrain = 32768;  // elements below which threads cost more than they save

template <int N>
struct StridedLayout {
  std::vector<int64_t> shape;
  std::array<std::vector<int64_t>, N> strides;
};

template <int N>
StridedLayout<N> coalesce(const Shape& shape, const std::array<const Shape*, N>& strides) {
  StridedLayout<N> out;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !out.shape.empty();
    for (int k = 0; k < N && merge; ++k) {
      merge = out.strides[k].back() == (*strides[k])[d] * shape[d];
    }
    if (merge) {
      out.shape.back() *= shape[d];
      for (int k = 0; k < N; ++k) out.strides[k].back() = (*strides[k])[d];
    } else {
      out.shape.push_back(shape[d]);
      for (int k = 0; k < N; ++k) out.strides[k].push_back((*strides[k])[d]);
    }
  }
  if (out.shape.empty()) {
    out.shape.push_back(1);
    for (int k = 0; k < N; ++k) out.strides[k].push_back(0);
  }
  return out;
}

template <int N, class Fn>
void for_each_row(const Shape& shape, const std::array<const Shape*, N>& strides, Fn&& fn) {
  if (shape_numel(shape) == 0) return;
  const StridedLayout<N> L = coalesce<N>(shape, strides);
  const int64_t ndim = static_cast<int64_t>(L.shape.size());
  const int64_t inner = L.shape.back();
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < ndim; ++d) rows *= L.shape[d];
  std::array<int64_t, N> inner_strides;
  for (int k = 0; k < N; ++k) inner_strides[k] = L.strides[k].back();

  // Few long rows (a contiguous tensor coalesces into one) are cut into pieces so that every
  // thread gets work; fn only ever sees a run of consecutive elements of one row.
  const bool parallel = rows * inner >= kParallelGrain;
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  const int64_t pieces = rows >= 2 * threads ? 1 : std::max<int64_t>(1, std::min(2 * threads, inner / 4096));
  const int64_t piece_len = (inner + pieces - 1) / pieces;
  auto run_piece = [&](int64_t job) {
    const int64_t r = job / pieces, p = job % pieces;
    std::array<int64_t, N> off{};
    int64_t rem = r;
    for (int64_t d = ndim - 2; d >= 0; --d) {
      const int64_t i = rem % L.shape[d];
      rem /= L.shape[d];
      for (int k = 0; k < N; ++k) off[k] += i * L.strides[k][d];
    }
    const int64_t start = p * piece_len, len = std::min(piece_len, inner - start);
    if (len <= 0) return;
    for (int k = 0; k < N; ++k) off[k] += start * inner_strides[k];
    fn(off, len, inner_strides);
  };
  const int64_t jobs = rows * pieces;
#pragma omp parallel for schedule(static) if (parallel && jobs > 1)
  for (int64_t job = 0; job < jobs; ++job) run_piece(job);
}

// Element-wise convenience: fn(offsets) for every element.
template <int N, class Fn>
void for_each_element(const Shape& shape, const std::array<const Shape*, N>& strides, Fn&& fn) {
  for_each_row<N>(shape, strides,
                  [&](std::array<int64_t, N> off, int64_t n, const std::array<int64_t, N>& st) {
                    for (int64_t i = 0; i < n; ++i) {
                      fn(off);
                      for (int k = 0; k < N; ++k) off[k] += st[k];
                    }
                  });
}

// Converts between any two element types the way the casts do (float via f32/f64).
template <class To, class From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, Half> || std::is_same_v<To, BFloat16>) {
    return To(static_cast<float>(v));
  } else if constexpr (std::is_same_v<From, Half> || std::is_same_v<From, BFloat16>) {
    return static_cast<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

}  // namespace tessera::cpu
