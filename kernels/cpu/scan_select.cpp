// CPU running sums (cumsum) and top-k selection along one dimension, one lane at a time.
//
// cumsum accumulates in f64 for float types (a long running f32 sum would drift by the
// lane length times f32's rounding) and in int64 for integers. topk partially sorts the
// positions of a lane: O(n + k log k) per lane.
#include <algorithm>
#include <numeric>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

template <class T>
using scan_t = std::conditional_t<is_float_type_v<T>, double, int64_t>;

void cumsum(const Tensor& x, int64_t dim, bool reverse, const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = scan_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    T* op = static_cast<T*>(out.raw_data());
    for_each_lane<2>(x.shape(), dim, {&x.strides(), &out.strides()},
                     [&](std::array<int64_t, 2> off, int64_t n, const std::array<int64_t, 2>& st) {
                       A acc = A(0);
                       for (int64_t j = 0; j < n; ++j) {
                         const int64_t i = reverse ? n - 1 - j : j;
                         acc += static_cast<A>(convert<compute_t<T>>(xp[off[0] + i * st[0]]));
                         op[off[1] + i * st[1]] = convert<T>(static_cast<compute_t<T>>(acc));
                       }
                     });
  });
}

// Orders positions of one lane: by value (NaN first when largest, as the maximum), then index.
template <class A>
struct TopkOrder {
  const std::vector<A>* values;
  bool largest;
  bool operator()(int64_t a, int64_t b) const {
    const A va = (*values)[a], vb = (*values)[b];
    const bool na = va != va, nb = vb != vb;
    if (na || nb) {
      if (na && nb) return a < b;
      return largest ? na : nb;  // NaN is the largest value
    }
    if (va != vb) return largest ? va > vb : va < vb;
    return a < b;
  }
};

void topk(const Tensor& x, int64_t k, int64_t dim, bool largest, const Tensor& values,
          const Tensor& indices) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = compute_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    T* vp = static_cast<T*>(values.raw_data());
    int64_t* ip = static_cast<int64_t*>(indices.raw_data());
    const LaneIndexer<3> lanes(x.shape(), dim,
                               {&x.strides(), &values.strides(), &indices.strides()});
    const int64_t n = lanes.len;
#pragma omp parallel for schedule(static) if (lanes.lanes > 1 && lanes.lanes * n >= kParallelGrain)
    for (int64_t lane = 0; lane < lanes.lanes; ++lane) {
      const auto off = lanes.offsets(lane);
      std::vector<A> lane_values(n);
      for (int64_t i = 0; i < n; ++i) lane_values[i] = convert<A>(xp[off[0] + i * lanes.steps[0]]);
      std::vector<int64_t> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        TopkOrder<A>{&lane_values, largest});
      for (int64_t j = 0; j < k; ++j) {
        vp[off[1] + j * lanes.steps[1]] = xp[off[0] + order[j] * lanes.steps[0]];
        ip[off[2] + j * lanes.steps[2]] = order[j];
      }
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.cumsum = cumsum;
  t.topk = topk;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
