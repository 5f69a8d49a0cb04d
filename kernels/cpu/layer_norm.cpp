// CPU layer norm over the last dim, forward and backward.
//
// Forward, per row: a first mean, then the mean and variance of x - that mean (two passes
// over a row held in cache: more accurate than E[x^2] - mean^2 at the same cost), then one
// fused write of (x - mean) * rstd * w + b. Backward, per row:
//   xhat = (x - mean) * rstd,  g = dy * w
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
// while dw += dy * xhat and db += dy are summed over rows in per-thread buffers that are
// added in thread order (deterministic for a given thread count).
//
// A row with a large mean (1e3 over C = 4096) summed in f32 loses the mean's low digits, and
// every xhat of the row was off by the same amount (worse than PyTorch's f32). So the first
// mean is only a shift: the second pass sums d = x - shift as well as d^2 (d is of the
// size of the row's spread, so its sum keeps f32 precision relative to it), the mean is
// shift + mean(d), the variance mean(d^2) - mean(d)^2 (the corrected two-pass algorithm),
// and x - mean is taken as d - mean(d). The backward does the same with the saved mean
// (rounded to f32 for non-f64 inputs, the table's contract) as its shift, in the pass that
// sums g and g * xhat anyway.
#include <algorithm>
#include <cmath>
#include <vector>

#include <omp.h>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"
#include "tessera/kernels/cpu/row_stats.h"

namespace tessera::cpu {
namespace {

// A row's statistics: x - mean is (x - shift) - offset (see the top).
template <class C>
struct RowMoments {
  C shift, offset, rstd;
};

// The moments of the n elements row[0], row[step], ...
template <class T>
RowMoments<compute_t<T>> row_moments(const T* row, int64_t n, int64_t step, double eps) {
  using C = compute_t<T>;
  C sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += convert<C>(row[i * step]);
  const C shift = sum / C(n);
  C sum_d = 0, sum_dd = 0;
#pragma omp simd reduction(+ : sum_d, sum_dd)
  for (int64_t i = 0; i < n; ++i) {
    const C d = convert<C>(row[i * step]) - shift;
    sum_d += d;
    sum_dd += d * d;
  }
  const C offset = sum_d / C(n);
  const C variance = std::max(C(0), sum_dd / C(n) - offset * offset);
  return {shift, offset, C(1) / std::sqrt(variance + C(eps))};
}

template <class T>
const T* optional_data(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& out,
                const Tensor& mean, const Tensor& rstd) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      T* op = static_cast<T*>(out.raw_data());
      const T* wp = optional_data<T>(w);
      const T* bp = optional_data<T>(b);
      const int64_t ws = w.defined() ? w.strides()[0] : 0, bs = b.defined() ? b.strides()[0] : 0;
      using S = stat_t<T>;
      S* mp = static_cast<S*>(mean.raw_data());
      S* rp = static_cast<S*>(rstd.raw_data());
      const Shape ms = row_stat_strides(mean), rs = row_stat_strides(rstd);
      const int64_t last = x.dim() - 1;
      for_each_lane<4>(x.shape(), last, {&x.strides(), &out.strides(), &ms, &rs},
                       [&](std::array<int64_t, 4> off, int64_t n, const std::array<int64_t, 4>& st) {
        const std::array<int64_t, 4> data_steps{st[0], st[1], wp ? ws : 1, bp ? bs : 1};
        with_unit_stride(data_steps, [&](auto unit) {
          const int64_t sx = unit ? 1 : st[0], so = unit ? 1 : st[1];
          const int64_t sw = unit ? 1 : ws, sb = unit ? 1 : bs;
          const T* in = xp + off[0];
          T* o = op + off[1];
          const RowMoments<C> m = row_moments(in, n, sx, eps);
          mp[off[2]] = static_cast<S>(m.shift + m.offset);
          rp[off[3]] = static_cast<S>(m.rstd);
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) {
            C v = ((convert<C>(in[i * sx]) - m.shift) - m.offset) * m.rstd;
            if (wp) v *= convert<C>(wp[i * sw]);
            if (bp) v += convert<C>(bp[i * sb]);
            o[i * so] = convert<T>(v);
          }
        });
      });
    } else {
      TESSERA_FAIL("layer_norm: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                         const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* xp = static_cast<const T*>(x.raw_data());
      const T* gp = static_cast<const T*>(dy.raw_data());
      T* dxp = static_cast<T*>(dx.raw_data());
      const T* wp = optional_data<T>(w);
      const int64_t ws = w.defined() ? w.strides()[0] : 1;
      using S = stat_t<T>;
      const S* mp = static_cast<const S*>(mean.raw_data());
      const S* rp = static_cast<const S*>(rstd.raw_data());
      const Shape ms = row_stat_strides(mean), rs = row_stat_strides(rstd);
      const int64_t last = x.dim() - 1;
      const LaneIndexer<5> rows(x.shape(), last,
                                {&x.strides(), &dy.strides(), &dx.strides(), &ms, &rs});
      const int64_t n = rows.len;
      const bool want_dw = dw.defined(), want_db = db.defined();
      const int threads = rows.lanes * n >= kParallelGrain ? omp_get_max_threads() : 1;
      // Per-thread partial sums of dw and db, in the compute type.
      std::vector<C> partial_dw(want_dw ? threads * n : 0, C(0)), partial_db(want_db ? threads * n : 0, C(0));
#pragma omp parallel num_threads(threads)
      {
        const int tid = omp_get_thread_num();
        C* pdw = want_dw ? partial_dw.data() + tid * n : nullptr;
        C* pdb = want_db ? partial_db.data() + tid * n : nullptr;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows.lanes; ++row) {
          const auto off = rows.offsets(row);
          const std::array<int64_t, 4> steps{rows.steps[0], rows.steps[1], rows.steps[2], ws};
          with_unit_stride(steps, [&](auto unit) {
            const int64_t sx = unit ? 1 : rows.steps[0], sg = unit ? 1 : rows.steps[1];
            const int64_t sd = unit ? 1 : rows.steps[2], sw = unit ? 1 : ws;
            const T* xr = xp + off[0];
            const T* gr = gp + off[1];
            T* dr = dxp + off[2];
            // d = x - saved: mean(d) is what rounding took off the saved mean, and
            // sum(g * d) - mean(d) sum(g) is sum(g * xhat) / rstd.
            const C saved = mp[off[3]], r = rp[off[4]];
            C sum_g = 0, sum_d = 0, sum_gd = 0;
#pragma omp simd reduction(+ : sum_g, sum_d, sum_gd)
            for (int64_t i = 0; i < n; ++i) {
              const C d = convert<C>(xr[i * sx]) - saved;
              const C g = convert<C>(gr[i * sg]) * (wp ? convert<C>(wp[i * sw]) : C(1));
              sum_g += g;
              sum_d += d;
              sum_gd += g * d;
            }
            const C offset = sum_d / C(n);
            const C mean_g = sum_g / C(n), mean_gx = r * (sum_gd - offset * sum_g) / C(n);
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
              const C xhat = ((convert<C>(xr[i * sx]) - saved) - offset) * r;
              const C dyv = convert<C>(gr[i * sg]);
              const C g = dyv * (wp ? convert<C>(wp[i * sw]) : C(1));
              dr[i * sd] = convert<T>(C(r * (g - mean_g - xhat * mean_gx)));
              if (pdw) pdw[i] += dyv * xhat;
              if (pdb) pdb[i] += dyv;
            }
          });
        }
      }
      auto accumulate = [&](const Tensor& target, const std::vector<C>& partial) {
        T* tp = static_cast<T*>(target.raw_data());
        const int64_t ts = target.strides()[0];
        for (int64_t i = 0; i < n; ++i) {
          C acc = convert<C>(tp[i * ts]);
          for (int t = 0; t < threads; ++t) acc += partial[t * n + i];
          tp[i * ts] = convert<T>(acc);
        }
      };
      if (want_dw) accumulate(dw, partial_dw);
      if (want_db) accumulate(db, partial_db);
    } else {
      TESSERA_FAIL("layer_norm_backward: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.layer_norm = layer_norm;
  t.layer_norm_backward = layer_norm_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
