// matmul against float64 triple loops: 1-D/2-D/batched operands with broadcast batch dims,
// transposed and stepped views, odd sizes, every float dtype, and bad input.
#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {

// PyTorch matmul semantics computed naively in float64.
std::vector<double> matmul_ref(const Tensor& a_in, const Tensor& b_in, Shape& out_shape) {
  const bool av = a_in.dim() == 1, bv = b_in.dim() == 1;
  const Tensor a = av ? raw::unsqueeze(a_in, 0) : a_in, b = bv ? raw::unsqueeze(b_in, 1) : b_in;
  const int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1], N = b.shape()[b.dim() - 1];
  const Shape batch = raw::broadcast_shapes(Shape(a.shape().begin(), a.shape().end() - 2),
                                            Shape(b.shape().begin(), b.shape().end() - 2), "ref");
  Shape af = batch, bf = batch;
  af.insert(af.end(), {M, K});
  bf.insert(bf.end(), {K, N});
  const auto x = host(raw::expand(a, af)), y = host(raw::expand(b, bf));
  const int64_t nb = shape_numel(batch);
  std::vector<double> out(nb * M * N, 0.0);
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += x[(i * M + m) * K + k] * y[(i * K + k) * N + n];
        out[(i * M + m) * N + n] = acc;
      }
  out_shape = batch;
  if (!av) out_shape.push_back(M);
  if (!bv) out_shape.push_back(N);
  return out;
}

void check(const Tensor& a, const Tensor& b, DType dt, const std::string& what) {
  Shape shape;
  const auto want = matmul_ref(a, b, shape);
  const Tensor got = ops::matmul(a, b);
  EXPECT_EQ(got.dtype(), dt) << what;
  // f32 dot products of up to ~8000 terms
  expect_close(got, want, shape, dt == DType::f32 ? 1e-5 : tolerance(dt), what);
}

TEST(Matmul, ShapesLayoutsAndDTypes) {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{7, 33}, {33, 5}},        {{1, 1}, {1, 1}},          {{33}, {33}},
      {{7, 33}, {33}},           {{33}, {33, 5}},           {{33}, {2, 33, 5}},
      {{2, 3, 7, 33}, {3, 33, 5}}, {{4, 7, 33}, {33, 257}}, {{4, 7, 33}, {1, 33, 5}},
      {{1, 7, 33}, {4, 33, 5}},  {{65, 7, 16}, {65, 16, 9}}, {{129, 65}, {65, 33}},
      {{3, 5, 0}, {0, 4}},
  };
  uint64_t seed = 1;
  for (DType dt : kFloatDTypes) {
    for (const auto& [sa, sb] : cases) {
      for (Layout la : kLayouts) {
        for (Layout lb : {Layout::Contiguous, Layout::Transposed, Layout::Stepped}) {
          // stepped (packed-copy) operands are one code path for every dtype: check them in f32
          if ((la == Layout::Stepped || lb == Layout::Stepped) && dt != DType::f32) continue;
          const Tensor a = random_tensor(sa, dt, seed++, la);
          const Tensor b = random_tensor(sb, dt, seed++, lb);
          check(a, b, dt, std::string(dtype_name(dt)) + " " + shape_str(sa) + "@" + shape_str(sb) +
                              " " + layout_name(la) + "/" + layout_name(lb));
        }
      }
    }
  }
}

TEST(Matmul, TransposedOperandsAndAttentionShapes) {
  // q @ k^T over [B, H, T, D] with k^T a transposed view, then probs @ v.
  const Tensor q = random_tensor({2, 4, 33, 8}, DType::f32, 50);
  const Tensor k = random_tensor({2, 4, 33, 8}, DType::f32, 51);
  const Tensor kt = raw::transpose(k, -2, -1);
  check(q, kt, DType::f32, "q @ k^T");
  // a weight gradient: x^T @ dy with x [N, C] viewed transposed
  const Tensor x = random_tensor({257, 33}, DType::f32, 52), dy = random_tensor({257, 7}, DType::f32, 53);
  check(raw::transpose(x, 0, 1), dy, DType::f32, "x^T @ dy");
  // a permuted (non-contiguous, not foldable) batch operand
  const Tensor p = raw::permute(random_tensor({33, 3, 7}, DType::f32, 54), {1, 2, 0});  // [3, 7, 33]
  check(p, random_tensor({33, 5}, DType::f32, 55), DType::f32, "permuted @ 2-D");
  // single large products take each way of threading one product: blocks of rows, blocks of
  // columns (N > M), and split K with summed partials (M and N small)
  check(random_tensor({257, 65}, DType::f32, 56), random_tensor({65, 33}, DType::f32, 57), DType::f32, "row blocks");
  check(random_tensor({33, 257}, DType::f32, 58, Layout::Transposed), random_tensor({257, 129}, DType::f32, 59),
        DType::f32, "column blocks");
  check(random_tensor({7, 8193}, DType::f32, 60), random_tensor({8193, 9}, DType::f32, 61, Layout::Transposed),
        DType::f32, "split K");
  check(random_tensor({7, 8193}, DType::f64, 62), random_tensor({8193, 9}, DType::f64, 63), DType::f64, "split K f64");
  // integers are exact
  const Tensor ia = from_vector<int64_t>({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i64});
  const Tensor ib = from_vector<int64_t>({1, 0, 0, 1, 1, 1}, {3, 2}, {.dtype = DType::i64});
  EXPECT_EQ(ops::matmul(ia, ib).to_vector<int64_t>(), (std::vector<int64_t>{4, 5, 10, 11}));
}

TEST(Matmul, BadInputNamesShapesAndDTypes) {
  expect_error([] { ops::matmul(ones({2, 3}), ones({4, 5})); }, {"matmul", "[2, 3]", "[4, 5]"});
  expect_error([] { ops::matmul(ones({3}), ones({4})); }, {"matmul", "[3]", "[4]"});
  expect_error([] { ops::matmul(ones({2, 2, 3}), ones({3, 3, 5})); }, {"matmul", "[2]", "[3]"});
  expect_error([] { ops::matmul(ones({2, 3}), ones({3, 2}, {.dtype = DType::f64})); },
               {"matmul", "float32", "float64"});
  expect_error([] { ops::matmul(ones({}), ones({3})); }, {"matmul"});
}

}  // namespace
}  // namespace tessera::test
