// Shared helpers of the kernel tests: random inputs in several memory layouts, host copies
// in float64 over the logical indices, and per-dtype tolerances.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"
#include "tessera/kernels/ops.h"

namespace tessera::test {

inline const std::vector<DType> kFloatDTypes = {DType::f32, DType::f64, DType::f16, DType::bf16};

// Relative tolerance of a result computed in `t` (inputs already representable in t).
inline double tolerance(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 2e-6;
    default: return 1e-2;
  }
}

enum class Layout { Contiguous, Transposed, Stepped, Broadcast };
inline const std::vector<Layout> kLayouts = {Layout::Contiguous, Layout::Transposed,
                                             Layout::Stepped, Layout::Broadcast};
inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Contiguous: return "contiguous";
    case Layout::Transposed: return "transposed";
    case Layout::Stepped: return "stepped";
    default: return "broadcast";
  }
}

// Normal(0,1) values of `shape` in `dtype`, laid out as `layout` asks:
// Transposed = a transposed view of the last two dims, Stepped = every other element of a
// wider last dim, Broadcast = dim 0 expanded from size 1 (stride 0).
inline Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed,
                            Layout layout = Layout::Contiguous, double scale = 1.0) {
  Generator gen(seed);
  auto make = [&](const Shape& s) {
    return raw::to(normal(s, 0.0, scale, {.dtype = DType::f64}, &gen), Device::cpu(), dtype);
  };
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (layout == Layout::Transposed && nd >= 2) {
    Shape s = shape;
    std::swap(s[nd - 1], s[nd - 2]);
    return raw::transpose(make(s), nd - 1, nd - 2);
  }
  if (layout == Layout::Stepped && nd >= 1) {
    Shape s = shape;
    s.back() = 2 * s.back() + 1;
    return raw::slice(make(s), nd - 1, 1, s.back(), 2);
  }
  if (layout == Layout::Broadcast && nd >= 1) {
    Shape s = shape;
    s[0] = 1;
    return raw::expand(make(s), shape);
  }
  return make(shape);
}

// Shapes of at least this many elements take the kernels' threaded paths (kParallelGrain).
// They are checked once per op (f32, contiguous and transposed), not in every combination,
// to keep the suite quick on two cores.
constexpr int64_t kThreadedNumel = 32768;
inline bool skip_large_case(const Shape& shape, DType dt, Layout layout) {
  return shape_numel(shape) >= kThreadedNumel &&
         !(dt == DType::f32 && (layout == Layout::Contiguous || layout == Layout::Transposed));
}

// Values in logical (row-major) order as float64.
inline std::vector<double> host(const Tensor& t) {
  return raw::contiguous(raw::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

// Row-major multi-index of flat index i.
inline std::vector<int64_t> unravel(int64_t i, const Shape& shape) {
  std::vector<int64_t> idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  return idx;
}
inline int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) i = i * shape[d] + idx[d];
  return i;
}

// A reference tensor (f64, contiguous) built from host values.
inline Tensor reference(const std::vector<double>& vals, const Shape& shape) {
  return from_vector(vals, shape, {.dtype = DType::f64});
}

// Expects `got` to match the float64 reference within the dtype's tolerance.
inline void expect_close(const Tensor& got, const std::vector<double>& want, const Shape& shape,
                         double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), shape) << what;
  const double err = ops::max_rel_error(got, reference(want, shape));
  EXPECT_LE(err, tol) << what << " (max rel error " << err << ")";
}

// Runs fn and expects a tessera::Error whose message contains every one of `parts`.
template <class Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a tessera::Error mentioning " << parts.front();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg;
  }
}

}  // namespace tessera::test
