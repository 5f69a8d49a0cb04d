// gradcheck: the tape's gradients against central finite differences in float64.
//
// The function's outputs are reduced to a scalar L = Σ_k Σ(out_k · w_k) with fixed random
// weights w_k (so every output element matters, each differently). The analytic gradient
// of L w.r.t. every input that requires grad comes from backward(); the numeric one
// perturbs each element of that input in place (through its strides, so non-contiguous
// inputs are checked as they are) by ±eps with grad mode off.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"

namespace tessera::testing {

using MultiFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
using SingleFn = std::function<Tensor(const std::vector<Tensor>&)>;

// The message of the tessera::Error that fn raises ("" when it raises none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct GradcheckOptions {
  double eps = 1e-6;
  double max_relative_error = 1e-6;
};

// A float64 CPU tensor of N(0, 1) values (or uniform in [low, high) when low < high).
inline Tensor random_f64(const Shape& shape, uint64_t seed, double low = 0.0, double high = 0.0) {
  Generator gen(seed);
  TensorOptions opts{.dtype = DType::f64};
  return low < high ? uniform(shape, low, high, opts, &gen) : randn(shape, opts, &gen);
}

// A leaf that requires grad.
inline Tensor leaf(Tensor t) {
  t = t.detach();
  t.requires_grad_(true);
  return t;
}

// A non-contiguous float64 leaf: the transpose of a stored [.., b, a] tensor.
inline Tensor transposed_leaf(const Shape& shape, uint64_t seed, double low = 0.0,
                              double high = 0.0) {
  Shape stored = shape;
  std::swap(stored[stored.size() - 1], stored[stored.size() - 2]);
  Tensor t = leaf(random_f64(stored, seed, low, high).transpose(-1, -2));
  EXPECT_FALSE(t.is_contiguous());
  return t;
}

namespace detail {

// Storage offsets (relative to raw_data) of every element of t, in row-major order.
inline std::vector<int64_t> element_offsets(const Tensor& t) {
  std::vector<int64_t> offsets;
  Shape index(t.dim(), 0);
  for (int64_t n = 0; n < t.numel(); ++n) {
    int64_t offset = 0;
    for (int64_t d = 0; d < t.dim(); ++d) offset += index[d] * t.stride(d);
    offsets.push_back(offset);
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (++index[d] < t.size(d)) break;
      index[d] = 0;
    }
  }
  return offsets;
}

inline std::vector<double> values(const Tensor& t) {
  return ops::contiguous(t.to(DType::f64)).to_vector<double>();
}

inline double weighted_sum(const std::vector<Tensor>& outs,
                           const std::vector<std::vector<double>>& weights) {
  double total = 0.0;
  for (size_t k = 0; k < outs.size(); ++k) {
    std::vector<double> v = values(outs[k]);
    for (size_t i = 0; i < v.size(); ++i) total += v[i] * weights[k][i];
  }
  return total;
}

}  // namespace detail

// The analytic gradients of `fn` against finite differences of `numeric_fn` (the same
// function unless a test supplies a float64 reference for an op whose forward rounds).
inline ::testing::AssertionResult gradcheck_against(const MultiFn& fn, const MultiFn& numeric_fn,
                                                    const std::vector<Tensor>& inputs,
                                                    GradcheckOptions opt = {}) {
  for (const Tensor& in : inputs) {
    if (in.defined() && in.requires_grad()) {
      if (in.dtype() != DType::f64 || !in.is_leaf())
        return ::testing::AssertionFailure() << "gradcheck needs float64 leaves";
    }
  }
  autograd::zero_grad(inputs);
  // Analytic: backward of L with the weights as the outputs' gradients.
  std::vector<Tensor> outs = fn(inputs);
  std::vector<std::vector<double>> weights;
  std::vector<Tensor> weight_tensors;
  for (size_t k = 0; k < outs.size(); ++k) {
    Tensor w = random_f64(outs[k].shape(), 1000 + k).to(outs[k].dtype());
    weight_tensors.push_back(w);
    weights.push_back(detail::values(w));
  }
  autograd::backward(outs, weight_tensors);

  std::ostringstream report;
  bool ok = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (!in.defined() || !in.requires_grad()) continue;
    Tensor analytic = in.grad();
    if (!analytic.defined()) analytic = zeros(in.shape(), {.dtype = DType::f64});
    if (analytic.shape() != in.shape() || analytic.dtype() != in.dtype()) {
      return ::testing::AssertionFailure()
             << "input " << i << ": gradient has shape " << shape_str(analytic.shape()) << " dtype "
             << dtype_name(analytic.dtype()) << ", input has " << shape_str(in.shape());
    }
    const std::vector<double> a = detail::values(analytic);
    std::vector<double> numeric;
    {
      autograd::NoGradGuard no_grad;
      double* base = static_cast<double*>(in.raw_data());
      for (int64_t offset : detail::element_offsets(in)) {
        const double original = base[offset];
        base[offset] = original + opt.eps;
        const double plus = detail::weighted_sum(numeric_fn(inputs), weights);
        base[offset] = original - opt.eps;
        const double minus = detail::weighted_sum(numeric_fn(inputs), weights);
        base[offset] = original;
        numeric.push_back((plus - minus) / (2 * opt.eps));
      }
    }
    double max_diff = 0.0, max_numeric = 0.0;
    for (size_t j = 0; j < a.size(); ++j) {
      max_diff = std::max(max_diff, std::abs(a[j] - numeric[j]));
      max_numeric = std::max(max_numeric, std::abs(numeric[j]));
    }
    const double rel = max_diff / std::max(max_numeric, 1e-3);
    if (!(rel < opt.max_relative_error) || max_numeric == 0.0) {
      ok = false;
      report << "input " << i << " " << shape_str(in.shape()) << ": relative error " << rel
             << " (max |numeric| " << max_numeric << ")";
      for (size_t j = 0; j < std::min<size_t>(a.size(), 8); ++j)
        report << "\n  [" << j << "] analytic " << a[j] << " numeric " << numeric[j];
      report << "\n";
    }
  }
  autograd::zero_grad(inputs);
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << report.str();
}

inline ::testing::AssertionResult gradcheck(const MultiFn& fn, const std::vector<Tensor>& inputs,
                                            GradcheckOptions opt = {}) {
  return gradcheck_against(fn, fn, inputs, opt);
}

inline ::testing::AssertionResult gradcheck(const SingleFn& fn, const std::vector<Tensor>& inputs,
                                            GradcheckOptions opt = {}) {
  return gradcheck(
      MultiFn([&fn](const std::vector<Tensor>& xs) { return std::vector<Tensor>{fn(xs)}; }), inputs,
      opt);
}

}  // namespace tessera::testing
