// cuBLASLt matmul (plans cached per shape/layout/epilogue) and the Linear helpers with the
// bias / bias-gradient epilogues, against float64 CPU references; the fallback path (forced,
// and for a dtype the epilogue refuses); the differentiable linear on CUDA.
#include <array>
#include <cmath>
#include <cstdio>

#include "tessera/autograd/functions.h"
#include "cuda_test_util.h"
#include "tessera/kernels/cuda/linear.h"

namespace tessera {
namespace {
using namespace cuda_test;

// A device copy of host matrix h [.., R, C] stored transposed ([.., C, R] contiguous) and
// viewed back as [.., R, C]: same values, column-major strides.
Tensor transposed_view_on_gpu(const Tensor& h) {
  return raw::transpose(to_gpu(raw::contiguous(raw::transpose(h, -2, -1))), -2, -1);
}

double lt_tolerance(DType t) { return t == DType::f32 ? 1e-5 : 1e-2; }

TEST(CudaLtMatmul, OddShapesDtypesAndTransposedViews) {
  TESSERA_REQUIRE_GPU();
  const std::vector<std::array<int64_t, 3>> shapes = {
      {1, 1, 1}, {1, 7, 33}, {7, 33, 1}, {33, 257, 7}, {257, 769, 33}, {769, 33, 257}, {64, 128, 96}};
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const auto& [M, K, N] : shapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(M) + " K=" +
                   std::to_string(K) + " N=" + std::to_string(N));
      Tensor ah = host_randn({M, K}, t), bh = host_randn({K, N}, t);
      const auto ref = ref_matmul(values(ah), values(bh), 1, M, K, N, false, false);
      for (int layout = 0; layout < 4; ++layout) {  // bit 0: a transposed, bit 1: b transposed
        const Tensor a = (layout & 1) ? transposed_view_on_gpu(ah) : to_gpu(ah);
        const Tensor b = (layout & 2) ? transposed_view_on_gpu(bh) : to_gpu(bh);
        Tensor out = poisoned({M, N}, t);
        gpu().matmul(a, b, out);
        expect_close(values(out), ref, lt_tolerance(t), "layout");
        // Second call: the cached plan gives the same result.
        Tensor again = poisoned({M, N}, t);
        gpu().matmul(a, b, again);
        expect_close(values(again), values(out), 0.0, "cached plan");
      }
    }
  }
}

TEST(CudaLtMatmul, BatchedWithBroadcastBatchAndSlicedOperands) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    const int64_t B = 5, M = 33, K = 65, N = 17;
    Tensor ah = host_randn({1, M, K}, t), bh = host_randn({B, K, N}, t);
    // a broadcast over the batch (stride 0), b batched.
    {
      const auto ref = ref_matmul(values(ah), values(bh), B, M, K, N, true, false);
      Tensor out = poisoned({B, M, N}, t);
      gpu().matmul(raw::expand(to_gpu(ah), {B, M, K}), to_gpu(bh), out);
      expect_close(values(out), ref, lt_tolerance(t), "broadcast a");
    }
    // Both batched, b a transposed view, a every other batch of a larger tensor (a batch
    // stride that is not M*K) and with an odd element offset (unaligned pointer).
    {
      Tensor a_full = host_randn({2 * B + 1, M, K}, t);
      Tensor a_sel = raw::slice(a_full, 0, 1, 2 * B + 1, 2);
      Tensor ahb = raw::contiguous(a_sel);
      const auto ref = ref_matmul(values(ahb), values(bh), B, M, K, N, false, false);
      Tensor a = raw::slice(to_gpu(a_full), 0, 1, 2 * B + 1, 2);
      Tensor out = poisoned({B, M, N}, t);
      gpu().matmul(a, transposed_view_on_gpu(bh), out);
      expect_close(values(out), ref, lt_tolerance(t), "strided batch, transposed b");
    }
    // 4-d with two batch dims.
    {
      Tensor a4 = host_randn({2, 3, M, K}, t), b4 = host_randn({2, 3, K, N}, t);
      const auto ref = ref_matmul(values(a4), values(b4), 6, M, K, N, false, false);
      Tensor out = poisoned({2, 3, M, N}, t);
      gpu().matmul(to_gpu(a4), to_gpu(b4), out);
      expect_close(values(out), ref, lt_tolerance(t), "4-d");
    }
  }
}

// Reference Linear: out = x @ w (+ bias), in float64.
std::vector<double> ref_linear(const Tensor& xh, const Tensor& wh, const Tensor& bh) {
  const int64_t M = xh.size(0), K = xh.size(1), N = wh.size(1);
  auto out = ref_matmul(values(xh), values(wh), 1, M, K, N, false, false);
  if (bh.defined()) {
    const auto b = values(bh);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) out[i * N + j] += b[j];
  }
  return out;
}

// dw = x^T g and db = column sums of g, in float64.
void ref_weight_grad(const Tensor& xh, const Tensor& gh, std::vector<double>& dw,
                     std::vector<double>& db) {
  const int64_t M = xh.size(0), K = xh.size(1), N = gh.size(1);
  const auto x = values(xh), g = values(gh);
  dw.assign(K * N, 0.0);
  db.assign(N, 0.0);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      const double xv = x[i * K + k];
      for (int64_t j = 0; j < N; ++j) dw[k * N + j] += xv * g[i * N + j];
    }
    for (int64_t j = 0; j < N; ++j) db[j] += g[i * N + j];
  }
}

struct LinearShape {
  int64_t M, K, N;
};
const std::vector<LinearShape> kLinearShapes = {{16384, 64, 48}, {33, 257, 7}, {1, 7, 33},
                                                {769, 96, 257}};

// Runs the forward and weight-gradient helpers for every shape and dtype and checks them.
void check_linear_helpers(bool epilogues) {
  cuda::set_linear_epilogues_enabled(epilogues);
  for (DType t : {DType::f32, DType::bf16}) {
    for (const LinearShape& s : kLinearShapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(s.M) + " K=" +
                   std::to_string(s.K) + " N=" + std::to_string(s.N) +
                   (epilogues ? " epilogues" : " fallback"));
      Tensor xh = host_randn({s.M, s.K}, t), wh = host_randn({s.K, s.N}, t, 0.0, 0.2),
             bh = host_randn({s.N}, t, 0.5, 1.0);
      const Tensor x = to_gpu(xh), w = to_gpu(wh);
      // Forward with and without bias; the weight also as a transposed view.
      for (bool with_bias : {true, false}) {
        Tensor out = poisoned({s.M, s.N}, t);
        cuda::linear_forward(x, w, with_bias ? to_gpu(bh) : Tensor(), out);
        expect_close(values(out), ref_linear(xh, wh, with_bias ? bh : Tensor()),
                     lt_tolerance(t), with_bias ? "forward + bias" : "forward");
      }
      {
        Tensor out = poisoned({s.M, s.N}, t);
        cuda::linear_forward(x, transposed_view_on_gpu(wh), to_gpu(bh), out);
        expect_close(values(out), ref_linear(xh, wh, bh), lt_tolerance(t), "transposed w");
      }
      // Weight gradient with and without the bias gradient.
      Tensor gh = host_randn({s.M, s.N}, t);
      std::vector<double> rdw, rdb;
      ref_weight_grad(xh, gh, rdw, rdb);
      for (bool with_db : {true, false}) {
        Tensor dw = poisoned({s.K, s.N}, t);
        Tensor db = with_db ? poisoned({s.N}, t) : Tensor();
        cuda::linear_weight_grad(x, to_gpu(gh), dw, db);
        expect_close(values(dw), rdw, lt_tolerance(t), "dw");
        if (with_db) expect_close(values(db), rdb, lt_tolerance(t), "db");
      }
    }
  }
  cuda::set_linear_epilogues_enabled(true);
}

TEST(CudaLinearLt, ForwardAndWeightGradWithEpilogues) {
  TESSERA_REQUIRE_GPU();
  const auto before = cuda::linear_path_counts();
  check_linear_helpers(/*epilogues=*/true);
  const auto after = cuda::linear_path_counts();
  // Which path cuBLASLt allowed is for the report (not asserted: it may refuse an epilogue
  // for a shape, and the fallback is correct too).
  std::printf("[linear epilogues] fused calls %lld, fallback calls %lld\n",
              static_cast<long long>(after.fused - before.fused),
              static_cast<long long>(after.fallback - before.fallback));
  RecordProperty("fused_calls", static_cast<int>(after.fused - before.fused));
}

TEST(CudaLinearLt, ForcedFallbackGivesTheSameResults) {
  TESSERA_REQUIRE_GPU();
  const auto before = cuda::linear_path_counts();
  check_linear_helpers(/*epilogues=*/false);
  const auto after = cuda::linear_path_counts();
  EXPECT_EQ(after.fused, before.fused);
  EXPECT_GT(after.fallback, before.fallback);
  EXPECT_TRUE(cuda::linear_epilogues_enabled());
}

TEST(CudaLinearLt, RefusedDtypeFallsBackTransparently) {
  TESSERA_REQUIRE_GPU();
  // float64 never goes through cuBLASLt: both helpers take the plain GEMM + ops path.
  const int64_t M = 37, K = 19, N = 11;
  Tensor xh = host_randn({M, K}, DType::f64), wh = host_randn({K, N}, DType::f64),
         bh = host_randn({N}, DType::f64), gh = host_randn({M, N}, DType::f64);
  const auto before = cuda::linear_path_counts();
  Tensor out = poisoned({M, N}, DType::f64);
  cuda::linear_forward(to_gpu(xh), to_gpu(wh), to_gpu(bh), out);
  expect_close(values(out), ref_linear(xh, wh, bh), 1e-12, "f64 forward");
  Tensor dw = poisoned({K, N}, DType::f64), db = poisoned({N}, DType::f64);
  cuda::linear_weight_grad(to_gpu(xh), to_gpu(gh), dw, db);
  std::vector<double> rdw, rdb;
  ref_weight_grad(xh, gh, rdw, rdb);
  expect_close(values(dw), rdw, 1e-12, "f64 dw");
  expect_close(values(db), rdb, 1e-12, "f64 db");
  const auto after = cuda::linear_path_counts();
  EXPECT_EQ(after.fused, before.fused);
  EXPECT_EQ(after.fallback, before.fallback + 2);
}

TEST(CudaLinearLt, Float32BiasWithBf16OutputAndEmptyCases) {
  TESSERA_REQUIRE_GPU();
  // Autocast's case: bf16 input and weight, the bias left in f32.
  const int64_t M = 129, K = 64, N = 40;
  Tensor xh = host_randn({M, K}, DType::bf16), wh = host_randn({K, N}, DType::bf16),
         bh = host_randn({N}, DType::f32);
  Tensor out = poisoned({M, N}, DType::bf16);
  cuda::linear_forward(to_gpu(xh), to_gpu(wh), to_gpu(bh), out);
  expect_close(values(out), ref_linear(xh, wh, bh), 1e-2, "bf16 out, f32 bias");
  // K = 0: the output is the bias on every row; M = 0: gradients are zeros.
  Tensor o0 = poisoned({3, N}, DType::f32);
  Tensor b32 = host_randn({N}, DType::f32);
  cuda::linear_forward(empty({3, 0}, {.device = dev()}), empty({0, N}, {.device = dev()}),
                       to_gpu(b32), o0);
  std::vector<double> rep;
  for (int i = 0; i < 3; ++i)
    for (double v : values(b32)) rep.push_back(v);
  expect_close(values(o0), rep, 0.0, "K = 0");
  Tensor dw = poisoned({K, N}, DType::f32), db = poisoned({N}, DType::f32);
  cuda::linear_weight_grad(empty({0, K}, {.device = dev()}), empty({0, N}, {.device = dev()}),
                           dw, db);
  for (double v : values(dw)) EXPECT_EQ(v, 0.0);
  for (double v : values(db)) EXPECT_EQ(v, 0.0);
}

TEST(CudaLinearLt, BadInputsRaise) {
  TESSERA_REQUIRE_GPU();
  const Tensor x = to_gpu(host_randn({5, 4})), w = to_gpu(host_randn({4, 3}));
  Tensor out = poisoned({5, 3}, DType::f32);
  EXPECT_THROW(cuda::linear_forward(x, w, to_gpu(host_randn({4})), out), Error);  // bias length
  EXPECT_THROW(cuda::linear_forward(x, w, to_gpu(host_randn({3}, DType::f64)), out), Error);
  EXPECT_THROW(cuda::linear_forward(x, to_gpu(host_randn({5, 3})), Tensor(), out), Error);
  EXPECT_THROW(cuda::linear_forward(x, w, Tensor(), poisoned({5, 3}, DType::bf16)), Error);
  Tensor dw = poisoned({4, 3}, DType::f32);
  const Tensor g = to_gpu(host_randn({5, 3}));
  EXPECT_THROW(cuda::linear_weight_grad(x, g, dw, poisoned({4}, DType::f32)), Error);
  EXPECT_THROW(cuda::linear_weight_grad(x, g, dw, poisoned({3}, DType::bf16)), Error);
  EXPECT_THROW(cuda::linear_weight_grad(x, to_gpu(host_randn({4, 3})), dw, Tensor()), Error);
}

// The differentiable linear on CUDA (forward through linear_forward, backward through
// linear_weight_grad + the plain matmul for dx) against float64.
TEST(CudaLinearLt, AutogradLinearMatchesFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    for (const LinearShape& s : {LinearShape{16384, 64, 48}, LinearShape{33, 31, 7}}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(s.M));
      const int64_t B = s.M == 16384 ? 8 : 1, T = s.M / B;
      Tensor xh = host_randn({B, T, s.K}, t), wh = host_randn({s.K, s.N}, t, 0.0, 0.2),
             bh = host_randn({s.N}, t), rh = host_randn({B, T, s.N}, t);
      Tensor x = to_gpu(xh), w = to_gpu(wh), b = to_gpu(bh);
      x.requires_grad_();
      w.requires_grad_();
      b.requires_grad_();
      Tensor y = linear(x, w, b);
      sum(y * to_gpu(rh)).backward();
      const Tensor x2 = raw::reshape(xh, {s.M, s.K}), r2 = raw::reshape(rh, {s.M, s.N});
      expect_close(values(y), ref_linear(x2, wh, bh), lt_tolerance(t), "y");
      std::vector<double> rdw, rdb;
      ref_weight_grad(x2, r2, rdw, rdb);
      expect_close(values(w.grad()), rdw, lt_tolerance(t), "dw");
      expect_close(values(b.grad()), rdb, lt_tolerance(t), "db");
      // dx = r @ w^T.
      const auto rdx = ref_matmul(values(r2), values(raw::contiguous(raw::transpose(wh, 0, 1))),
                                  1, s.M, s.N, s.K, false, false);
      expect_close(values(x.grad()), rdx, lt_tolerance(t), "dx");
    }
  }
}

}  // namespace
}  // namespace tessera
