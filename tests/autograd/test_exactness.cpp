// Defects found by a differential test against PyTorch (issues 17 and 38), each pinned down:
// writes into self-overlapping views, empty inner/outer matmul dims under autograd, f64
// precision of cross-entropy and layer norm, long f32 sums, GELU's gradient at +-inf, std's
// gradient where the std is 0, tanh's f16/bf16 gradient rounding, fill_ into expanded views.
#include <cmath>
#include <limits>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::error_of;
using testing::gradcheck;
using testing::leaf;
using testing::random_f64;

TEST(Exactness, CopyIntoExpandedViewIsRefused) {
  Tensor base = zeros({1, 3});
  Tensor src = random_f64({2, 3}, 1).to(DType::f32);
  const std::string message = error_of([&] { base.expand({2, 3}).copy_(src); });
  EXPECT_NE(message.find("more than one element of the written-to tensor"), std::string::npos)
      << message;
  EXPECT_NE(message.find("copy_"), std::string::npos) << message;
  EXPECT_EQ(ops::sum(ops::unary(UnaryOp::Abs, base)).item(), 0.0) << "nothing may be written";
  // In-place arithmetic refuses the same destinations (fill_ writes one value: see below).
  EXPECT_NE(error_of([&] { ops::binary_(BinaryOp::Add, base.expand({4, 3}), 1.0); }), "");
  // An as_strided view whose rows overlap ([3, 2] over 4 elements) is refused too.
  Tensor flat = zeros({4});
  EXPECT_NE(error_of([&] { ops::as_strided(flat, {3, 2}, {1, 1}, 0).copy_(ones({3, 2})); }), "");
}

TEST(Exactness, CopyIntoNonOverlappingViewsStillWorks) {
  Tensor base = zeros({4, 6}, {.dtype = DType::f64});
  Tensor src = random_f64({3, 2}, 2);
  base.slice(0, 1, 4).slice(1, 0, 6, 3).copy_(src);  // stepped, non-contiguous
  EXPECT_TRUE(ops::allclose(ops::slice(ops::slice(base, 0, 1, 4, 1), 1, 0, 6, 3), src, 0, 0));
  Tensor t = zeros({5, 3}, {.dtype = DType::f64});
  t.transpose(0, 1).copy_(random_f64({3, 5}, 3));
  EXPECT_TRUE(ops::allclose(ops::transpose(t, 0, 1), random_f64({3, 5}, 3), 0, 0));
  Tensor one = zeros({1, 1});
  one.expand({1, 1}).fill_(3.0);  // a size-1 expand writes each location once
  EXPECT_EQ(one.item(), 3.0);
  EXPECT_FALSE(ops::has_internal_overlap(ops::as_strided(zeros({12}), {2, 2}, {2, 3}, 0)));
}

// matmul with an empty inner (K = 0) or outer (M, N = 0) dim: forward and backward.
TEST(Exactness, MatmulWithEmptyDimsHasGradients) {
  struct Case {
    Shape a, b, y;
  };
  for (const Case& c : {Case{{2, 3, 0}, {0, 4}, {2, 3, 4}}, Case{{2, 0, 3}, {3, 4}, {2, 0, 4}},
                        Case{{3, 0}, {0, 5}, {3, 5}}, Case{{2, 3, 5}, {2, 5, 0}, {2, 3, 0}},
                        Case{{0}, {0, 2}, {2}}, Case{{4, 0}, {0}, {4}}}) {
    SCOPED_TRACE(shape_str(c.a) + " @ " + shape_str(c.b));
    Tensor a = leaf(random_f64(c.a, 4)), b = leaf(random_f64(c.b, 5));
    Tensor y = matmul(a, b);
    ASSERT_EQ(y.shape(), c.y);
    EXPECT_EQ(ops::sum(ops::unary(UnaryOp::Abs, y)).item(), 0.0);  // empty sums are 0
    sum(y * random_f64(c.y, 6)).backward();
    ASSERT_TRUE(a.grad().defined() && b.grad().defined());
    EXPECT_EQ(a.grad().shape(), c.a);
    EXPECT_EQ(b.grad().shape(), c.b);
    // Only an empty K gives gradients with elements; they are zero (y does not depend on them).
    if (a.numel() > 0) EXPECT_EQ(ops::sum(ops::unary(UnaryOp::Abs, a.grad())).item(), 0.0);
  }
  // linear over rows of width 0 and to 0 outputs.
  Tensor x = leaf(random_f64({3, 0}, 7)), w = leaf(random_f64({0, 2}, 8)),
         bias = leaf(random_f64({2}, 9));
  sum(linear(x, w, bias)).backward();
  EXPECT_EQ(w.grad().shape(), (Shape{0, 2}));
  EXPECT_TRUE(ops::allclose(bias.grad(), full({2}, 3.0, {.dtype = DType::f64})));
  Tensor x2 = leaf(random_f64({2, 4}, 10)), w2 = leaf(random_f64({4, 0}, 11));
  sum(linear(x2, w2)).backward();
  EXPECT_EQ(x2.grad().shape(), (Shape{2, 4}));
}

// Cross-entropy's sum of row losses keeps f64 for f64 logits.
TEST(Exactness, CrossEntropyFloat64IsFloat64Accurate) {
  const int64_t N = 37, V = 11;
  Tensor logits = random_f64({V, N}, 12, -20, 20).transpose(0, 1);  // non-contiguous
  Tensor targets = ops::argmax(random_f64({N, V}, 13), 1);
  // Reference: -log_softmax at the targets, summed in long double.
  const std::vector<double> lp = testing::detail::values(ops::log_softmax(logits, 1));
  const std::vector<int64_t> t = targets.to_vector<int64_t>();
  long double total = 0;
  for (int64_t r = 0; r < N; ++r) total -= lp[r * V + t[r]];
  Tensor sum_loss = cross_entropy(logits, targets, -100, Reduction::Sum);
  Tensor mean_loss = cross_entropy(logits, targets, -100, Reduction::Mean);
  EXPECT_EQ(sum_loss.dtype(), DType::f64);
  EXPECT_NEAR(sum_loss.item(), static_cast<double>(total),
              1e-12 * std::fabs(static_cast<double>(total)));
  EXPECT_NEAR(mean_loss.item(), static_cast<double>(total / N),
              1e-12 * std::fabs(static_cast<double>(total / N)));
}

// The layer-norm backward of f64 inputs against the same normalisation composed from f64
// ops (whose gradients are exact to f64 rounding).
TEST(Exactness, LayerNormFloat64BackwardIsFloat64Accurate) {
  const int64_t C = 19;
  Tensor x = leaf(random_f64({C, 6}, 14, -3, 50).transpose(0, 1));  // offset mean: tests rstd
  Tensor w = leaf(random_f64({C}, 15)), b = leaf(random_f64({C}, 16));
  Tensor dy = random_f64({6, C}, 17);
  sum(layer_norm(x, w, b, 1e-5) * dy).backward();
  const Tensor dx = x.grad(), dw = w.grad(), db = b.grad();
  autograd::zero_grad({x, w, b});
  Tensor mu = mean(x, {-1}, true);
  Tensor centered = x - mu;
  Tensor rstd = rsqrt(mean(square(centered), {-1}, true) + 1e-5);
  sum((centered * rstd * w + b) * dy).backward();
  EXPECT_LT(ops::max_rel_error(dx, x.grad()), 1e-12);
  EXPECT_LT(ops::max_rel_error(dw, w.grad()), 1e-12);
  EXPECT_LT(ops::max_rel_error(db, b.grad()), 1e-12);
}

// A long f32 sum has the error of a short one (pairwise/cascade summation).
TEST(Exactness, LongFloat32SumIsAccurate) {
  Generator gen(18);
  Tensor u = uniform({1000000}, 0.0, 1.0, {.dtype = DType::f32}, &gen);
  const std::vector<float> v = u.to_vector<float>();
  long double exact = 0;
  for (float f : v) exact += f;
  const double rel =
      std::fabs(ops::sum(u).item() - static_cast<double>(exact)) / static_cast<double>(exact);
  EXPECT_LE(rel, 1e-7) << "sum of 1e6 uniform(0,1) f32";
  const double mean_rel = std::fabs(ops::mean(u).item() - static_cast<double>(exact / v.size())) /
                          static_cast<double>(exact / v.size());
  EXPECT_LE(mean_rel, 1e-7);
  // 1e6 copies of 0.1f: every partial sum rounds the same way in a running sum.
  Tensor tenths = full({1000, 1000}, 0.1, {.dtype = DType::f32});
  const double exact_tenths = 1e6 * static_cast<double>(0.1f);
  EXPECT_LE(std::fabs(ops::sum(tenths).item() - exact_tenths) / exact_tenths, 1e-7);
  // Column sums (the bias-gradient layout) of a tall matrix take the same care.
  Tensor tall = full({200000, 3}, 0.1, {.dtype = DType::f32});
  const std::vector<float> cols = ops::sum(tall, {0}).to_vector<float>();
  for (float c : cols) EXPECT_LE(std::fabs(c - 2e5 * 0.1f) / (2e5 * 0.1f), 1e-7);
}

TEST(Exactness, GeluGradientAtInfinityIsItsLimit) {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor x = leaf(from_vector<double>({inf, -inf, 1e30, -1e30, 60.0, -60.0}, {6}).to(dt));
    Tensor y = gelu(x);
    sum(y).backward();
    const std::vector<double> g = testing::detail::values(x.grad());
    const std::vector<double> want = {1, 0, 1, 0, 1, 0};
    for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], want[i]) << "element " << i;
    const std::vector<double> yv = testing::detail::values(y);
    EXPECT_EQ(yv[0], inf);
    EXPECT_EQ(yv[1], 0.0);  // the limit, not -inf * 0
  }
}

// PyTorch's std_backward masks grad / (2 std) to 0 where std == 0, so a constant feature gets
// a zero gradient; sqrt's derivative there is inf and inf * 0 made it NaN.
TEST(Exactness, StdGradientIsZeroWhereTheStdIsZero) {
  const std::vector<double> rows = {2, 2, 2, 2, 1, 2, 3, 4};
  for (double correction : {0.0, 1.0}) {
    Tensor x = leaf(from_vector<double>(rows, {2, 4}, {.dtype = DType::f64}));
    sum(std_dev(x, {1}, correction)).backward();
    // Row 1 against (x - mean) / ((N - correction) std), its float64 value.
    const double n = 4, mean = 2.5, ss = 5.0, sd = std::sqrt(ss / (n - correction));
    const std::vector<double> g = testing::detail::values(x.grad());
    for (int c = 0; c < 4; ++c) {
      EXPECT_EQ(g[c], 0.0) << "constant row, correction " << correction;
      EXPECT_NEAR(g[4 + c], (rows[4 + c] - mean) / ((n - correction) * sd), 1e-15);
    }
  }
  // A constant f32 tensor reduced over every dim, under an upstream gradient of inf.
  Tensor y = leaf(full({3, 5}, 0.25));
  (std_dev(y) * INFINITY).backward();
  for (double v : testing::detail::values(y.grad())) EXPECT_EQ(v, 0.0);
  // N - correction = 0: the std is NaN (0 / 0) and so is its gradient, as PyTorch's.
  Tensor z = leaf(from_vector<double>({1, 2, 3}, {3}, {.dtype = DType::f64}));
  std_dev(z, {}, 3.0).backward();
  EXPECT_TRUE(std::isnan(testing::detail::values(z.grad())[0]));
}

// tanh's gradient dy (1 - y^2) for f16/bf16 is computed in f32 and rounded once, as PyTorch's
// tanh_backward; rounding y^2, 1 - y^2 and the product each to the dtype lost up to 2 ulps.
TEST(Exactness, TanhHalfPrecisionGradientIsRoundedOnce) {
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor x = leaf(random_f64({4096}, 12, -3, 3).to(dt));
    const Tensor dy = random_f64({4096}, 13).to(dt);
    Tensor y = tanh(x);
    y.backward(dy);
    const std::vector<double> yv = testing::detail::values(y), gv = testing::detail::values(dy);
    std::vector<float> want(yv.size());
    for (size_t i = 0; i < yv.size(); ++i) {
      const float yf = static_cast<float>(yv[i]);
      want[i] = static_cast<float>(gv[i]) * (1.0f - yf * yf);
    }
    const std::vector<double> rounded = testing::detail::values(from_vector(want, {4096}).to(dt));
    const std::vector<double> got = testing::detail::values(x.grad());
    int64_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i] != rounded[i];
    EXPECT_EQ(differ, 0) << dtype_name(dt) << ": elements not rounded once from f32";
  }
}

// fill_ into an expanded view writes its value to every location the view covers, as
// PyTorch's (it was refused as an overlapping write); in a graph the base's history is
// rewritten and the gradient of the view's shared locations summed.
TEST(Exactness, FillIntoAnExpandedViewWritesTheSharedLocations) {
  Tensor base = zeros({3, 1, 2});
  base.expand({3, 4, 2}).fill_(2.5);
  for (double v : testing::detail::values(base)) EXPECT_EQ(v, 2.5);
  Tensor row = zeros({4});
  row.unsqueeze(0).expand({5, 4}).zero_();  // also the zero_ spelling
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Tensor>& v) {
        Tensor y = v[0] * 2.0;  // [2, 3]
        Tensor shared = y.select(0, 1).unsqueeze(0).expand({4, 3});
        shared.fill_(5.0);  // y[1] = 5
        return sum(shared * v[1]) + sum(y * v[2]);
      },
      {leaf(random_f64({2, 3}, 14)), leaf(random_f64({4, 3}, 15)), leaf(random_f64({2, 3}, 16))}));
}

}  // namespace
}  // namespace tessera
