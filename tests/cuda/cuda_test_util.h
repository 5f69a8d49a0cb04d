// Helpers for the CUDA tests: skip without a GPU, random host inputs, device copies,
// poisoned outputs, float64 comparisons with dtype-dependent tolerances.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera::cuda_test {

#define TESSERA_REQUIRE_GPU()                                                   \
  do {                                                                          \
    if (::tessera::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";  \
  } while (0)

inline KernelTable& gpu() { return kernel_table(DeviceType::CUDA); }
inline Device dev() { return Device::cuda(0); }

// Random normal values on the host, rounded to `dtype` (so references see exactly the inputs).
inline Tensor host_randn(const Shape& shape, DType dtype = DType::f32, double mean = 0.0,
                         double std = 1.0) {
  Tensor t = normal(shape, mean, std, {.dtype = DType::f64});
  return raw::to(t, Device::cpu(), dtype);
}
inline Tensor host_uniform(const Shape& shape, double lo, double hi, DType dtype = DType::f32) {
  Tensor t = uniform(shape, lo, hi, {.dtype = DType::f64});
  return raw::to(t, Device::cpu(), dtype);
}
inline Tensor to_gpu(const Tensor& t) { return raw::to(t, dev(), t.dtype()); }

// Any tensor's values (any device, dtype or layout) in row-major order, as doubles.
inline std::vector<double> host_values(const Tensor& t) {
  return raw::contiguous(raw::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

// t as a leaf that records gradients.
inline Tensor requiring_grad(Tensor t) {
  t.requires_grad_(true);
  return t;
}

// A device tensor filled with NaN (floats) or a sentinel (integers): every element the kernel
// fails to write stays visibly wrong.
inline Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, {.dtype = dtype, .device = dev()});
  gpu().fill(t, is_floating(dtype) ? NAN : -77.0);
  return t;
}

inline std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

inline double tolerance(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1e-2;
    default: return 0.0;
  }
}

// max |got - ref| / max |ref| (the norm-style relative error), NaN anywhere fails.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& ref,
                         double rtol, const char* what = "") {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0, max_err = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i]) && !std::isnan(ref[i]))
        << what << ": element " << i << " is NaN (unwritten?), expected " << ref[i];
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    if (std::isfinite(ref[i])) {
      const double e = std::fabs(got[i] - ref[i]);
      if (e > max_err) {
        max_err = e;
        worst = i;
      }
    } else {
      EXPECT_EQ(got[i], ref[i]) << what << ": element " << i;
    }
  }
  const double scale = std::max(max_ref, 1e-30);
  EXPECT_LE(max_err / scale, rtol) << what << ": worst element " << worst << " got "
                                   << (got.empty() ? 0 : got[worst]) << " expected "
                                   << (ref.empty() ? 0 : ref[worst]);
}

// c[z] = a[z or 0] @ b[z or 0] in float64; a: [*, M, K], b: [*, K, N] contiguous values.
inline std::vector<double> ref_matmul(const std::vector<double>& a, const std::vector<double>& b,
                               int64_t batch, int64_t M, int64_t K, int64_t N, bool a_bcast,
                               bool b_bcast) {
  std::vector<double> c(batch * M * N, 0.0);
  for (int64_t z = 0; z < batch; ++z)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const double av = a[(a_bcast ? 0 : z) * M * K + i * K + k];
        const double* brow = &b[(b_bcast ? 0 : z) * K * N + k * N];
        double* crow = &c[(z * M + i) * N];
        for (int64_t j = 0; j < N; ++j) crow[j] += av * brow[j];
      }
  return c;
}

// max |got - ref| / max(max |ref|, scale); infinite when got holds a NaN (an element left
// unwritten). `scale` measures a reference that is exactly 0 against the size of the quantity.
inline double max_rel_error(const std::vector<double>& got, const std::vector<double>& ref,
                            double scale = 0) {
  if (got.size() != ref.size()) return INFINITY;
  double max_ref = scale, max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_err = std::max(max_err, std::fabs(got[i] - ref[i]));
  }
  return max_err / std::max(max_ref, 1e-30);
}

// Compares, prints the figure and fails with it when over tol.
inline void expect_within(const std::vector<double>& got, const std::vector<double>& ref, double tol,
                          const std::string& what, double scale = 0) {
  const double err = max_rel_error(got, ref, scale);
  std::printf("  %-58s max rel error %.3e (tol %.1e)\n", what.c_str(), err, tol);
  EXPECT_LE(err, tol) << what << ": max rel error " << err << " over the tolerance " << tol;
}

}  // namespace tessera::cuda_test
