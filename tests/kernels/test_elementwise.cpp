// Element-wise ops against float64 loops over the logical indices: broadcasting, every float
// dtype, non-contiguous operands, type promotion, in-place forms and bad input.
#include <functional>

#include "tests/gelu_reference.h"
#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {


struct BinaryCase {
  BinaryOp op;
  std::function<double(double, double)> ref;
};

const std::vector<BinaryCase> kArithmetic = {
    {BinaryOp::Add, [](double a, double b) { return a + b; }},
    {BinaryOp::Sub, [](double a, double b) { return a - b; }},
    {BinaryOp::Mul, [](double a, double b) { return a * b; }},
    {BinaryOp::Div, [](double a, double b) { return a / b; }},
    {BinaryOp::Maximum, [](double a, double b) { return std::max(a, b); }},
    {BinaryOp::Minimum, [](double a, double b) { return std::min(a, b); }},
    {BinaryOp::GeluBackward, [](double x, double dy) { return dy * gelu_tanh_grad(x); }},
};

// (a shape, b shape) pairs that broadcast, including odd sizes and size-1 dims on both sides.
const std::vector<std::pair<Shape, Shape>> kBroadcastPairs = {
    {{7, 33}, {7, 33}}, {{7, 33}, {33}}, {{1, 257}, {5, 1}}, {{3, 1, 7}, {1, 5, 7}},
    {{1}, {33}},        {{}, {7, 3}},
    {{257, 257}, {257}},  // over kParallelGrain: the threaded paths
};

std::vector<double> binary_ref(const Tensor& a, const Tensor& b, const Shape& shape,
                               const std::function<double(double, double)>& f) {
  const auto x = host(raw::expand(a, shape)), y = host(raw::expand(b, shape));
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = f(x[i], y[i]);
  return out;
}

TEST(Binary, ArithmeticBroadcastsInEveryDTypeAndLayout) {
  uint64_t seed = 1;
  for (DType dt : kFloatDTypes) {
    for (const auto& c : kArithmetic) {
      for (const auto& [sa, sb] : kBroadcastPairs) {
        for (Layout layout : kLayouts) {
          if (skip_large_case(sa, dt, layout)) continue;
          const Tensor a = random_tensor(sa, dt, seed++, layout);
          Tensor b = random_tensor(sb, dt, seed++);
          if (c.op == BinaryOp::Div) b = ops::add(ops::unary(UnaryOp::Abs, b), 0.5);
          const Shape shape = raw::broadcast_shapes(sa, sb, "test");
          const Tensor out = ops::binary(c.op, a, b);
          EXPECT_EQ(out.dtype(), dt);
          EXPECT_TRUE(out.is_contiguous());
          expect_close(out, binary_ref(a, b, shape, c.ref), shape, tolerance(dt),
                       std::string(binary_op_name(c.op)) + " " + dtype_name(dt) + " " +
                           shape_str(sa) + "," + shape_str(sb) + " " + layout_name(layout));
        }
      }
    }
  }
}

TEST(Binary, PowAndScalarOperands) {
  for (DType dt : kFloatDTypes) {
    const Tensor a = ops::add(ops::unary(UnaryOp::Abs, random_tensor({7, 33}, dt, 3)), 0.1);
    const Tensor e = random_tensor({33}, dt, 4);
    expect_close(ops::binary(BinaryOp::Pow, a, e),
                 binary_ref(a, e, {7, 33}, [](double x, double y) { return std::pow(x, y); }),
                 {7, 33}, tolerance(dt) * 4, "pow");
    const Tensor s = ops::mul(a, 0.5);
    EXPECT_EQ(s.dtype(), dt);  // a Python-like scalar keeps the tensor's dtype
    expect_close(s, binary_ref(a, a, {7, 33}, [](double x, double) { return 0.5 * x; }), {7, 33},
                 tolerance(dt), "mul scalar");
    const Tensor r = ops::binary(BinaryOp::Sub, a, 2.0);
    expect_close(r, binary_ref(a, a, {7, 33}, [](double x, double) { return x - 2; }), {7, 33},
                 tolerance(dt), "sub scalar");
  }
}

TEST(Binary, ComparisonsAndLogicalGiveBool) {
  const Tensor a = random_tensor({7, 33}, DType::f32, 5, Layout::Transposed);
  const Tensor b = random_tensor({33}, DType::f32, 6);
  const std::vector<std::pair<BinaryOp, std::function<bool(double, double)>>> cases = {
      {BinaryOp::Lt, std::less<double>()},        {BinaryOp::Le, std::less_equal<double>()},
      {BinaryOp::Gt, std::greater<double>()},     {BinaryOp::Ge, std::greater_equal<double>()},
      {BinaryOp::Eq, std::equal_to<double>()},    {BinaryOp::Ne, std::not_equal_to<double>()},
      {BinaryOp::LogicalAnd, [](double x, double y) { return x > 0 && y > 0; }},
      {BinaryOp::LogicalOr, [](double x, double y) { return x > 0 || y > 0; }}};
  const auto x = host(raw::expand(a, {7, 33})), y = host(raw::expand(b, {7, 33}));
  for (const auto& [op, f] : cases) {
    Tensor lhs = a, rhs = b;
    if (op == BinaryOp::LogicalAnd || op == BinaryOp::LogicalOr) {
      lhs = ops::binary(BinaryOp::Gt, a, 0.0);
      rhs = ops::binary(BinaryOp::Gt, b, 0.0);
    }
    const Tensor out = ops::binary(op, lhs, rhs);
    ASSERT_EQ(out.dtype(), DType::boolean);
    const auto got = host(out);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], f(x[i], y[i]) ? 1.0 : 0.0) << binary_op_name(op) << " at " << i;
    }
  }
  // equal values compare equal (a broadcast row against itself)
  EXPECT_TRUE(ops::allclose(ops::binary(BinaryOp::Eq, b, b), ones({33}, {.dtype = DType::boolean})));
}

TEST(Binary, TypePromotion) {
  const Tensor f = random_tensor({4}, DType::f32, 7);
  const Tensor d = random_tensor({4}, DType::f64, 8);
  const Tensor h = random_tensor({4}, DType::f16, 9);
  const Tensor i = from_vector<int32_t>({1, 2, 3, 4}, {4}, {.dtype = DType::i32});
  const Tensor l = from_vector<int64_t>({4, 4, 4, 4}, {4}, {.dtype = DType::i64});
  EXPECT_EQ(ops::add(f, d).dtype(), DType::f64);
  EXPECT_EQ(ops::add(f, h).dtype(), DType::f32);
  EXPECT_EQ(ops::add(i, f).dtype(), DType::f32);
  EXPECT_EQ(ops::add(i, l).dtype(), DType::i64);
  expect_close(ops::add(i, l), {5, 6, 7, 8}, {4}, 0, "i32 + i64");
  // integer division is true division in f32
  const Tensor q = ops::div(i, l);
  EXPECT_EQ(q.dtype(), DType::f32);
  expect_close(q, {0.25, 0.5, 0.75, 1.0}, {4}, 1e-7, "i32 / i64");
  expect_close(ops::add(f, h), binary_ref(f, h, {4}, std::plus<double>()), {4}, 1e-6, "f32+f16");
  EXPECT_EQ(ops::mul(i, 0.5).dtype(), DType::f32);
  expect_close(ops::mul(i, 0.5), {0.5, 1, 1.5, 2}, {4}, 0, "int * 0.5");
}

TEST(Binary, InPlaceBroadcastsIntoDestination) {
  for (DType dt : kFloatDTypes) {
    const Tensor a = random_tensor({7, 33}, dt, 10);
    const Tensor b = random_tensor({33}, DType::f32, 11);
    const auto expect = binary_ref(a, b, {7, 33}, [](double x, double y) { return x * y; });
    const uint64_t version = a.impl().version;
    ops::binary_(BinaryOp::Mul, a, b);
    EXPECT_GT(a.impl().version, version);
    EXPECT_EQ(a.dtype(), dt);
    expect_close(a, expect, {7, 33}, tolerance(dt), std::string("mul_ ") + dtype_name(dt));
  }
  // into a strided view: only the viewed elements change
  const Tensor base = random_tensor({6, 8}, DType::f32, 12);
  const auto before = host(base);
  const Tensor view = raw::slice(base, 1, 0, 8, 3);  // columns 0, 3, 6
  ops::binary_(BinaryOp::Add, view, 1.0);
  const auto after = host(base);
  for (int64_t i = 0; i < 48; ++i) {
    const double want = before[i] + ((i % 8) % 3 == 0 ? 1.0 : 0.0);
    EXPECT_NEAR(after[i], want, 1e-6) << i;
  }
}

TEST(Binary, BadInputNamesOpAndShapes) {
  const Tensor a = random_tensor({7, 3}, DType::f32, 13), b = random_tensor({4}, DType::f32, 14);
  expect_error([&] { ops::add(a, b); }, {"add", "[7, 3]", "[4]"});
  expect_error([&] { ops::binary_(BinaryOp::Mul, random_tensor({3}, DType::f32, 1), a); },
               {"mul", "[7, 3]", "[3]"});
  expect_error([&] { ops::add(a, Tensor()); }, {"add", "undefined"});
}

struct UnaryCase {
  UnaryOp op;
  std::function<double(double)> ref;
  bool positive_input = false;
};

TEST(Unary, EveryFloatOpInEveryDTypeAndLayout) {
  const std::vector<UnaryCase> cases = {
      {UnaryOp::Neg, [](double x) { return -x; }},
      {UnaryOp::Exp, [](double x) { return std::exp(x); }},
      {UnaryOp::Log, [](double x) { return std::log(x); }, true},
      {UnaryOp::Sqrt, [](double x) { return std::sqrt(x); }, true},
      {UnaryOp::Rsqrt, [](double x) { return 1 / std::sqrt(x); }, true},
      {UnaryOp::Abs, [](double x) { return std::fabs(x); }},
      {UnaryOp::Tanh, [](double x) { return std::tanh(x); }},
      {UnaryOp::Sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }},
      {UnaryOp::Relu, [](double x) { return x > 0 ? x : 0; }},
      {UnaryOp::Gelu, gelu_tanh},
      {UnaryOp::Sin, [](double x) { return std::sin(x); }},
      {UnaryOp::Cos, [](double x) { return std::cos(x); }},
      {UnaryOp::Square, [](double x) { return x * x; }},
      {UnaryOp::Reciprocal, [](double x) { return 1 / x; }, true},
      {UnaryOp::Sign, [](double x) { return (x > 0) - (x < 0); }},
      {UnaryOp::Floor, [](double x) { return std::floor(x); }},
      {UnaryOp::Ceil, [](double x) { return std::ceil(x); }},
      {UnaryOp::Round, [](double x) { return std::nearbyint(x); }},
      {UnaryOp::Log1p, [](double x) { return std::log1p(x); }, true},
      {UnaryOp::Expm1, [](double x) { return std::expm1(x); }},
      {UnaryOp::Erf, [](double x) { return std::erf(x); }},
  };
  uint64_t seed = 100;
  for (DType dt : kFloatDTypes) {
    for (const auto& c : cases) {
      for (Layout layout : kLayouts) {
        // a large shape once per op exercises the threaded loops
        const Shape shape = layout == Layout::Contiguous && dt == DType::f32 ? Shape{129, 257} : Shape{7, 33};
        Tensor x = random_tensor(shape, dt, seed++, layout, 2.0);
        if (c.positive_input) x = ops::add(ops::unary(UnaryOp::Abs, x), 0.25);
        const Tensor out = ops::unary(c.op, x);
        EXPECT_EQ(out.dtype(), dt);
        std::vector<double> want = host(x);
        for (double& v : want) v = c.ref(v);
        expect_close(out, want, shape, tolerance(dt),
                     std::string(unary_op_name(c.op)) + " " + dtype_name(dt) + " " +
                         layout_name(layout));
      }
    }
  }
}

TEST(Unary, GeluTanhFormAtLargeAndSmallInputs) {
  const std::vector<double> xs = {-30, -8, -3, -1e-3, 0, 1e-3, 0.5, 3, 8, 30};
  const Tensor x = from_vector(xs, {10}, {.dtype = DType::f32});
  std::vector<double> want;
  for (double v : xs) want.push_back(gelu_tanh(v));
  expect_close(ops::unary(UnaryOp::Gelu, x), want, {10}, 1e-6, "gelu extremes");
  const Tensor g = ops::binary(BinaryOp::GeluBackward, x, ones({10}));
  std::vector<double> dwant;
  for (double v : xs) dwant.push_back(gelu_tanh_grad(v));
  expect_close(g, dwant, {10}, 1e-6, "gelu grad extremes");
}

TEST(Unary, IntegerInputsAndLogicalNot) {
  const Tensor i = from_vector<int64_t>({-2, 0, 3}, {3}, {.dtype = DType::i64});
  EXPECT_EQ(ops::unary(UnaryOp::Neg, i).dtype(), DType::i64);
  expect_close(ops::unary(UnaryOp::Abs, i), {2, 0, 3}, {3}, 0, "abs i64");
  const Tensor e = ops::unary(UnaryOp::Exp, i);
  EXPECT_EQ(e.dtype(), DType::f32);
  expect_close(e, {std::exp(-2.0), 1, std::exp(3.0)}, {3}, 1e-6, "exp i64");
  const Tensor n = ops::unary(UnaryOp::LogicalNot, i);
  EXPECT_EQ(n.dtype(), DType::boolean);
  expect_close(n, {0, 1, 0}, {3}, 0, "logical_not");
}

TEST(Where, SelectsWithBroadcastAndPromotion) {
  for (DType dt : kFloatDTypes) {
    const Tensor cond = ops::binary(BinaryOp::Gt, random_tensor({7, 1}, DType::f32, 20), 0.0);
    const Tensor a = random_tensor({7, 33}, dt, 21, Layout::Transposed);
    const Tensor b = random_tensor({33}, dt, 22);
    const Tensor out = ops::where(cond, a, b);
    const auto c = host(raw::expand(cond, {7, 33}));
    const auto x = host(a), y = host(raw::expand(b, {7, 33}));
    std::vector<double> want(c.size());
    for (size_t k = 0; k < c.size(); ++k) want[k] = c[k] != 0 ? x[k] : y[k];
    expect_close(out, want, {7, 33}, 0, std::string("where ") + dtype_name(dt));
  }
  // a scalar on either side (the kernel hoists it)
  const Tensor c = ops::binary(BinaryOp::Gt, random_tensor({5, 7}, DType::f32, 23), 0.0);
  const Tensor x = random_tensor({5, 7}, DType::f32, 24, Layout::Transposed);
  const Tensor s = full({}, 2.5);
  const auto cv = host(c), xv = host(x);
  std::vector<double> keep_x, keep_s;
  for (size_t k = 0; k < cv.size(); ++k) {
    keep_x.push_back(cv[k] != 0 ? xv[k] : 2.5);
    keep_s.push_back(cv[k] != 0 ? 2.5 : xv[k]);
  }
  expect_close(ops::where(c, x, s), keep_x, {5, 7}, 0, "where scalar b");
  expect_close(ops::where(c, s, x), keep_s, {5, 7}, 0, "where scalar a");
  EXPECT_EQ(ops::where(ones({2}, {.dtype = DType::boolean}), ones({2}), ones({2}, {.dtype = DType::f64}))
                .dtype(),
            DType::f64);
  expect_error([&] { ops::where(ones({3}), ones({3}), ones({3})); }, {"where", "bool", "float32"});
  expect_error([&] { ops::where(ones({3}, {.dtype = DType::boolean}), ones({3}), ones({4})); },
               {"where", "[3]", "[4]"});
}

TEST(MaskedFill, FillsWhereMaskIsTrue) {
  // the causal-attention pattern: fill the upper triangle with -inf
  const int64_t T = 7;
  const Tensor rows = raw::view(arange(T), {T, 1}), cols = raw::view(arange(T), {1, T});
  const Tensor mask = ops::binary(BinaryOp::Gt, cols, rows);
  const Tensor x = random_tensor({3, T, T}, DType::f32, 23, Layout::Transposed);
  const Tensor out = ops::masked_fill(x, mask, -INFINITY);
  const auto got = host(out), xs = host(x);
  for (int64_t k = 0; k < 3 * T * T; ++k) {
    const int64_t i = (k / T) % T, j = k % T;
    if (j > i) EXPECT_EQ(got[k], -INFINITY);
    else EXPECT_EQ(got[k], xs[k]);
  }
  expect_error([&] { ops::masked_fill(x, ones({2, T}, {.dtype = DType::boolean}), 0); },
               {"masked_fill", "[2, 7]"});
}

TEST(AddScaled, MatchesReferenceAndBroadcasts) {
  for (DType dt : kFloatDTypes) {
    const Tensor a = random_tensor({7, 33}, dt, 30, Layout::Stepped);
    const Tensor b = random_tensor({33}, dt, 31);
    expect_close(ops::add_scaled(a, b, -0.37),
                 binary_ref(a, b, {7, 33}, [](double x, double y) { return x - 0.37 * y; }),
                 {7, 33}, tolerance(dt), std::string("add_scaled ") + dtype_name(dt));
  }
}

TEST(Compare, AllcloseAndMaxRelError) {
  const Tensor a = from_vector<float>({1, 2, 3}, {3});
  const Tensor b = from_vector<float>({1, 2, 3.0001f}, {3});
  EXPECT_TRUE(ops::allclose(a, b, 1e-4, 0));
  EXPECT_FALSE(ops::allclose(a, b, 1e-6, 0));
  EXPECT_NEAR(ops::max_rel_error(a, b), 1e-4 / 3.0001, 1e-7);
  EXPECT_FALSE(ops::allclose(from_vector<float>({NAN}, {1}), from_vector<float>({NAN}, {1})));
}

}  // namespace
}  // namespace tessera::test
