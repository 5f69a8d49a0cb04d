// The CPU kernels core itself needs: fill, strided copy with conversion, and
// the Philox-based random fills.
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/core/philox.h"
#include "tessera/kernels/cpu/strided.h"

namespace tessera::cpu {
namespace {

void fill(const Tensor& out, double value) {
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T v = convert<T>(value);
    T* p = static_cast<T*>(out.raw_data());
    for_each_row<1>(out.shape(), {&out.strides()},
                    [&](std::array<int64_t, 1> off, int64_t n, const std::array<int64_t, 1>& st) {
                      for (int64_t i = 0; i < n; ++i) p[off[0] + i * st[0]] = v;
                    });
  });
}

void copy(const Tensor& dst, const Tensor& src) {
  visit_dtype(dst.dtype(), [&](auto dtag) {
    using D = decltype(dtag);
    visit_dtype(src.dtype(), [&](auto stag) {
      using S = decltype(stag);
      D* d = static_cast<D*>(dst.raw_data());
      const S* s = static_cast<const S*>(src.raw_data());
      for_each_row<2>(dst.shape(), {&dst.strides(), &src.strides()},
                      [&](std::array<int64_t, 2> off, int64_t n, const std::array<int64_t, 2>& st) {
                        D* dp = d + off[0];
                        const S* sp = s + off[1];
                        if (st[0] == 1 && st[1] == 1) {
                          for (int64_t i = 0; i < n; ++i) dp[i] = convert<D>(sp[i]);
                        } else {
                          for (int64_t i = 0; i < n; ++i) dp[i * st[0]] = convert<D>(sp[i * st[1]]);
                        }
                      });
    });
  });
}

void random(const Tensor& out, RandomKind kind, uint64_t seed, uint64_t offset, double a, double b) {
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(out.raw_data());
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t u = static_cast<uint64_t>(i);
      if (kind == RandomKind::Uniform) {
        p[i] = convert<T>(a + (b - a) * philox_uniform_at(seed, offset, u));
      } else if (kind == RandomKind::Normal) {
        p[i] = convert<T>(a + b * philox_normal_at(seed, offset, u));
      } else {
        p[i] = convert<T>(philox_randint_at(seed, offset, u, static_cast<int64_t>(a),
                                            static_cast<int64_t>(b)));
      }
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.fill = fill;
  t.copy = copy;
  t.random = random;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
