// map_elements<O, Ts...>(out, f, {&in...}): out[i] = f(in0[i], in1[i], ...) over same-shaped
// strided tensors (inputs may be broadcast with stride 0). Rows whose operands are all
// unit-stride run as plain indexed loops the compiler vectorises; the rest walk strides.
#pragma once
#include <array>
#include <tuple>
#include <utility>

#include "tessera/kernels/cpu/strided.h"

namespace tessera::cpu {

namespace detail {
template <class O, class... Ts, class F, size_t... K>
void map_elements_impl(std::index_sequence<K...>, const Tensor& out, F& f,
                       const std::array<const Tensor*, sizeof...(Ts)>& in) {
  constexpr int N = 1 + sizeof...(Ts);
  O* o = static_cast<O*>(out.raw_data());
  const std::tuple<const Ts*...> base{static_cast<const Ts*>(in[K]->raw_data())...};
  for_each_row<N>(out.shape(), {&out.strides(), &in[K]->strides()...},
                  [&](std::array<int64_t, N> off, int64_t n, const std::array<int64_t, N>& st) {
                    O* op = o + off[0];
                    const std::tuple<const Ts*...> ip{std::get<K>(base) + off[K + 1]...};
                    if (st[0] == 1 && ((st[K + 1] == 1) && ...)) {
#pragma omp simd
                      for (int64_t i = 0; i < n; ++i) op[i] = f(std::get<K>(ip)[i]...);
                    } else {
                      for (int64_t i = 0; i < n; ++i) {
                        op[i * st[0]] = f(std::get<K>(ip)[i * st[K + 1]]...);
                      }
                    }
                  });
}
}  // namespace detail

template <class O, class... Ts, class F>
void map_elements(const Tensor& out, F f, const std::array<const Tensor*, sizeof...(Ts)>& in) {
  detail::map_elements_impl<O, Ts...>(std::index_sequence_for<Ts...>{}, out, f, in);
}

// True when every element of t is the same memory location (a broadcast scalar).
inline bool is_broadcast_scalar(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.shape()[d] != 1 && t.strides()[d] != 0) return false;
  }
  return true;
}

}  // namespace tessera::cpu
