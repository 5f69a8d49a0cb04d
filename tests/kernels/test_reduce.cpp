// Reductions against float64 loops: every op over single and multiple dims, keepdim, all
// float dtypes, non-contiguous inputs (both loop orders of the kernel), sum_to, arg-reductions.
#include <functional>
#include <limits>

#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {

// Reference reduction of x (logical values) over `dims` with keepdim shape.
std::vector<double> reduce_ref(const Tensor& x, const std::vector<int64_t>& dims, ReduceOp op,
                               Shape& out_shape) {
  const Shape& shape = x.shape();
  out_shape = shape;
  for (int64_t d : dims) out_shape[d] = 1;
  const int64_t n_out = shape_numel(out_shape);
  double init = 0;
  if (op == ReduceOp::Prod) init = 1;
  if (op == ReduceOp::Max) init = -INFINITY;
  if (op == ReduceOp::Min) init = INFINITY;
  std::vector<double> acc(n_out, init);
  std::vector<int64_t> count(n_out, 0);
  const auto vals = host(x);
  for (int64_t i = 0; i < static_cast<int64_t>(vals.size()); ++i) {
    auto idx = unravel(i, shape);
    for (int64_t d : dims) idx[d] = 0;
    const int64_t o = ravel(idx, out_shape);
    const double v = vals[i];
    switch (op) {
      case ReduceOp::Sum: case ReduceOp::Mean: acc[o] += v; break;
      case ReduceOp::Prod: acc[o] *= v; break;
      case ReduceOp::Max: acc[o] = std::max(acc[o], v); break;
      case ReduceOp::Min: acc[o] = std::min(acc[o], v); break;
    }
    ++count[o];
  }
  if (op == ReduceOp::Mean) {
    for (int64_t o = 0; o < n_out; ++o) acc[o] /= count[o];
  }
  return acc;
}

Tensor run_reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  switch (op) {
    case ReduceOp::Sum: return ops::sum(x, dims, keepdim);
    case ReduceOp::Mean: return ops::mean(x, dims, keepdim);
    case ReduceOp::Max: return ops::amax(x, dims, keepdim);
    case ReduceOp::Min: return ops::amin(x, dims, keepdim);
    default: return ops::prod(x, dims, keepdim);
  }
}

TEST(Reduce, EveryOpOverDimsInEveryDTypeAndLayout) {
  const std::vector<std::pair<Shape, std::vector<int64_t>>> cases = {
      {{7, 33}, {1}},       {{7, 33}, {0}},       {{257, 7}, {0}},     {{3, 5, 7}, {0, 2}},
      {{3, 5, 7}, {1}},     {{3, 5, 7}, {}},      {{1, 257}, {-1}},    {{33, 1, 7}, {0, 1}},
      {{1031, 33}, {0}},    {{33, 1100}, {1}},    {{5}, {0}},
  };
  const std::vector<ReduceOp> ops_list = {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max,
                                          ReduceOp::Min, ReduceOp::Prod};
  uint64_t seed = 1;
  for (DType dt : kFloatDTypes) {
    for (const auto& [shape, dims] : cases) {
      for (Layout layout : kLayouts) {
        if (skip_large_case(shape, dt, layout)) continue;
        for (ReduceOp op : ops_list) {
          // products of many normals over/underflow: keep them near 1 and short
          if (op == ReduceOp::Prod && shape_numel(shape) > 2000) continue;
          Tensor x = random_tensor(shape, dt, seed++, layout);
          if (op == ReduceOp::Prod) x = ops::add(ops::mul(x, 0.01), 1.0);
          std::vector<int64_t> wrapped;
          for (int64_t d : dims) wrapped.push_back(d < 0 ? d + x.dim() : d);
          if (dims.empty()) for (int64_t d = 0; d < x.dim(); ++d) wrapped.push_back(d);
          Shape keep_shape;
          const auto want = reduce_ref(x, wrapped, op, keep_shape);
          const std::string what = std::string(reduce_op_name(op)) + " " + dtype_name(dt) + " " +
                                   shape_str(shape) + " dims " + shape_str(dims) + " " +
                                   layout_name(layout);
          const Tensor kept = run_reduce(op, x, dims, true);
          EXPECT_EQ(kept.dtype(), dt) << what;
          // f32 sums of thousands of terms: the reference is exact, ours accumulates in f32
          const double tol = dt == DType::f32 ? 1e-5 : tolerance(dt);
          expect_close(kept, want, keep_shape, tol, what);
          Shape squeezed;
          for (int64_t d = 0; d < x.dim(); ++d) {
            if (std::find(wrapped.begin(), wrapped.end(), d) == wrapped.end()) squeezed.push_back(x.shape()[d]);
          }
          EXPECT_EQ(run_reduce(op, x, dims, false).shape(), squeezed) << what;
        }
      }
    }
  }
}

TEST(Reduce, IntegerSumsInInt64AndMeanInFloat) {
  const Tensor i = from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i32});
  const Tensor s = ops::sum(i, {1});
  EXPECT_EQ(s.dtype(), DType::i64);
  EXPECT_EQ(s.to_vector<int64_t>(), (std::vector<int64_t>{6, 15}));
  const Tensor m = ops::amax(i, {0});
  EXPECT_EQ(m.dtype(), DType::i32);
  EXPECT_EQ(m.to_vector<int32_t>(), (std::vector<int32_t>{4, 5, 6}));
  const Tensor avg = ops::mean(i);
  EXPECT_EQ(avg.dtype(), DType::f32);
  EXPECT_DOUBLE_EQ(avg.item(), 3.5);
  const Tensor b = ops::binary(BinaryOp::Gt, i, 2.0);
  EXPECT_EQ(ops::sum(b).item(), 4.0);
}

TEST(Reduce, MaxPropagatesNaNAndEmptyDimErrors) {
  const Tensor x = from_vector<float>({1, NAN, 3, 4}, {2, 2});
  const auto m = host(ops::amax(x, {1}));
  EXPECT_TRUE(std::isnan(m[0]));
  EXPECT_EQ(m[1], 4);
  expect_error([&] { ops::amax(empty({3, 0}), {1}); }, {"max", "[3, 0]"});
  EXPECT_EQ(ops::sum(empty({3, 0}), {1}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  expect_error([&] { ops::sum(ones({2, 3}), {2}); }, {"sum"});
  expect_error([&] { ops::sum(ones({2, 3}), {1, -1}); }, {"sum", "repeated"});
}

TEST(SumTo, InvertsBroadcasting) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{4, 7, 33}, {33}}, {{4, 7, 33}, {7, 1}}, {{4, 7, 33}, {1, 1, 1}}, {{4, 7, 33}, {}},
      {{7, 33}, {7, 33}}, {{3, 1, 5}, {1, 5}}};
  uint64_t seed = 40;
  for (DType dt : kFloatDTypes) {
    for (const auto& [from, to] : cases) {
      const Tensor x = random_tensor(from, dt, seed++, Layout::Transposed);
      const Tensor y = ops::sum_to(x, to);
      ASSERT_EQ(y.shape(), to);
      // reference: every x element lands in the `to` cell it was broadcast from
      std::vector<double> want(shape_numel(to), 0.0);
      const auto xs = host(x);
      const int64_t lead = x.dim() - static_cast<int64_t>(to.size());
      for (int64_t i = 0; i < x.numel(); ++i) {
        const auto idx = unravel(i, from);
        std::vector<int64_t> t(to.size());
        for (size_t d = 0; d < to.size(); ++d) t[d] = to[d] == 1 ? 0 : idx[d + lead];
        want[ravel(t, to)] += xs[i];
      }
      expect_close(y, want, to, dt == DType::f32 ? 1e-5 : tolerance(dt),
                   std::string("sum_to ") + shape_str(from) + "->" + shape_str(to));
    }
  }
  expect_error([&] { ops::sum_to(ones({4, 7}), {3}); }, {"sum_to", "[3]", "[4, 7]"});
  expect_error([&] { ops::sum_to(ones({7}), {2, 7}); }, {"sum_to", "[2, 7]"});
}

TEST(ArgReduce, FirstExtremeAlongDim) {
  uint64_t seed = 60;
  for (DType dt : kFloatDTypes) {
    for (Layout layout : kLayouts) {
      const Tensor x = random_tensor({5, 33, 7}, dt, seed++, layout);
      const auto xs = host(x);
      for (int64_t dim = 0; dim < 3; ++dim) {
        for (bool is_max : {true, false}) {
          const Tensor got = is_max ? ops::argmax(x, dim, true) : ops::argmin(x, dim, true);
          ASSERT_EQ(got.dtype(), DType::i64);
          Shape oshape = x.shape();
          oshape[dim] = 1;
          ASSERT_EQ(got.shape(), oshape);
          const auto g = got.to_vector<int64_t>();
          for (int64_t o = 0; o < shape_numel(oshape); ++o) {
            auto idx = unravel(o, oshape);
            int64_t best = 0;
            double best_v = 0;
            for (int64_t k = 0; k < x.shape()[dim]; ++k) {
              idx[dim] = k;
              const double v = xs[ravel(idx, x.shape())];
              if (k == 0 || (is_max ? v > best_v : v < best_v)) {
                best = k;
                best_v = v;
              }
            }
            ASSERT_EQ(g[o], best) << dtype_name(dt) << " dim " << dim << " out " << o;
          }
        }
      }
      EXPECT_EQ(ops::argmax(x, 1).shape(), (Shape{5, 7}));
    }
  }
  // ties resolve to the first occurrence
  EXPECT_EQ(ops::argmax(from_vector<float>({1, 3, 3, 0}, {4}), 0).item(), 1.0);
  expect_error([&] { ops::argmax(ones({2, 3}), 2); }, {"argmax"});
}

}  // namespace
}  // namespace tessera::test
