// The ops added for modern models (issue 17) against float64 finite differences on
// non-contiguous inputs, and their forward results against hand-computed references.
#include <algorithm>
#include <cmath>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using testing::transposed_leaf;
using Xs = std::vector<Tensor>;

std::vector<double> values(const Tensor& t) { return testing::detail::values(t); }

TEST(NewOps, ElementwiseMathGradients) {
  Tensor x = transposed_leaf({5, 7}, 1), pos = transposed_leaf({5, 7}, 2, 0.2, 3.0);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return sin(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return cos(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return expm1(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return erf(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return gelu_erf(v[0]); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return log1p(v[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return reciprocal(v[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return silu(v[0]); }, {x}));
  Tensor up = transposed_leaf({5, 7}, 3);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return swiglu(v[0], v[1]); }, {x, up}));
  // Forward values against std:: maths.
  const std::vector<double> xv = values(x), s = values(silu(x)), e = values(expm1(x));
  const std::vector<double> erfs = values(erf(x)), gelus = values(gelu_erf(x));
  for (size_t i = 0; i < xv.size(); ++i) {
    EXPECT_NEAR(s[i], xv[i] / (1 + std::exp(-xv[i])), 1e-15);
    EXPECT_NEAR(e[i], std::expm1(xv[i]), 1e-15);
    EXPECT_NEAR(erfs[i], std::erf(xv[i]), 1e-15);
    EXPECT_NEAR(gelus[i], 0.5 * xv[i] * (1 + std::erf(xv[i] / std::sqrt(2.0))), 1e-15);
  }
}

TEST(NewOps, ClampMasksTheGradient) {
  Tensor x = transposed_leaf({6, 9}, 4, -2, 2);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return clamp(v[0], -0.7, 0.9); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return clamp(v[0], std::nullopt, 0.3); }, {x}));
  Tensor y = leaf(from_vector<double>({-3, -1, 0, 1, 3}, {5}, {.dtype = DType::f64}));
  Tensor c = clamp(y, -1.0, 1.0);
  EXPECT_EQ(values(c), (std::vector<double>{-1, -1, 0, 1, 1}));
  sum(c).backward();
  EXPECT_EQ(values(y.grad()), (std::vector<double>{0, 1, 1, 1, 0}));  // ends included
  EXPECT_THROW(clamp(y, std::nullopt, std::nullopt), Error);
}

TEST(NewOps, ComparisonsAndWhereWithScalars) {
  Tensor a = from_vector<double>({1, 2, 3, 4}, {2, 2}),
         b = from_vector<double>({1, 3, 2, 4}, {2, 2});
  EXPECT_EQ((a == b).dtype(), DType::boolean);
  EXPECT_EQ(values(a == b), (std::vector<double>{1, 0, 0, 1}));
  EXPECT_EQ(values(a != b), (std::vector<double>{0, 1, 1, 0}));
  EXPECT_EQ(values(a < b), (std::vector<double>{0, 1, 0, 0}));
  EXPECT_EQ(values(a <= b), (std::vector<double>{1, 1, 0, 1}));
  EXPECT_EQ(values(a > 2.5), (std::vector<double>{0, 0, 1, 1}));
  EXPECT_EQ(values(a >= 2.0), (std::vector<double>{0, 1, 1, 1}));
  Tensor x = transposed_leaf({3, 4}, 5);
  Tensor cond = gt(random_f64({3, 4}, 6), 0.0);
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return where(cond, v[0], -2.5); }, {x}));
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return where(cond, 1.5, v[0]); }, {x}));
  EXPECT_EQ(values(where(a > 2.0, a, 0.0)), (std::vector<double>{0, 0, 3, 4}));
}

TEST(NewOps, VarStdLogsumexpGradients) {
  Tensor x = transposed_leaf({4, 6, 5}, 7);
  for (double correction : {0.0, 1.0}) {
    EXPECT_TRUE(gradcheck([=](const Xs& v) { return var(v[0], {1}, correction); }, {x}));
    EXPECT_TRUE(gradcheck(
        [=](const Xs& v) {
          return std_dev(v[0], {0, 2}, correction, true);
        },
        {x}));
  }
  EXPECT_TRUE(gradcheck([](const Xs& v) { return logsumexp(v[0], {-1}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return logsumexp(v[0], {0, 1}, true); }, {x}));
  // Against a float64 two-pass reference.
  const std::vector<double> xv = values(x.select(0, 1).select(0, 2));
  double m = 0, ss = 0, big = -INFINITY, se = 0;
  for (double v : xv) m += v / xv.size();
  for (double v : xv) ss += (v - m) * (v - m), big = std::max(big, v);
  for (double v : xv) se += std::exp(v - big);
  EXPECT_NEAR(var(x, {2}).select(0, 1).select(0, 2).item(), ss / (xv.size() - 1), 1e-14);
  EXPECT_NEAR(std_dev(x, {2}, 0).select(0, 1).select(0, 2).item(), std::sqrt(ss / xv.size()),
              1e-14);
  EXPECT_NEAR(logsumexp(x, {2}).select(0, 1).select(0, 2).item(), big + std::log(se), 1e-14);
  // Large values do not overflow; a row of -inf gives -inf.
  Tensor big_row =
      from_vector<double>({1000, 1000, -INFINITY, -INFINITY}, {2, 2}, {.dtype = DType::f64});
  const std::vector<double> l = values(logsumexp(big_row, {1}));
  EXPECT_NEAR(l[0], 1000 + std::log(2.0), 1e-12);
  EXPECT_EQ(l[1], -INFINITY);
}

TEST(NewOps, ProdGradientWithZeros) {
  Tensor x = transposed_leaf({3, 5}, 8, 0.5, 1.5);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return prod(v[0], {1}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return prod(v[0]); }, {x}));
  // Lanes with one zero and with two zeros: the product of the others, hand-computed.
  Tensor z = leaf(from_vector<double>({2, 0, 3, 0, 5, 0, 2, 3, 4}, {3, 3}, {.dtype = DType::f64}));
  sum(prod(z, {1})).backward();
  EXPECT_EQ(values(z.grad()), (std::vector<double>{0, 6, 0, 0, 0, 0, 12, 8, 6}));
}

TEST(NewOps, CumsumGradientAndValues) {
  Tensor x = transposed_leaf({4, 7}, 9);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return cumsum(v[0], 1); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return cumsum(v[0], 0); }, {x}));
  Tensor i = from_vector<int32_t>({1, 2, 3, 4}, {4}, {.dtype = DType::i32});
  Tensor ci = cumsum(i, 0);
  EXPECT_EQ(ci.dtype(), DType::i64);
  EXPECT_EQ(values(ci), (std::vector<double>{1, 3, 6, 10}));
  EXPECT_EQ(values(ops::cumsum(i, 0, true)), (std::vector<double>{10, 9, 7, 4}));
}

TEST(NewOps, MaxMinTopkWithIndices) {
  Tensor x = transposed_leaf({5, 8}, 10);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return max(v[0], 1).values; }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return min(v[0], 0, true).values; }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return topk(v[0], 3, 1).values; }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return topk(v[0], 2, 0, false).values; }, {x}));
  Tensor t = from_vector<double>({3, 1, 4, 1, 5, 9, 2, 6}, {2, 4});
  ValuesIndices mx = max(t, 1);
  EXPECT_EQ(values(mx.values), (std::vector<double>{4, 9}));
  EXPECT_EQ(values(mx.indices), (std::vector<double>{2, 1}));
  ValuesIndices mn = min(t, 1);
  EXPECT_EQ(values(mn.indices), (std::vector<double>{1, 2}));  // first of the tied 1s
  ValuesIndices tk = topk(t, 3, 1);
  EXPECT_EQ(values(tk.values), (std::vector<double>{4, 3, 1, 9, 6, 5}));
  EXPECT_EQ(values(tk.indices), (std::vector<double>{2, 0, 1, 1, 3, 0}));
  EXPECT_EQ(values(topk(t, 2, 1, false).values), (std::vector<double>{1, 1, 2, 5}));
  EXPECT_THROW(topk(t, 5, 1), Error);
}

TEST(NewOps, GatherScatterIndexSelectGradients) {
  Tensor x = transposed_leaf({4, 6}, 11);
  Tensor index = from_vector<int64_t>({5, 0, 0, 3, 1, 2, 4, 4}, {4, 2}, {.dtype = DType::i64});
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return gather(v[0], 1, index); }, {x}));
  Tensor src = transposed_leaf({4, 3}, 12);  // larger than the index in dim 1: corner used
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return scatter_add(v[0], 1, index, v[1]); }, {x, src}));
  Tensor unique = from_vector<int64_t>({5, 0, 2, 3, 1, 2, 4, 0}, {4, 2}, {.dtype = DType::i64});
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return scatter(v[0], 1, unique, v[1]); }, {x, src}));
  Tensor rows = from_vector<int32_t>({3, 0, 3}, {3}, {.dtype = DType::i32});
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return index_select(v[0], 0, rows); }, {x}));
  // Values by hand.
  Tensor t = from_vector<double>({10, 11, 12, 20, 21, 22}, {2, 3});
  Tensor gi = from_vector<int64_t>({2, 0, 1, 1}, {2, 2}, {.dtype = DType::i64});
  EXPECT_EQ(values(gather(t, 1, gi)), (std::vector<double>{12, 10, 21, 21}));
  EXPECT_EQ(values(scatter_add(zeros({2, 3}, {.dtype = DType::f64}), 1, gi,
                               ones({2, 2}, {.dtype = DType::f64}))),
            (std::vector<double>{1, 0, 1, 0, 2, 0}));
  // Errors name the problem.
  Tensor bad = from_vector<int64_t>({3}, {1, 1}, {.dtype = DType::i64});
  EXPECT_THROW(gather(t, 1, bad), Error);
  EXPECT_THROW(scatter(t, 1, gi, t), Error);  // row 1 writes position 1 twice
}

TEST(NewOps, RmsNormMatchesComposedReference) {
  Tensor x = transposed_leaf({3, 4, 10}, 13), w = leaf(random_f64({10}, 14));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return rms_norm(v[0], v[1], 1e-5); }, {x, w}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return rms_norm(v[0], Tensor(), 1e-5); }, {x}));
  Tensor composed = x * rsqrt(mean(square(x), {-1}, true) + 1e-5) * w;
  EXPECT_LT(ops::max_rel_error(rms_norm(x, w, 1e-5), composed), 1e-14);
  // f32 on the same values, against the float64 result.
  Tensor x32 = x.detach().to(DType::f32), w32 = w.detach().to(DType::f32);
  EXPECT_LT(ops::max_rel_error(rms_norm(x32, w32, 1e-5), composed), 1e-6);
}

TEST(NewOps, RotaryEmbeddingRotatesHalves) {
  const int64_t B = 2, T = 5, H = 3, D = 8;
  // [B, H, T, D] stored, viewed as [B, T, H, D]: the layout attention heads come in.
  Tensor x = leaf(random_f64({B, H, T, D}, 15).transpose(1, 2));
  const ops::RopeTables tables = ops::rope_tables(0, T, D, 10000.0, DType::f64);
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return rotary_embedding(v[0], tables); }, {x}));
  // Element (b, t, h, i) by hand: HF's x * cos + rotate_half(x) * sin.
  const Tensor y = rotary_embedding(x, tables);
  const std::vector<double> xv = values(x), yv = values(y);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / D);
      const int64_t at = ((1 * T + t) * H + 2) * D;  // b = 1, h = 2
      EXPECT_NEAR(yv[at + i], xv[at + i] * std::cos(angle) - xv[at + i + D / 2] * std::sin(angle),
                  1e-14);
      EXPECT_NEAR(yv[at + i + D / 2],
                  xv[at + i + D / 2] * std::cos(angle) + xv[at + i] * std::sin(angle), 1e-14);
    }
  }
  // Tables for a later window equal the matching rows of a longer table (KV-cache decoding).
  const ops::RopeTables all = ops::rope_tables(0, 12, D, 500.0),
                        tail = ops::rope_tables(7, 5, D, 500.0);
  EXPECT_TRUE(ops::allclose(ops::narrow(all.cos, 0, 7, 5), tail.cos, 0, 0));
  EXPECT_THROW(rotary_embedding(x, ops::rope_tables(0, T + 1, D, 1e4, DType::f64)), Error);
}

TEST(NewOps, MultinomialAndSamplingFollowTheDistribution) {
  Generator gen(16);
  Tensor probs =
      from_vector<double>({0.1, 0.0, 0.6, 0.3, 1.0, 0.0, 0.0, 0.0}, {2, 4}, {.dtype = DType::f32});
  const int64_t n = 20000;
  const std::vector<double> draws = values(multinomial(probs, n, &gen));
  std::vector<double> freq(8, 0.0);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t j = 0; j < n; ++j) freq[r * 4 + static_cast<int64_t>(draws[r * n + j])] += 1.0 / n;
  const std::vector<double> p = values(probs);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(freq[i], p[i], 0.015) << "category " << i;
  EXPECT_EQ(freq[1], 0.0);  // zero probability is never drawn
  EXPECT_THROW(multinomial(from_vector<double>({0.5, -0.1}, {2}), 1, &gen), Error);
  // top-k sampling never leaves the k best; temperature 0 is argmax.
  Tensor logits = from_vector<double>({0.0, 3.0, 2.9, -1.0, 1.0, 2.0}, {1, 6});
  for (int i = 0; i < 200; ++i) {
    const int64_t t = static_cast<int64_t>(sample_logits(logits, 1.0, 2, &gen).item());
    EXPECT_TRUE(t == 1 || t == 2) << t;
  }
  EXPECT_EQ(sample_logits(logits, 0.0, 0, &gen).item(), 1.0);
}

}  // namespace
}  // namespace tessera
