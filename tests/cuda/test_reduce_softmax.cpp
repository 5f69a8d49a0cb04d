// reduce, arg_reduce, softmax (+backward) and cross-entropy (+backward) against float64.
#include <cmath>

#include "cuda_test_util.h"

namespace tessera {
namespace {
using namespace cuda_test;

// Row-major index helpers for a 3-D reference.
struct Dims3 {
  int64_t a, b, c;
  int64_t at(int64_t i, int64_t j, int64_t k) const { return (i * b + j) * c + k; }
};

TEST(CudaReduce, AllOpsOverEveryDimSubset) {
  TESSERA_REQUIRE_GPU();
  const Dims3 s{7, 33, 5};
  for (DType t : {DType::f32, DType::bf16, DType::f64}) {
    // Non-contiguous input: a permuted view of a [5, 7, 33] tensor.
    Tensor h = host_uniform({5, 7, 33}, 0.6, 1.4, t);
    Tensor xd = raw::permute(to_gpu(h), {1, 2, 0});
    Tensor hx = raw::contiguous(raw::permute(h, {1, 2, 0}));
    const auto x = values(hx);
    for (int mask = 1; mask < 8; ++mask) {
      std::vector<int64_t> dims;
      for (int d = 0; d < 3; ++d)
        if (mask & (1 << d)) dims.push_back(d);
      Shape out_shape = {mask & 1 ? 1 : s.a, mask & 2 ? 1 : s.b, mask & 4 ? 1 : s.c};
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod}) {
        if (op == ReduceOp::Prod && mask == 7) continue;  // a product of 1155 factors under/overflows
        Tensor out = poisoned(out_shape, t);
        gpu().reduce(op, xd, dims, out);
        const int64_t n_out = shape_numel(out_shape);
        std::vector<double> ref(n_out);
        std::vector<double> cnt(n_out, 0);
        for (int64_t o = 0; o < n_out; ++o)
          ref[o] = op == ReduceOp::Prod ? 1 : op == ReduceOp::Max ? -INFINITY : op == ReduceOp::Min ? INFINITY : 0;
        for (int64_t i = 0; i < s.a; ++i)
          for (int64_t j = 0; j < s.b; ++j)
            for (int64_t k = 0; k < s.c; ++k) {
              const int64_t o = ((mask & 1 ? 0 : i) * out_shape[1] + (mask & 2 ? 0 : j)) * out_shape[2] + (mask & 4 ? 0 : k);
              const double v = x[s.at(i, j, k)];
              double& r = ref[o];
              if (op == ReduceOp::Sum || op == ReduceOp::Mean) r += v;
              else if (op == ReduceOp::Prod) r *= v;
              else if (op == ReduceOp::Max) r = std::max(r, v);
              else r = std::min(r, v);
              cnt[o] += 1;
            }
        if (op == ReduceOp::Mean)
          for (int64_t o = 0; o < n_out; ++o) ref[o] /= cnt[o];
        expect_close(values(out), ref, std::max(tolerance(t), 1e-6),
                     (std::string(reduce_op_name(op)) + " mask " + std::to_string(mask)).c_str());
      }
    }
  }
}

TEST(CudaReduce, LongRowsUseTheWholeBlock) {
  TESSERA_REQUIRE_GPU();
  Tensor h = host_randn({3, 100003});
  Tensor out = poisoned({3, 1}, DType::f32);
  gpu().reduce(ReduceOp::Sum, to_gpu(h), {1}, out);
  const auto x = values(h);
  std::vector<double> ref(3, 0);
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 100003; ++i) ref[r] += x[r * 100003 + i];
  // Sum of 1e5 N(0,1) values: compare against the sum's scale, sqrt(n).
  for (int r = 0; r < 3; ++r) EXPECT_NEAR(values(out)[r], ref[r], 1e-5 * 100003 * 0.01);
}

TEST(CudaReduce, ArgMaxMinFirstIndexOnTies) {
  TESSERA_REQUIRE_GPU();
  // Values drawn from a small set so ties are common.
  Tensor h = raw::to(randint(0, 5, {9, 37}, {.dtype = DType::i64}), Device::cpu(), DType::f32);
  const auto x = values(h);
  for (bool is_max : {true, false}) {
    for (int64_t dim : {0, 1}) {
      Shape os = {dim == 0 ? 1 : 9, dim == 1 ? 1 : 37};
      Tensor out = poisoned(os, DType::i64);
      gpu().arg_reduce(is_max, to_gpu(h), dim, out);
      const auto got = out.to_vector<int64_t>();
      const int64_t n_out = shape_numel(os), len = dim == 0 ? 9 : 37;
      for (int64_t o = 0; o < n_out; ++o) {
        int64_t best = 0;
        for (int64_t i = 0; i < len; ++i) {
          const double v = dim == 0 ? x[i * 37 + o] : x[o * 37 + i];
          const double bv = dim == 0 ? x[best * 37 + o] : x[o * 37 + best];
          if (is_max ? v > bv : v < bv) best = i;
        }
        EXPECT_EQ(got[o], best) << (is_max ? "argmax" : "argmin") << " dim " << dim << " out " << o;
      }
    }
  }
}

std::vector<double> ref_softmax(const std::vector<double>& x, int64_t outer, int64_t len,
                                int64_t inner, bool log_out) {
  std::vector<double> y(x.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t in = 0; in < inner; ++in) {
      auto at = [&](int64_t i) { return (o * len + i) * inner + in; };
      double m = -INFINITY, s = 0;
      for (int64_t i = 0; i < len; ++i) m = std::max(m, x[at(i)]);
      for (int64_t i = 0; i < len; ++i) s += std::exp(x[at(i)] - m);
      for (int64_t i = 0; i < len; ++i)
        y[at(i)] = log_out ? x[at(i)] - m - std::log(s) : std::exp(x[at(i)] - m) / s;
    }
  return y;
}

TEST(CudaSoftmax, ForwardAndBackwardOverLastAndInnerDims) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t len : {1, 7, 257, 2053}) {
      for (int64_t dim : {1, 2}) {
        Shape shape = dim == 2 ? Shape{3, 5, len} : Shape{3, len, 5};
        const int64_t outer = dim == 2 ? 15 : 3, inner = dim == 2 ? 1 : 5;
        for (bool log_out : {false, true}) {
          Tensor xh = host_randn(shape, t, 0.0, 3.0);
          Tensor y = poisoned(shape, t);
          gpu().softmax(to_gpu(xh), dim, log_out, y);
          const auto yref = ref_softmax(values(xh), outer, len, inner, log_out);
          expect_close(values(y), yref, tolerance(t), "softmax");

          Tensor dyh = host_randn(shape, t);
          Tensor dx = poisoned(shape, t);
          gpu().softmax_backward(y, to_gpu(dyh), dim, log_out, dx);
          // Reference from the kernel's own y (as autograd would use it).
          const auto yv = values(y), dy = values(dyh);
          std::vector<double> ref(yv.size());
          for (int64_t o = 0; o < outer; ++o)
            for (int64_t in = 0; in < inner; ++in) {
              auto at = [&](int64_t i) { return (o * len + i) * inner + in; };
              double s = 0;
              for (int64_t i = 0; i < len; ++i) s += log_out ? dy[at(i)] : dy[at(i)] * yv[at(i)];
              for (int64_t i = 0; i < len; ++i)
                ref[at(i)] = log_out ? dy[at(i)] - std::exp(yv[at(i)]) * s : yv[at(i)] * (dy[at(i)] - s);
            }
          expect_close(values(dx), ref, tolerance(t) * 2, "softmax_backward");
        }
      }
    }
  }
}

TEST(CudaCrossEntropy, LossCountAndGradientWithIgnoredRows) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t vocab : {7, 3001}) {
      const int64_t rows = 33;
      Tensor lh = host_randn({rows, vocab}, t, 0.0, 2.0);
      std::vector<int64_t> tg(rows);
      Tensor rnd = randint(0, vocab, {rows}, {.dtype = DType::i64});
      tg = rnd.to_vector<int64_t>();
      tg[3] = -100;
      tg[20] = -100;
      Tensor targets = to_gpu(from_vector(tg, {rows}, {.dtype = DType::i64}));
      Tensor loss = poisoned({}, DType::f32), count = poisoned({}, DType::i64);
      gpu().cross_entropy(to_gpu(lh), targets, -100, loss, count);
      const auto x = values(lh);
      double total = 0;
      int n = 0;
      std::vector<double> ref_grad(x.size(), 0.0);
      const double scale = 0.37;
      for (int64_t r = 0; r < rows; ++r) {
        if (tg[r] == -100) continue;
        double m = -INFINITY, s = 0;
        for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[r * vocab + i]);
        for (int64_t i = 0; i < vocab; ++i) s += std::exp(x[r * vocab + i] - m);
        total += std::log(s) + m - x[r * vocab + tg[r]];
        ++n;
        for (int64_t i = 0; i < vocab; ++i)
          ref_grad[r * vocab + i] = scale * (std::exp(x[r * vocab + i] - m) / s - (i == tg[r]));
      }
      EXPECT_EQ(count.item(), n);
      EXPECT_NEAR(loss.item(), total, 1e-5 * total) << "loss is the sum over counted rows";
      Tensor dl = poisoned({rows, vocab}, t);
      gpu().cross_entropy_backward(to_gpu(lh), targets, -100, scale, dl);
      expect_close(values(dl), ref_grad, tolerance(t), "dlogits");
    }
  }
}

TEST(CudaCrossEntropy, OutOfRangeTargetIsAnError) {
  TESSERA_REQUIRE_GPU();
  Tensor logits = to_gpu(host_randn({4, 10}));
  Tensor targets = to_gpu(from_vector(std::vector<int32_t>{1, 2, 10, 3}, {4}, {.dtype = DType::i32}));
  Tensor loss = empty({}, {.dtype = DType::f32, .device = dev()});
  Tensor count = empty({}, {.dtype = DType::i64, .device = dev()});
  EXPECT_THROW(gpu().cross_entropy(logits, targets, -100, loss, count), Error);
}


// Softmax over the last dim on the register-resident path: rows of a multiple of 8 from one
// pack per warp lane up to 32768 (1024 threads x 4 packs), partly filled groups (1032, 8200),
// a row past the limit (32776, general kernel), f16, -inf entries (masked attention scores)
// and a non-contiguous input.
TEST(CudaSoftmax, RegisterRowsAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t len : {8, 64, 1024, 1032, 4096, 8200, 32768, 32776}) {
      const int64_t rows = len <= 1032 ? 37 : 3;
      for (bool log_out : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " len " + std::to_string(len) +
                     (log_out ? " log" : ""));
        std::vector<double> x = values(host_randn({rows, len}, t, 0.5, 3.0));
        for (int64_t r = 0; r < rows; ++r)  // a few masked entries, never a whole row
          for (int64_t i = r % 5; i < len; i += 7) x[r * len + i] = -INFINITY;
        Tensor xh = raw::to(from_vector(x, {rows, len}, {.dtype = DType::f64}), Device::cpu(), t);
        Tensor y = poisoned({rows, len}, t);
        gpu().softmax(to_gpu(xh), 1, log_out, y);
        expect_close(values(y), ref_softmax(values(xh), rows, len, 1, log_out), tolerance(t),
                     "softmax rows");
      }
    }
  }
  // Non-contiguous: the transpose of a [len, rows] tensor, softmax over its last dim.
  const int64_t rows = 19, len = 512;
  Tensor st = host_randn({len, rows}, DType::f32, 0.0, 2.0);
  Tensor xt = raw::transpose(to_gpu(st), 0, 1);
  Tensor y = poisoned({rows, len}, DType::f32);
  gpu().softmax(xt, 1, false, y);
  const auto sv = values(st);
  std::vector<double> xr(rows * len);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < len; ++i) xr[r * len + i] = sv[i * rows + r];
  expect_close(values(y), ref_softmax(xr, rows, len, 1, false), tolerance(DType::f32),
               "softmax of a transposed view");
}


// Cross-entropy on the packed path (vocab a multiple of 8) and the element path, long rows
// (a block per row), f16, masked (-inf) logits that are not the target, ignored rows.
TEST(CudaCrossEntropy, PackedLongRowsAndMaskedLogits) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t vocab : {8, 1032, 4097, 50304}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " vocab " + std::to_string(vocab));
      const int64_t rows = vocab > 5000 ? 5 : 23;
      std::vector<double> x = values(host_randn({rows, vocab}, t, 0.0, 2.0));
      std::vector<int64_t> tg = randint(0, vocab, {rows}, {.dtype = DType::i64}).to_vector<int64_t>();
      tg[1] = -100;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = r % 5; i < vocab; i += 7)
          if (i != tg[r]) x[r * vocab + i] = -INFINITY;
      Tensor lh = raw::to(from_vector(x, {rows, vocab}, {.dtype = DType::f64}), Device::cpu(), t);
      x = values(lh);
      const double scale = 0.37;
      double total = 0;
      std::vector<double> ref_grad(x.size(), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        if (tg[r] == -100) continue;
        double m = -INFINITY, s = 0;
        for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[r * vocab + i]);
        for (int64_t i = 0; i < vocab; ++i) s += std::exp(x[r * vocab + i] - m);
        total += std::log(s) + m - x[r * vocab + tg[r]];
        for (int64_t i = 0; i < vocab; ++i)
          ref_grad[r * vocab + i] = scale * (std::exp(x[r * vocab + i] - m) / s - (i == tg[r]));
      }
      Tensor targets = to_gpu(from_vector(tg, {rows}, {.dtype = DType::i64}));
      Tensor loss = poisoned({}, DType::f32), count = poisoned({}, DType::i64);
      gpu().cross_entropy(to_gpu(lh), targets, -100, loss, count);
      EXPECT_EQ(count.item(), rows - 1);
      EXPECT_NEAR(loss.item(), total, 1e-5 * std::fabs(total));
      Tensor dl = poisoned({rows, vocab}, t);
      gpu().cross_entropy_backward(to_gpu(lh), targets, -100, scale, dl);
      expect_close(values(dl), ref_grad, tolerance(t), "dlogits");
    }
  }
}

}  // namespace
}  // namespace tessera
