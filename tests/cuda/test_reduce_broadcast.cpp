// The fast reduction paths (column: kept dims innermost, e.g. the bias gradient; split: few
// outputs with many elements each, e.g. a full sum), the broadcast binary path (bias vectors,
// columns, scalars over a contiguous output) and the layer-norm parameter gradients over many
// rows, all against float64 references computed here; reductions also run twice and must
// repeat bitwise.
#include <cmath>
#include <cstring>
#include <string>

#include "cuda_test_util.h"
#include "tessera/kernels/ops.h"

namespace tessera {
namespace {
using namespace cuda_test;

// ---- reductions ----

// x holds a logical [outer, mid, inner] block (row-major); the reference reduces over mid.
std::vector<double> ref_reduce(const std::vector<double>& x, int64_t outer, int64_t mid,
                               int64_t inner, ReduceOp op) {
  const double init = op == ReduceOp::Prod  ? 1.0
                      : op == ReduceOp::Max ? -INFINITY
                      : op == ReduceOp::Min ? INFINITY
                                            : 0.0;
  std::vector<double> out(outer * inner, init);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t m = 0; m < mid; ++m)
      for (int64_t i = 0; i < inner; ++i) {
        const double v = x[(o * mid + m) * inner + i];
        double& r = out[o * inner + i];
        if (op == ReduceOp::Sum || op == ReduceOp::Mean) r += v;
        else if (op == ReduceOp::Prod) r *= v;
        else if (op == ReduceOp::Max) r = (std::isnan(r) || std::isnan(v)) ? NAN : std::max(r, v);
        else r = (std::isnan(r) || std::isnan(v)) ? NAN : std::min(r, v);
      }
  if (op == ReduceOp::Mean)
    for (double& r : out) r /= static_cast<double>(mid);
  return out;
}

Shape keepdim_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out = shape;
  for (int64_t d : dims) out[d] = 1;
  return out;
}

// Reduces the GPU view twice (bitwise-equal results required) and compares with the
// reference over the host view's values laid out as [outer, mid, inner].
void check_reduce(const Tensor& xd, const Tensor& host_view, const std::vector<int64_t>& dims,
                  int64_t outer, int64_t mid, int64_t inner, ReduceOp op, double rtol,
                  const std::string& what) {
  SCOPED_TRACE(what + " " + reduce_op_name(op) + " " + shape_str(xd.shape()) + " " +
               dtype_name(xd.dtype()));
  const Shape out_shape = keepdim_shape(xd.shape(), dims);
  DType out_dtype = xd.dtype();
  if (is_integral(out_dtype) && (op == ReduceOp::Sum || op == ReduceOp::Prod)) out_dtype = DType::i64;
  Tensor first = poisoned(out_shape, out_dtype), second = poisoned(out_shape, out_dtype);
  gpu().reduce(op, xd, dims, first);
  gpu().reduce(op, xd, dims, second);
  const auto got = values(first), again = values(second);
  const auto ref = ref_reduce(values(raw::contiguous(host_view)), outer, mid, inner, op);
  expect_close(got, ref, rtol, "reduce");
  ASSERT_EQ(got.size(), again.size());
  EXPECT_EQ(0, std::memcmp(got.data(), again.data(), got.size() * sizeof(double)))
      << "two runs differ bitwise";
}

constexpr ReduceOp kAllButProd[] = {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min};

TEST(CudaColumnReduce, OverLeadingDimOfMatrices) {
  TESSERA_REQUIRE_GPU();
  const Shape shapes[] = {{16384, 768}, {257, 33}, {1, 7}, {5000, 3}, {300, 769}, {2, 4096}};
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (const Shape& s : shapes) {
      if (s[0] * s[1] > 1000000 && (t == DType::f16 || t == DType::f64)) continue;  // keep it quick
      Tensor h = host_randn(s, t, 0.3, 1.0);
      Tensor xd = to_gpu(h);
      for (ReduceOp op : kAllButProd)
        check_reduce(xd, h, {0}, 1, s[0], s[1], op, tolerance(t), "dim 0");
    }
  }
}

TEST(CudaColumnReduce, ProdAndIntegerInputs) {
  TESSERA_REQUIRE_GPU();
  // Factors near 1 keep a product of 300 terms finite.
  Tensor h = host_uniform({300, 40}, 0.97, 1.03, DType::f32);
  check_reduce(to_gpu(h), h, {0}, 1, 300, 40, ReduceOp::Prod, 1e-4, "prod");
  // Integers take the run-time dtype path and sum into int64 exactly.
  Tensor hi = randint(-1000, 1000, {777, 13}, {.dtype = DType::i32});
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min})
    check_reduce(to_gpu(hi), hi, {0}, 1, 777, 13, op, 0.0, "int32");
}

TEST(CudaColumnReduce, ThreeDimsAndNonContiguousViews) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    // Dims {0, 1} of a 3-D tensor: the bias gradient of a [B, T, C] activation.
    Tensor h3 = host_randn({33, 65, 40}, t, 0.2, 1.0);
    for (ReduceOp op : kAllButProd)
      check_reduce(to_gpu(h3), h3, {0, 1}, 1, 33 * 65, 40, op, tolerance(t), "dims {0,1}");
    // A kept dim in the middle falls back to the generic kernel.
    for (ReduceOp op : kAllButProd)
      check_reduce(raw::permute(to_gpu(h3), {1, 0, 2}), raw::permute(h3, {1, 0, 2}), {1, 2}, 65,
                   33 * 40, 1, op, tolerance(t), "dims {1,2} of permuted");

    // Transposed: a [K, R] view of [R, K] memory reduced over its dim 1; kept dim has stride 1.
    Tensor h = host_randn({1200, 56}, t, 0.2, 1.0);
    for (ReduceOp op : kAllButProd)
      check_reduce(raw::transpose(to_gpu(h), 0, 1), raw::transpose(h, 0, 1), {1}, 56, 1200, 1, op,
                   tolerance(t), "transposed");

    // Column slices of a wider matrix: rows have a stride of 80. Start 8 keeps 16-byte packs
    // aligned (for f32), start 3 does not.
    Tensor wide = host_randn({3000, 80}, t, 0.2, 1.0);
    Tensor wide_d = to_gpu(wide);
    for (int64_t start : {8, 3}) {
      for (ReduceOp op : kAllButProd)
        check_reduce(raw::slice(wide_d, 1, start, start + 40, 1),
                     raw::slice(wide, 1, start, start + 40, 1), {0}, 1, 3000, 40, op,
                     tolerance(t), "column slice from " + std::to_string(start));
    }
    // Every other row.
    for (ReduceOp op : kAllButProd)
      check_reduce(raw::slice(wide_d, 0, 0, 3000, 2), raw::slice(wide, 0, 0, 3000, 2), {0}, 1,
                   1500, 80, op, tolerance(t), "row slice step 2");
  }
}

TEST(CudaColumnReduce, MaxAndMinPropagateNaN) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    std::vector<double> x = values(host_randn({4096, 64}, DType::f64));
    x[2777 * 64 + 5] = NAN;  // column 5
    x[13 * 64 + 63] = NAN;   // column 63
    Tensor h = from_vector(x, {4096, 64}, {.dtype = t});
    for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum}) {
      Tensor out = poisoned({1, 64}, t);
      gpu().reduce(op, to_gpu(h), {0}, out);
      const auto got = values(out);
      for (int64_t c = 0; c < 64; ++c)
        EXPECT_EQ(std::isnan(got[c]), c == 5 || c == 63) << reduce_op_name(op) << " column " << c;
    }
    // The split path too: a full max over 1M elements with one NaN.
    std::vector<double> big = values(host_randn({1 << 20}, DType::f64));
    big[987654] = NAN;
    Tensor hb = from_vector(big, {1 << 20}, {.dtype = t});
    for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min}) {
      Tensor out = poisoned({1}, t);
      gpu().fill(out, 0.0);  // the NaN must come from the reduction
      gpu().reduce(op, to_gpu(hb), {0}, out);
      EXPECT_TRUE(std::isnan(values(out)[0])) << "full " << reduce_op_name(op);
    }
  }
}

TEST(CudaSplitReduce, FullAndFewOutputReductionsOfManyElements) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    // 10M + 19 elements: not a multiple of 8, so the packed loop has a tail.
    const int64_t n = 10000019;
    Tensor h = host_randn({n}, t, 1.0, 1.0);
    Tensor xd = to_gpu(h);
    for (ReduceOp op : kAllButProd) check_reduce(xd, h, {0}, 1, n, 1, op, tolerance(t), "full 1-D");
    // Full reduction of a 2-D tensor and of a transposed (non-contiguous) view of it.
    Tensor h2t = host_randn({4099, 2441}, t, 0.5, 1.0);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max})
      check_reduce(raw::transpose(to_gpu(h2t), 0, 1), raw::transpose(h2t, 0, 1), {0, 1}, 1,
                   4099 * 2441, 1, op, tolerance(t), "full transposed");
    // [4, 2.5M] over dim 1: few outputs, contiguous runs.
    Tensor h4 = raw::view(raw::narrow(h, 0, 0, 10000000), {4, 2500000});
    for (ReduceOp op : kAllButProd)
      check_reduce(to_gpu(raw::contiguous(h4)), h4, {1}, 4, 2500000, 1, op, tolerance(t),
                   "[4, 2.5M] dim 1");
    // [2, N, 2] over dim 1: few outputs whose elements are strided (stride 2).
    Tensor h3 = raw::view(raw::narrow(h, 0, 0, 4 * 300001), {2, 300001, 2});
    for (ReduceOp op : kAllButProd)
      check_reduce(to_gpu(raw::contiguous(h3)), h3, {1}, 2, 300001, 2, op, tolerance(t),
                   "[2, N, 2] dim 1");
  }
}

// ---- broadcast binary ----

double ref_binary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    default: ADD_FAILURE() << "no reference for " << binary_op_name(op); return 0;
  }
}

// Reference of op(a, b) for host tensors already expanded to the output shape.
std::vector<double> ref_broadcast(BinaryOp op, const Tensor& a, const Tensor& b) {
  const auto x = values(raw::contiguous(a)), y = values(raw::contiguous(b));
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = ref_binary(op, x[i], y[i]);
  return out;
}

struct BiasCase {
  const char* name;
  Shape shape;  // of the broadcast operand, for an [M, N] output
};

// op(a, bias) and op(bias, a) out of place into poisoned outputs, then a op= bias in place
// through the front end; bias is broadcast to a's shape with zero strides.
void check_bias_op(BinaryOp op, const Tensor& ah, const Tensor& bias_h, const Tensor& bias_d,
                   const std::string& what) {
  SCOPED_TRACE(what + " " + binary_op_name(op) + " a " + shape_str(ah.shape()) + " bias " +
               shape_str(bias_h.shape()) + " " + dtype_name(ah.dtype()));
  const DType t = ah.dtype();
  const Shape& shape = ah.shape();
  const Tensor bh_e = raw::expand(bias_h, shape), bd_e = raw::expand(bias_d, shape);
  const auto ref_right = ref_broadcast(op, ah, bh_e), ref_left = ref_broadcast(op, bh_e, ah);
  const Tensor ad = to_gpu(ah);
  Tensor right = poisoned(shape, t), left = poisoned(shape, t);
  gpu().binary(op, ad, bd_e, right);
  gpu().binary(op, bd_e, ad, left);
  expect_close(values(right), ref_right, tolerance(t), "a op bias");
  expect_close(values(left), ref_left, tolerance(t), "bias op a");
  Tensor inplace = to_gpu(ah);
  ops::binary_(op, inplace, bias_d);
  expect_close(values(inplace), ref_right, tolerance(t), "a op= bias");
}

TEST(CudaBroadcastBinary, BiasVectorsColumnsAndScalars) {
  TESSERA_REQUIRE_GPU();
  const int64_t M = 65;
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    for (int64_t N : {1, 7, 33, 768, 769}) {
      Tensor ah = host_randn({M, N}, t, 0.3, 1.0);
      const BiasCase cases[] = {{"[N]", {N}}, {"[1, N]", {1, N}}, {"scalar", {}}, {"[M, 1]", {M, 1}}};
      for (const BiasCase& bc : cases) {
        for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div}) {
          // Divisors stay away from zero; both operands take part as divisor.
          const bool div = op == BinaryOp::Div;
          Tensor a = div ? host_uniform({M, N}, 0.5, 2.0, t) : ah;
          Tensor bh = div ? host_uniform(bc.shape, 0.5, 2.0, t) : host_randn(bc.shape, t, 0.5, 1.0);
          check_bias_op(op, a, bh, to_gpu(bh), bc.name);
        }
      }
    }
  }
}

TEST(CudaBroadcastBinary, ScalarOverloadAndOddTotalSizes) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    // 7 * 33 = 231 elements: the packed walk leaves a tail of 7.
    Tensor ah = host_randn({7, 33}, t);
    const auto x = values(ah);
    Tensor ad = to_gpu(ah);
    ops::binary_(BinaryOp::Mul, ad, 2.5);
    Tensor sum = ops::binary(BinaryOp::Add, ad, -1.25);
    std::vector<double> scaled(x.size());
    for (size_t i = 0; i < x.size(); ++i) scaled[i] = x[i] * 2.5;
    expect_close(values(ad), scaled, tolerance(t), "a *= 2.5");
    // The sum reads the (checked) rounded product.
    std::vector<double> shifted = values(ad);
    for (double& v : shifted) v -= 1.25;
    expect_close(values(sum), shifted, tolerance(t), "a + (-1.25)");
  }
}

TEST(CudaBroadcastBinary, HigherRankUnalignedAndStridedOperands) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    // A [T, N] table over [B, T, N] (the position embedding add).
    Tensor a3 = host_randn({3, 17, 64}, t);
    Tensor tn = host_randn({17, 64}, t);
    check_bias_op(BinaryOp::Add, a3, tn, to_gpu(tn), "[T, N] over [B, T, N]");
    // A [B, 1, N] operand over [B, T, N]: not periodic, the generic kernel answers.
    Tensor b1n = host_randn({3, 1, 64}, t);
    check_bias_op(BinaryOp::Mul, a3, b1n, to_gpu(b1n), "[B, 1, N] over [B, T, N]");
    // A bias starting one element into its buffer: contiguous but not 16-byte aligned.
    Tensor a = host_randn({40, 768}, t);
    Tensor buf = host_randn({769}, t);
    Tensor buf_d = to_gpu(buf);
    check_bias_op(BinaryOp::Add, a, raw::narrow(buf, 0, 1, 768), raw::narrow(buf_d, 0, 1, 768),
                  "unaligned bias");
    // A strided bias (every other element).
    Tensor wide = host_randn({1536}, t);
    check_bias_op(BinaryOp::Sub, a, raw::slice(wide, 0, 0, 1536, 2),
                  raw::slice(to_gpu(wide), 0, 0, 1536, 2), "strided bias");
    // A transposed (non-contiguous) left operand with a bias: the generic kernel.
    Tensor at = raw::transpose(host_randn({768, 40}, t), 0, 1);
    Tensor bias = host_randn({768}, t);
    Tensor out = poisoned({40, 768}, t);
    gpu().binary(BinaryOp::Add, raw::transpose(to_gpu(raw::transpose(at, 0, 1)), 0, 1),
                 raw::expand(to_gpu(bias), {40, 768}), out);
    expect_close(values(out), ref_broadcast(BinaryOp::Add, at, raw::expand(bias, {40, 768})),
                 tolerance(t), "transposed a + bias");
  }
}

TEST(CudaBroadcastBinary, BothOperandsBroadcast) {
  TESSERA_REQUIRE_GPU();
  // [M, 1] op [N] -> [M, N]: a column and a row, neither the size of the output.
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t N : {7, 768}) {
      const Shape shape = {65, N};
      Tensor col = host_randn({65, 1}, t), row = host_randn({N}, t, 0.5, 1.0);
      for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul}) {
        Tensor out = poisoned(shape, t);
        gpu().binary(op, raw::expand(to_gpu(col), shape), raw::expand(to_gpu(row), shape), out);
        expect_close(values(out),
                     ref_broadcast(op, raw::expand(col, shape), raw::expand(row, shape)),
                     tolerance(t), (std::string(binary_op_name(op)) + " column op row").c_str());
      }
    }
  }
}

// ---- layer-norm parameter gradients over many rows (many chunks to combine) ----

TEST(CudaLayerNormParams, GradientsOverManyRowsRepeatBitwise) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t C : {7, 768}) {
      const int64_t rows = 4100;
      SCOPED_TRACE(std::string(dtype_name(t)) + " C=" + std::to_string(C));
      Tensor xh = host_randn({rows, C}, t, 0.5, 2.0), wh = host_randn({C}, t, 1.0, 0.3),
             dyh = host_randn({rows, C}, t);
      Tensor xd = to_gpu(xh), wd = to_gpu(wh), dyd = to_gpu(dyh);
      Tensor y = poisoned({rows, C}, t), mean = poisoned({rows}, DType::f32),
             rstd = poisoned({rows}, DType::f32);
      gpu().layer_norm(xd, wd, Tensor(), 1e-5, y, mean, rstd);
      std::vector<std::vector<double>> runs;
      Tensor dw0 = host_randn({C}, t), db0 = host_randn({C}, t);  // gradients accumulate
      std::vector<double> ref = values(dw0), rdb = values(db0);
      for (int run = 0; run < 2; ++run) {
        Tensor dx = poisoned({rows, C}, t), dw = to_gpu(dw0), db = to_gpu(db0);
        gpu().layer_norm_backward(dyd, xd, wd, mean, rstd, dx, dw, db);
        auto w = values(dw), b = values(db);
        w.insert(w.end(), b.begin(), b.end());
        runs.push_back(w);
      }
      const auto x = values(xh), dy = values(dyh);
      for (int64_t i = 0; i < rows; ++i) {
        double m = 0, v = 0;
        for (int64_t c = 0; c < C; ++c) m += x[i * C + c];
        m /= C;
        for (int64_t c = 0; c < C; ++c) v += (x[i * C + c] - m) * (x[i * C + c] - m);
        const double rs = 1.0 / std::sqrt(v / C + 1e-5);
        for (int64_t c = 0; c < C; ++c) {
          ref[c] += dy[i * C + c] * (x[i * C + c] - m) * rs;
          rdb[c] += dy[i * C + c];
        }
      }
      ref.insert(ref.end(), rdb.begin(), rdb.end());
      expect_close(runs[0], ref, tolerance(t) * 2, "dweight, dbias");
      EXPECT_EQ(runs[0], runs[1]) << "two runs differ";
    }
  }
}

}  // namespace
}  // namespace tessera
