// Every differentiable function's backward against finite differences (float64),
// with broadcasting, non-contiguous inputs and odd sizes.
#include "gradcheck.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using Xs = std::vector<Tensor>;

// A float64 leaf of N(0,1) values (or uniform [low, high)).
Tensor input(const Shape& shape, uint64_t seed, double low = 0.0, double high = 0.0) {
  return leaf(random_f64(shape, seed, low, high));
}
// A non-contiguous float64 leaf of `shape` (2-D at least): the transpose of a stored tensor.
Tensor transposed_input(const Shape& shape, uint64_t seed, double low = 0.0, double high = 0.0) {
  Shape stored = shape;
  std::swap(stored[stored.size() - 1], stored[stored.size() - 2]);
  Tensor t = leaf(random_f64(stored, seed, low, high).transpose(-1, -2));
  EXPECT_FALSE(t.is_contiguous());
  return t;
}

TEST(Gradients, ArithmeticBroadcasting) {
  Tensor a = input({3, 1, 5}, 1), b = transposed_input({4, 5}, 2);
  Tensor pos = transposed_input({4, 5}, 3, 0.5, 2.0);
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] + x[1]; }, {a, b}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] - x[1]; }, {a, b}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] * x[1]; }, {a, b}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] / x[1]; }, {a, pos}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[1] / x[0]; },
                        {input({7}, 4, 0.5, 2.0), input({33, 1}, 5)}));
}

TEST(Gradients, OneSideOnly) {
  // Only one operand requires grad: the other's gradient is skipped, the first is right.
  Tensor a = input({2, 7}, 6);
  Tensor constant = random_f64({7}, 7, 0.5, 2.0);
  EXPECT_TRUE(gradcheck([&](const Xs& x) { return x[0] * constant; }, {a}));
  EXPECT_TRUE(
      gradcheck([&](const Xs& x) { return constant / x[0]; }, {input({2, 7}, 8, 0.5, 2.0)}));
  EXPECT_TRUE(gradcheck([&](const Xs& x) { return matmul(constant.view({1, 7}), x[0].t()); }, {a}));
}

TEST(Gradients, ScalarArithmetic) {
  Tensor a = transposed_input({3, 7}, 9, 0.5, 2.0);
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] + 2.5; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] - 1.5; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] * 3.0; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return x[0] / 4.0; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return 2.5 + x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return 1.5 - x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return 3.0 * x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return 2.0 / x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return -x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return neg(x[0]); }, {a}));
}

struct UnaryCase {
  const char* name;
  Tensor (*fn)(const Tensor&);
  double low, high;  // input range (low == high: normal)
};

TEST(Gradients, UnaryFunctions) {
  const UnaryCase cases[] = {
      {"exp", exp, 0, 0},         {"log", log, 0.5, 3.0}, {"sqrt", sqrt, 0.5, 3.0},
      {"rsqrt", rsqrt, 0.5, 3.0}, {"tanh", tanh, 0, 0},   {"sigmoid", sigmoid, 0, 0},
      {"relu", relu, 0, 0},       {"gelu", gelu, 0, 0},   {"abs", abs, 0, 0},
      {"square", square, 0, 0},
  };
  uint64_t seed = 100;
  for (const UnaryCase& c : cases) {
    SCOPED_TRACE(c.name);
    auto f = c.fn;
    EXPECT_TRUE(gradcheck([f](const Xs& x) { return f(x[0]); },
                          {transposed_input({7, 3}, seed++, c.low, c.high)}));
    EXPECT_TRUE(
        gradcheck([f](const Xs& x) { return f(x[0]); }, {input({33}, seed++, c.low, c.high)}));
  }
}

TEST(Gradients, Pow) {
  Tensor base = transposed_input({3, 5}, 20, 0.5, 2.0);
  Tensor exponent = input({5}, 21, -1.5, 2.5);
  EXPECT_TRUE(gradcheck([](const Xs& x) { return pow(x[0], x[1]); }, {base, exponent}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return pow(x[0], 2.7); }, {base}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return pow(x[0], -0.5); }, {base}));
}

TEST(Gradients, MaximumMinimum) {
  Tensor a = input({4, 1, 7}, 22), b = transposed_input({3, 7}, 23);
  EXPECT_TRUE(gradcheck([](const Xs& x) { return maximum(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](const Xs& x) { return minimum(x[0], x[1]); }, {a, b}));
}

TEST(Gradients, MaximumSplitsTiesEvenly) {
  Tensor a = leaf(full({3}, 2.0, {.dtype = DType::f64}));
  Tensor b = leaf(full({3}, 2.0, {.dtype = DType::f64}));
  sum(maximum(a, b)).backward();
  EXPECT_EQ(a.grad().to_vector<double>(), std::vector<double>(3, 0.5));
  EXPECT_EQ(b.grad().to_vector<double>(), std::vector<double>(3, 0.5));
}

TEST(Gradients, SumMean) {
  Tensor x = transposed_input({2, 7, 3}, 30);
  for (bool keepdim : {false, true}) {
    SCOPED_TRACE(keepdim);
    EXPECT_TRUE(gradcheck([](const Xs& v) { return sum(v[0]); }, {x}));
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return sum(v[0], {1}, keepdim); }, {x}));
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return sum(v[0], {0, -1}, keepdim); }, {x}));
    EXPECT_TRUE(gradcheck([](const Xs& v) { return mean(v[0]); }, {x}));
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return mean(v[0], {-2}, keepdim); }, {x}));
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return mean(v[0], {0, 2}, keepdim); }, {x}));
  }
}

TEST(Gradients, AmaxAmin) {
  Tensor x = transposed_input({3, 7}, 31);
  for (bool keepdim : {false, true}) {
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return amax(v[0], {1}, keepdim); }, {x}));
    EXPECT_TRUE(gradcheck([&](const Xs& v) { return amin(v[0], {0}, keepdim); }, {x}));
  }
  EXPECT_TRUE(gradcheck([](const Xs& v) { return amax(v[0]); }, {input({2, 3, 5}, 32)}));
}

TEST(Gradients, AmaxSplitsTiesEvenly) {
  Tensor x = leaf(from_vector<double>({1, 5, 5, 2, 5, 0}, {2, 3}));
  sum(amax(x, {1})).backward();
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 0.5, 0, 1, 0}));
}

TEST(Gradients, SoftmaxLogSoftmax) {
  Tensor x = transposed_input({5, 7}, 40);
  for (int64_t dim : {0, 1, -1}) {
    SCOPED_TRACE(dim);
    EXPECT_TRUE(gradcheck([dim](const Xs& v) { return softmax(v[0], dim); }, {x}));
    EXPECT_TRUE(gradcheck([dim](const Xs& v) { return log_softmax(v[0], dim); }, {x}));
  }
  EXPECT_TRUE(gradcheck([](const Xs& v) { return log_softmax(v[0], 1); }, {input({2, 33, 3}, 41)}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return softmax(v[0], -1); }, {input({1, 257}, 42)}));
}

TEST(Gradients, LayerNorm) {
  Tensor x = transposed_input({2, 3, 7}, 50);
  Tensor w = input({7}, 51), b = input({7}, 52);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return layer_norm(v[0], v[1], v[2], 1e-5); }, {x, w, b}));
  EXPECT_TRUE(
      gradcheck([](const Xs& v) { return layer_norm(v[0], Tensor(), Tensor(), 1e-5); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return layer_norm(v[0], v[1], Tensor(), 1e-3); },
                        {input({1, 33}, 53), input({33}, 54)}));
}

TEST(Gradients, Matmul) {
  struct Case {
    Shape a, b;
  };
  const Case cases[] = {
      {{5, 7}, {7, 3}},    {{2, 5, 7}, {7, 3}},       {{7}, {7, 3}},    {{5, 7}, {7}},
      {{7}, {7}},          {{2, 1, 5, 7}, {3, 7, 4}}, {{7}, {2, 7, 3}}, {{2, 5, 7}, {7}},
      {{5, 7}, {2, 7, 3}}, {{1, 1}, {1, 33}},
  };
  uint64_t seed = 60;
  for (const Case& c : cases) {
    SCOPED_TRACE(shape_str(c.a) + " @ " + shape_str(c.b));
    EXPECT_TRUE(gradcheck([](const Xs& v) { return matmul(v[0], v[1]); },
                          {input(c.a, seed++), input(c.b, seed++)}));
  }
  // Transposed operands.
  EXPECT_TRUE(gradcheck([](const Xs& v) { return matmul(v[0], v[1]); },
                        {transposed_input({5, 7}, 70), transposed_input({2, 7, 3}, 71)}));
}

TEST(Gradients, Linear) {
  Tensor w = transposed_input({7, 5}, 80), b = input({5}, 81);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return linear(v[0], v[1], v[2]); },
                        {input({2, 3, 7}, 82), w, b}));
  EXPECT_TRUE(
      gradcheck([](const Xs& v) { return linear(v[0], v[1]); }, {transposed_input({3, 7}, 83), w}));
  EXPECT_TRUE(
      gradcheck([](const Xs& v) { return linear(v[0], v[1], v[2]); }, {input({7}, 84), w, b}));
  EXPECT_THROW(linear(input({3, 5}, 85), w, b), Error);
}

TEST(Gradients, Embedding) {
  Tensor weight = input({7, 5}, 90);
  Tensor ids = from_vector<int64_t>({3, 0, 3, 6, 1, 3}, {2, 3}, {.dtype = DType::i64});
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return embedding(v[0], ids); }, {weight}));
  Tensor ids32 = from_vector<int32_t>({6, 6, 2}, {3}, {.dtype = DType::i32});
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return embedding(v[0], ids32); }, {weight}));
}

// Float64 cross-entropy on the host (logits [..., V], targets [...]). The numeric side of
// the check uses it because the op reduces Mean/Sum losses in float32, too coarse for
// finite differences at 1e-6.
Tensor reference_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                               Reduction reduction) {
  const int64_t vocab = logits.size(-1), rows = logits.numel() / vocab;
  const std::vector<double> x = ops::contiguous(logits).to_vector<double>();
  const std::vector<int64_t> t = ops::contiguous(targets.to(DType::i64)).to_vector<int64_t>();
  std::vector<double> per_row(rows, 0.0);
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (t[r] == ignore_index) continue;
    double max = x[r * vocab];
    for (int64_t v = 0; v < vocab; ++v) max = std::max(max, x[r * vocab + v]);
    double denominator = 0.0;
    for (int64_t v = 0; v < vocab; ++v) denominator += std::exp(x[r * vocab + v] - max);
    per_row[r] = std::log(denominator) + max - x[r * vocab + t[r]];
    total += per_row[r];
    ++counted;
  }
  if (reduction == Reduction::None)
    return from_vector<double>(per_row, targets.shape(), {.dtype = DType::f64});
  const double loss = reduction == Reduction::Mean ? total / static_cast<double>(counted) : total;
  return from_vector<double>({loss}, {}, {.dtype = DType::f64});
}

::testing::AssertionResult check_cross_entropy(const Tensor& logits, const Tensor& targets,
                                               int64_t ignore_index, Reduction reduction) {
  using testing::MultiFn;
  return testing::gradcheck_against(
      MultiFn(
          [&](const Xs& v) { return Xs{cross_entropy(v[0], targets, ignore_index, reduction)}; }),
      MultiFn([&](const Xs& v) {
        return Xs{reference_cross_entropy(v[0], targets, ignore_index, reduction)};
      }),
      {logits});
}

TEST(Gradients, CrossEntropy) {
  Tensor logits = input({2, 3, 7}, 100);
  Tensor targets = from_vector<int64_t>({3, -100, 0, 6, 6, 2}, {2, 3}, {.dtype = DType::i64});
  for (Reduction r : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    SCOPED_TRACE(static_cast<int>(r));
    EXPECT_TRUE(check_cross_entropy(logits, targets, -100, r));
    // The forward agrees with the reference too (float32 accuracy for Mean/Sum).
    EXPECT_LT(ops::max_rel_error(cross_entropy(logits, targets, -100, r).to(DType::f64),
                                 reference_cross_entropy(logits, targets, -100, r)),
              1e-6);
  }
  // None: the per-row forward is float64, so the op itself passes plain finite differences.
  EXPECT_TRUE(gradcheck(
      [&](const Xs& v) { return cross_entropy(v[0], targets, -100, Reduction::None); }, {logits}));
  Tensor flat_targets = from_vector<int32_t>({1, 0, 4}, {3}, {.dtype = DType::i32});
  EXPECT_TRUE(check_cross_entropy(transposed_input({3, 5}, 101), flat_targets, 4, Reduction::Mean));
  Tensor wide_targets = from_vector<int64_t>({256, 0}, {2}, {.dtype = DType::i64});
  EXPECT_TRUE(check_cross_entropy(input({2, 257}, 102), wide_targets, -100, Reduction::Sum));
}

TEST(Gradients, CatStackSplitChunk) {
  Tensor a = transposed_input({3, 2}, 110), b = input({3, 5}, 111), c = input({3, 1}, 112);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return cat(v, 1); }, {a, b, c}));
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        return cat({v[0], v[1]}, -2);
      },
      {input({2, 3}, 113), transposed_input({3, 3}, 114)}));
  Tensor p = input({3, 2}, 115);
  EXPECT_TRUE(gradcheck([](const Xs& v) { return stack(v, 0); }, {a, p}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return stack(v, 2); }, {a, p}));
  Tensor x = transposed_input({7, 5}, 116);
  EXPECT_TRUE(gradcheck(testing::MultiFn([](const Xs& v) { return split(v[0], 3, 0); }), {x}));
  EXPECT_TRUE(gradcheck(testing::MultiFn([](const Xs& v) {
                          return split(v[0], std::vector<int64_t>{1, 4}, 1);
                        }),
                        {x}));
  EXPECT_TRUE(gradcheck(testing::MultiFn([](const Xs& v) { return chunk(v[0], 3, -1); }), {x}));
  // Only some pieces used: the others get zero gradient.
  EXPECT_TRUE(gradcheck([](const Xs& v) { return square(split(v[0], 2, 0)[1]); }, {x}));
}

TEST(Gradients, WhereMaskedFill) {
  Tensor cond = from_vector<uint8_t>({1, 0, 0, 1, 1, 0, 1}, {7}).to(DType::boolean);
  Tensor a = transposed_input({3, 7}, 120), b = input({7}, 121);
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return where(cond, v[0], v[1]); }, {a, b}));
  Tensor mask = from_vector<uint8_t>({0, 1, 1}, {3, 1}).to(DType::boolean);
  EXPECT_TRUE(gradcheck([&](const Xs& v) { return masked_fill(v[0], mask, -3.5); }, {a}));
}

TEST(Gradients, Dropout) {
  Tensor x = transposed_input({7, 33}, 130);
  // A fresh generator per call: every evaluation draws the same mask.
  auto fn = [](const Xs& v) {
    Generator gen(5);
    return dropout(v[0], 0.3, true, &gen);
  };
  EXPECT_TRUE(gradcheck(fn, {x}));
  Tensor y = fn({x.detach()});
  std::vector<double> in = x.contiguous().to_vector<double>(), out = y.to_vector<double>();
  int zeroed = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (out[i] == 0.0) {
      ++zeroed;
    } else {
      EXPECT_NEAR(out[i], in[i] / 0.7, 1e-12);
    }
  }
  EXPECT_GT(zeroed, 20);
  EXPECT_LT(zeroed, 130);
  EXPECT_TRUE(dropout(x, 0.3, false).is_same(x));
  EXPECT_THROW(dropout(x, 1.5, true), Error);
}

TEST(Gradients, Views) {
  Tensor x = transposed_input({3, 4, 5}, 140);  // strides of the transpose of [3, 5, 4]
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].reshape({12, 5}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].contiguous().view({5, 12}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].flatten(1); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].transpose(0, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].permute({2, 0, 1}) * 2.0; }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].narrow(1, 1, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].slice(2, 0, 5, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].select(0, -1); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].unsqueeze(1).squeeze(1); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].narrow(0, 1, 1).squeeze(); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].unsqueeze(0).expand({2, 3, 4, 5}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].narrow(1, 0, 1).expand({3, 7, 5}); }, {x}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return v[0].clone() * v[0].contiguous(); }, {x}));
  EXPECT_TRUE(
      gradcheck([](const Xs& v) { return v[0].to(DType::f64).to(Device::cpu()) * 2.0; }, {x}));
}

TEST(Gradients, UsedTwiceAndChained) {
  // Several paths to one input accumulate; a longer chain composes.
  Tensor x = transposed_input({3, 7}, 150), w = input({7, 5}, 151);
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) { return tanh(matmul(v[0] * v[0], v[1])) + sum(v[0], {1}, true); }, {x, w}));
}

TEST(Gradients, CopyAndFillRewriteHistory) {
  Tensor x = input({3, 7}, 160);
  // copy_ into a tensor that does not require grad: it joins the graph through the source.
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        Tensor dst = zeros({2, 3, 7}, {.dtype = DType::f64});
        dst.copy_(v[0] * 3.0);
        return dst * dst;
      },
      {x}));
  // Writing into a non-leaf cuts the old value off: only the later use of x counts.
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        Tensor y = exp(v[0]) * 1.0;
        y.fill_(2.0);
        return y * v[0];
      },
      {x}));
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        Tensor y = square(v[0]);
        y.copy_(v[1]);
        return y * v[0];
      },
      {x, input({7}, 161)}));
}

}  // namespace
}  // namespace tessera
