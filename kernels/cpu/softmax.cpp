// CPU softmax / log_softmax along any dim, and their backward.
//
// One lane (the elements along dim) at a time: max, sum of exp(x - max), then the
// normalised write — three passes over a row that stays in cache. Unit-stride lanes get an
// instantiation with literal stride 1 whose loops vectorise (fast_exp for float).
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/fast_math.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

void softmax(const Tensor& x, int64_t dim, bool log, const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      T* op = static_cast<T*>(out.raw_data());
      for_each_lane<2>(x.shape(), dim, {&x.strides(), &out.strides()},
                       [&](std::array<int64_t, 2> off, int64_t n, const std::array<int64_t, 2>& st) {
        with_unit_stride(st, [&](auto unit) {
          const int64_t sx = unit ? 1 : st[0], so = unit ? 1 : st[1];
          const T* in = xp + off[0];
          T* o = op + off[1];
          C m = -INFINITY;
#pragma omp simd reduction(max : m)
          for (int64_t i = 0; i < n; ++i) m = std::max(m, convert<C>(in[i * sx]));
          C sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < n; ++i) sum += exp_c(C(convert<C>(in[i * sx]) - m));
          if (log) {
            const C shift = m + std::log(sum);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) o[i * so] = convert<T>(C(convert<C>(in[i * sx]) - shift));
          } else {
            const C inv = C(1) / sum;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              o[i * so] = convert<T>(C(exp_c(C(convert<C>(in[i * sx]) - m)) * inv));
            }
          }
        });
      });
    } else {
      TESSERA_FAIL("softmax: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

// softmax:     dx = y * (dy - sum(dy * y))
// log_softmax: dx = dy - exp(y) * sum(dy)
void softmax_backward(const Tensor& y, const Tensor& dy, int64_t dim, bool log, const Tensor& dx) {
  visit_dtype(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* yp = static_cast<const T*>(y.raw_data());
      const T* gp = static_cast<const T*>(dy.raw_data());
      T* dp = static_cast<T*>(dx.raw_data());
      for_each_lane<3>(y.shape(), dim, {&y.strides(), &dy.strides(), &dx.strides()},
                       [&](std::array<int64_t, 3> off, int64_t n, const std::array<int64_t, 3>& st) {
        with_unit_stride(st, [&](auto unit) {
          const int64_t sy = unit ? 1 : st[0], sg = unit ? 1 : st[1], sd = unit ? 1 : st[2];
          const T* yr = yp + off[0];
          const T* gr = gp + off[1];
          T* dr = dp + off[2];
          C dot = 0;
          if (log) {
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < n; ++i) dot += convert<C>(gr[i * sg]);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              dr[i * sd] = convert<T>(C(convert<C>(gr[i * sg]) - exp_c(convert<C>(yr[i * sy])) * dot));
            }
          } else {
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < n; ++i) dot += convert<C>(gr[i * sg]) * convert<C>(yr[i * sy]);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              dr[i * sd] = convert<T>(C(convert<C>(yr[i * sy]) * (convert<C>(gr[i * sg]) - dot)));
            }
          }
        });
      });
    } else {
      TESSERA_FAIL("softmax_backward: dtype ", dtype_name(y.dtype()), " is not a float type");
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.softmax = softmax;
  t.softmax_backward = softmax_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
