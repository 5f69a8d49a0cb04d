// CPU RMSNorm over the last dim, forward and backward.
//
// RMSNorm, per row of n elements:
//   rstd = 1 / sqrt(mean(x^2) + eps),  y = x * rstd * w
//   g = dy * w,  dx = rstd * (g - x * rstd^2 * mean(g * x)),  dw += dy * x * rstd
// dw is summed over rows in per-thread buffers added in thread order (deterministic for a
// given thread count), as layer norm's.
#include <cmath>
#include <vector>

#include <omp.h>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"
#include "tessera/kernels/cpu/row_stats.h"

namespace tessera::cpu {
namespace {

void rms_norm(const Tensor& x, const Tensor& w, double eps, const Tensor& out, const Tensor& rstd) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      using S = stat_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      T* op = static_cast<T*>(out.raw_data());
      const T* wp = w.defined() ? static_cast<const T*>(w.raw_data()) : nullptr;
      const int64_t ws = w.defined() ? w.strides()[0] : 1;
      S* rp = static_cast<S*>(rstd.raw_data());
      const Shape rs = row_stat_strides(rstd);
      for_each_lane<3>(
          x.shape(), x.dim() - 1, {&x.strides(), &out.strides(), &rs},
          [&](std::array<int64_t, 3> off, int64_t n, const std::array<int64_t, 3>& st) {
            with_unit_stride(std::array<int64_t, 3>{st[0], st[1], ws}, [&](auto unit) {
              const int64_t sx = unit ? 1 : st[0], so = unit ? 1 : st[1], sw = unit ? 1 : ws;
              const T* in = xp + off[0];
              T* o = op + off[1];
              C sq = 0;
#pragma omp simd reduction(+ : sq)
              for (int64_t i = 0; i < n; ++i) {
                const C v = convert<C>(in[i * sx]);
                sq += v * v;
              }
              const C r = C(1) / std::sqrt(sq / C(n) + C(eps));
              rp[off[2]] = static_cast<S>(r);
#pragma omp simd
              for (int64_t i = 0; i < n; ++i) {
                C v = convert<C>(in[i * sx]) * r;
                if (wp) v *= convert<C>(wp[i * sw]);
                o[i * so] = convert<T>(v);
              }
            });
          });
    } else {
      TESSERA_FAIL("rms_norm: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

void rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                       const Tensor& dx, const Tensor& dw) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      using S = stat_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      const T* gp = static_cast<const T*>(dy.raw_data());
      T* dxp = static_cast<T*>(dx.raw_data());
      const T* wp = w.defined() ? static_cast<const T*>(w.raw_data()) : nullptr;
      const int64_t ws = w.defined() ? w.strides()[0] : 1;
      const S* rp = static_cast<const S*>(rstd.raw_data());
      const Shape rs = row_stat_strides(rstd);
      const LaneIndexer<4> rows(x.shape(), x.dim() - 1,
                                {&x.strides(), &dy.strides(), &dx.strides(), &rs});
      const int64_t n = rows.len;
      const bool want_dw = dw.defined();
      const int threads = rows.lanes * n >= kParallelGrain ? omp_get_max_threads() : 1;
      std::vector<C> partial_dw(want_dw ? threads * n : 0, C(0));
#pragma omp parallel num_threads(threads)
      {
        C* pdw = want_dw ? partial_dw.data() + omp_get_thread_num() * n : nullptr;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows.lanes; ++row) {
          const auto off = rows.offsets(row);
          const std::array<int64_t, 4> steps{rows.steps[0], rows.steps[1], rows.steps[2], ws};
          with_unit_stride(steps, [&](auto unit) {
            const int64_t sx = unit ? 1 : steps[0], sg = unit ? 1 : steps[1];
            const int64_t sd = unit ? 1 : steps[2], sw = unit ? 1 : ws;
            const T* xr = xp + off[0];
            const T* gr = gp + off[1];
            T* dr = dxp + off[2];
            const C r = rp[off[3]];
            C sum_gx = 0;
#pragma omp simd reduction(+ : sum_gx)
            for (int64_t i = 0; i < n; ++i) {
              const C g = convert<C>(gr[i * sg]) * (wp ? convert<C>(wp[i * sw]) : C(1));
              sum_gx += g * convert<C>(xr[i * sx]);
            }
            const C k = r * r * sum_gx / C(n);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              const C xv = convert<C>(xr[i * sx]), dyv = convert<C>(gr[i * sg]);
              const C g = dyv * (wp ? convert<C>(wp[i * sw]) : C(1));
              dr[i * sd] = convert<T>(C(r * (g - xv * k)));
              if (pdw) pdw[i] += dyv * xv * r;
            }
          });
        }
      }
      if (want_dw) {
        T* tp = static_cast<T*>(dw.raw_data());
        const int64_t ts = dw.strides()[0];
        for (int64_t i = 0; i < n; ++i) {
          C acc = convert<C>(tp[i * ts]);
          for (int t = 0; t < threads; ++t) acc += partial_dw[t * n + i];
          tp[i * ts] = convert<T>(acc);
        }
      }
    } else {
      TESSERA_FAIL("rms_norm_backward: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.rms_norm = rms_norm;
  t.rms_norm_backward = rms_norm_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
