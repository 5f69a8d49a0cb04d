// CPU cross-entropy over rows of logits [N, V], fused: one row's logsumexp and its target
// logit give its loss without materialising log_softmax; the backward writes
// scale * (softmax - onehot) in one pass per row.
//
// Targets are validated before any parallel work (an exception cannot leave an OpenMP
// region); row losses are summed in row order in double, so the result does not depend on
// the thread count.
#include <cmath>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/fast_math.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

// Targets as int64 host values; errors name the first bad one.
std::vector<int64_t> read_targets(const Tensor& targets, int64_t V, int64_t ignore_index) {
  std::vector<int64_t> t(targets.numel());
  visit_dtype(targets.dtype(), [&](auto tag) {
    using I = decltype(tag);
    if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
      const I* p = static_cast<const I*>(targets.raw_data());
      const int64_t s = targets.strides()[0];
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int64_t>(p[i * s]);
    } else {
      TESSERA_FAIL("cross_entropy: targets must be int32 or int64, got ", dtype_name(targets.dtype()));
    }
  });
  for (size_t i = 0; i < t.size(); ++i) {
    TESSERA_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < V), "cross_entropy: target ", t[i],
                  " at row ", i, " is out of range for ", V, " classes (ignore_index ",
                  ignore_index, ")");
  }
  return t;
}

// max and sum of exp(x - max) of one row.
template <class T, class C, bool kUnit>
inline void row_logsumexp_parts(const T* row, int64_t n, int64_t step, C& m, C& sum) {
  const int64_t s = kUnit ? 1 : step;
  m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, convert<C>(row[i * s]));
  sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += exp_c(C(convert<C>(row[i * s]) - m));
}

void cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                   const Tensor& loss, const Tensor& count) {
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  const std::vector<int64_t> t = read_targets(targets, V, ignore_index);
  std::vector<double> row_loss(N, 0.0);
  visit_dtype(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* lp = static_cast<const T*>(logits.raw_data());
      const int64_t rs = logits.strides()[0], cs = logits.strides()[1];
#pragma omp parallel for schedule(static) if (N * V >= kParallelGrain)
      for (int64_t r = 0; r < N; ++r) {
        if (t[r] == ignore_index) continue;
        const T* row = lp + r * rs;
        C m, sum;
        if (cs == 1) row_logsumexp_parts<T, C, true>(row, V, 1, m, sum);
        else row_logsumexp_parts<T, C, false>(row, V, cs, m, sum);
        row_loss[r] = static_cast<double>(m) + std::log(static_cast<double>(sum)) -
                      static_cast<double>(convert<C>(row[t[r] * cs]));
      }
    } else {
      TESSERA_FAIL("cross_entropy: logits must be a float type, got ", dtype_name(logits.dtype()));
    }
  });
  double total = 0;
  int64_t used = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (t[r] == ignore_index) continue;
    total += row_loss[r];
    ++used;
  }
  *static_cast<float*>(loss.raw_data()) = static_cast<float>(total);
  *static_cast<int64_t*>(count.raw_data()) = used;
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                            double scale, const Tensor& dlogits) {
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  const std::vector<int64_t> t = read_targets(targets, V, ignore_index);
  visit_dtype(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (is_float_type_v<T>) {
      using C = compute_t<T>;
      const T* lp = static_cast<const T*>(logits.raw_data());
      T* dp = static_cast<T*>(dlogits.raw_data());
      const int64_t rs = logits.strides()[0], cs = logits.strides()[1];
#pragma omp parallel for schedule(static) if (N * V >= kParallelGrain)
      for (int64_t r = 0; r < N; ++r) {
        T* drow = dp + r * V;
        if (t[r] == ignore_index) {
          for (int64_t i = 0; i < V; ++i) drow[i] = convert<T>(C(0));
          continue;
        }
        const T* row = lp + r * rs;
        auto write = [&](auto unit) {
          const int64_t s = unit ? 1 : cs;
          C m, sum;
          row_logsumexp_parts<T, C, decltype(unit)::value>(row, V, cs, m, sum);
          const C k = C(scale) / sum;
          const int64_t target = t[r];
#pragma omp simd
          for (int64_t i = 0; i < V; ++i) {
            const C onehot = i == target ? C(scale) : C(0);
            drow[i] = convert<T>(C(exp_c(C(convert<C>(row[i * s]) - m)) * k - onehot));
          }
        };
        if (cs == 1) write(std::true_type{});
        else write(std::false_type{});
      }
    } else {
      TESSERA_FAIL("cross_entropy_backward: logits must be a float type, got ",
                   dtype_name(logits.dtype()));
    }
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.cross_entropy = cross_entropy;
  t.cross_entropy_backward = cross_entropy_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
