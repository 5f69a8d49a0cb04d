// layer_norm (+backward, fused residual), matmul, embedding, index_add against float64.
#include <cmath>

#include "tessera/core/cuda/cuda_runtime.h"
#include "cuda_test_util.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {
using namespace cuda_test;

struct LnRef {
  std::vector<double> out, mean, rstd;
};
LnRef ref_layer_norm(const std::vector<double>& x, const std::vector<double>& w,
                     const std::vector<double>& b, int64_t rows, int64_t C, double eps) {
  LnRef r{std::vector<double>(x.size()), std::vector<double>(rows), std::vector<double>(rows)};
  for (int64_t i = 0; i < rows; ++i) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[i * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[i * C + c] - m) * (x[i * C + c] - m);
    const double rs = 1 / std::sqrt(v / C + eps);
    r.mean[i] = m;
    r.rstd[i] = rs;
    for (int64_t c = 0; c < C; ++c) r.out[i * C + c] = (x[i * C + c] - m) * rs * w[c] + b[c];
  }
  return r;
}

TEST(CudaLayerNorm, ForwardBackwardAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t C : {1, 7, 768, 1031}) {
      const int64_t rows = 37;
      Tensor xh = host_randn({rows, C}, t, 0.5, 2.0), wh = host_randn({C}, t, 1.0, 0.3),
             bh = host_randn({C}, t);
      Tensor out = poisoned({rows, C}, t), mean = poisoned({rows}, DType::f32),
             rstd = poisoned({rows}, DType::f32);
      // Non-contiguous x: every other row of a bigger tensor.
      Tensor big = to_gpu(host_randn({2 * rows, C}, t));
      gpu().copy(raw::slice(big, 0, 0, 2 * rows, 2), to_gpu(xh));
      Tensor xd = raw::slice(big, 0, 0, 2 * rows, 2);
      gpu().layer_norm(xd, to_gpu(wh), to_gpu(bh), 1e-5, out, mean, rstd);
      const auto x = values(xh), w = values(wh), b = values(bh);
      LnRef r = ref_layer_norm(x, w, b, rows, C, 1e-5);
      expect_close(values(out), r.out, tolerance(t) * 2, "ln out");
      expect_close(values(mean), r.mean, 1e-5, "ln mean");
      expect_close(values(rstd), r.rstd, 1e-5, "ln rstd");

      Tensor dyh = host_randn({rows, C}, t);
      Tensor dx = poisoned({rows, C}, t);
      Tensor dw0 = host_randn({C}, t), db0 = host_randn({C}, t);
      Tensor dw = to_gpu(dw0), db = to_gpu(db0);  // gradients accumulate (+=)
      gpu().layer_norm_backward(to_gpu(dyh), xd, to_gpu(wh), mean, rstd, dx, dw, db);
      const auto dy = values(dyh);
      std::vector<double> rdx(x.size()), rdw = values(dw0), rdb = values(db0);
      for (int64_t i = 0; i < rows; ++i) {
        double mg = 0, mgx = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double xhat = (x[i * C + c] - r.mean[i]) * r.rstd[i];
          const double g = dy[i * C + c] * w[c];
          mg += g;
          mgx += g * xhat;
          rdw[c] += dy[i * C + c] * xhat;
          rdb[c] += dy[i * C + c];
        }
        mg /= C;
        mgx /= C;
        for (int64_t c = 0; c < C; ++c) {
          const double xhat = (x[i * C + c] - r.mean[i]) * r.rstd[i];
          rdx[i * C + c] = r.rstd[i] * (dy[i * C + c] * w[c] - mg - xhat * mgx);
        }
      }
      if (C == 1) {  // dx is exactly 0 in exact math: only rounding noise may remain
        for (double v : values(dx)) EXPECT_LT(std::fabs(v), 1e-3) << "ln dx, C = 1";
      } else {
        expect_close(values(dx), rdx, tolerance(t) * 3, "ln dx");
      }
      expect_close(values(dw), rdw, tolerance(t) * 2, "ln dw");
      expect_close(values(db), rdb, tolerance(t) * 2, "ln db");
    }
  }
}

TEST(CudaLayerNorm, FusedResidualMatchesAddThenNorm) {
  TESSERA_REQUIRE_GPU();
  const int64_t rows = 19, C = 384;
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor xh = host_randn({rows, C}, t), rh = host_randn({rows, C}, t);
    Tensor wh = host_randn({C}, t, 1.0, 0.2), bh = host_randn({C}, t);
    Tensor res_out = poisoned({rows, C}, t), out = poisoned({rows, C}, t);
    Tensor mean = poisoned({rows}, DType::f32), rstd = poisoned({rows}, DType::f32);
    cuda::fused_residual_layer_norm(to_gpu(xh), to_gpu(rh), Tensor(), to_gpu(wh), to_gpu(bh), 1e-5,
                                    res_out, out, mean, rstd);
    auto x = values(xh), r = values(rh);
    std::vector<double> sum(x.size());
    for (size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + r[i];
    // The residual sum is stored in t; the norm sees the stored (rounded) values.
    sum = values(raw::to(from_vector(sum, {rows, C}, {.dtype = DType::f64}), Device::cpu(), t));
    expect_close(values(res_out), sum, 0.0, "residual_out");
    LnRef ref = ref_layer_norm(sum, values(wh), values(bh), rows, C, 1e-5);
    expect_close(values(out), ref.out, tolerance(t) * 2, "fused ln out");
  }
}

TEST(CudaMatmul, DtypesTransposesAndBroadcastBatches) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    const int64_t B = 3, M = 33, K = 257, N = 7;
    Tensor ah = host_randn({B, M, K}, t), bh = host_randn({1, K, N}, t);
    const auto av = values(ah), bv = values(bh);
    const auto ref = ref_matmul(av, bv, B, M, K, N, false, true);
    // Plain layouts, with b's batch broadcast (stride 0).
    {
      Tensor out = poisoned({B, M, N}, t);
      gpu().matmul(to_gpu(ah), raw::expand(to_gpu(bh), {B, K, N}), out);
      expect_close(values(out), ref, tolerance(t), dtype_name(t));
    }
    // Transposed views of both operands (stored as [B, K, M] and [N, K]).
    {
      Tensor at = raw::transpose(to_gpu(raw::contiguous(raw::transpose(ah, 1, 2))), 1, 2);
      Tensor bt = raw::transpose(to_gpu(raw::contiguous(raw::transpose(raw::select(bh, 0, 0), 0, 1))), 0, 1);
      Tensor out = poisoned({B, M, N}, t);
      gpu().matmul(at, raw::expand(raw::unsqueeze(bt, 0), {B, K, N}), out);
      expect_close(values(out), ref, tolerance(t), "transposed");
    }
  }
  // Degenerate: K = 0 gives zeros; M = 1 row.
  Tensor z = poisoned({2, 3}, DType::f32);
  gpu().matmul(empty({2, 0}, {.device = dev()}), empty({0, 3}, {.device = dev()}), z);
  for (double v : values(z)) EXPECT_EQ(v, 0.0);
  Tensor a1 = host_randn({1, 5}), b1 = host_randn({5, 4});
  Tensor o1 = poisoned({1, 4}, DType::f32);
  gpu().matmul(to_gpu(a1), to_gpu(b1), o1);
  expect_close(values(o1), ref_matmul(values(a1), values(b1), 1, 1, 5, 4, false, false), 1e-5);
}

TEST(CudaMatmul, IntegerDtypeIsRejected) {
  TESSERA_REQUIRE_GPU();
  Tensor a = zeros({2, 2}, {.dtype = DType::i32, .device = dev()});
  Tensor out = empty({2, 2}, {.dtype = DType::i32, .device = dev()});
  EXPECT_THROW(gpu().matmul(a, a, out), Error);
}

TEST(CudaEmbedding, LookupAndBadIndex) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor wh = host_randn({50, 33}, t);
    std::vector<int32_t> ids = {0, 49, 7, 7, 13, 2, 49};
    Tensor out = poisoned({7, 33}, t);
    gpu().embedding(to_gpu(wh), to_gpu(from_vector(ids, {7}, {.dtype = DType::i32})), out);
    const auto w = values(wh), got = values(out);
    for (int i = 0; i < 7; ++i)
      for (int c = 0; c < 33; ++c) ASSERT_EQ(got[i * 33 + c], w[ids[i] * 33 + c]);
  }
  Tensor w = to_gpu(host_randn({5, 4}));
  Tensor out = empty({2, 4}, {.device = dev()});
  EXPECT_THROW(gpu().embedding(w, to_gpu(from_vector(std::vector<int64_t>{1, 5}, {2}, {.dtype = DType::i64})), out),
               Error);
}

TEST(CudaIndexAdd, AtomicAndDeterministicPathsAgree) {
  TESSERA_REQUIRE_GPU();
  const int64_t rows = 11, n = 300, C = 17;
  std::vector<int64_t> ids = randint(0, rows, {n}, {.dtype = DType::i64}).to_vector<int64_t>();
  Tensor idx = to_gpu(from_vector(ids, {n}, {.dtype = DType::i64}));
  for (DType t : {DType::f32, DType::f64}) {
    Tensor src_h = host_randn({n, C}, t), base_h = host_randn({rows, C}, t);
    const auto s = values(src_h);
    std::vector<double> ref = values(base_h);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < C; ++c) ref[ids[i] * C + c] += s[i * C + c];
    for (bool det : {false, true}) {
      cuda::set_deterministic(det);
      Tensor out = to_gpu(base_h);
      gpu().index_add(out, 0, idx, to_gpu(src_h));
      expect_close(values(out), ref, tolerance(t) * 10, det ? "deterministic" : "atomic");
      if (det) {  // bitwise repeatable
        Tensor again = to_gpu(base_h);
        gpu().index_add(again, 0, idx, to_gpu(src_h));
        EXPECT_EQ(values(again), values(out));
      }
    }
    cuda::set_deterministic(false);
  }
  // Along dim 1 of a strided (transposed) destination.
  Tensor src_h = host_randn({C, n});
  Tensor out_store = to_gpu(zeros({rows, C}));
  Tensor out = raw::transpose(out_store, 0, 1);  // [C, rows], non-contiguous
  gpu().index_add(out, 1, idx, to_gpu(src_h));
  const auto s = values(src_h);
  std::vector<double> ref(C * rows, 0.0);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < n; ++i) ref[c * rows + ids[i]] += s[c * n + i];
  expect_close(values(out), ref, 1e-5, "dim 1");
  EXPECT_THROW(gpu().index_add(to_gpu(zeros({3, 2})), 0,
                               to_gpu(from_vector(std::vector<int64_t>{0, 3}, {2}, {.dtype = DType::i64})),
                               to_gpu(zeros({2, 2}))),
               Error);
}


// The register-resident paths (rows of a multiple of 8 up to 2048 forward / 1024 backward,
// every pack count 1..4 and 8), the general kernels past them (4096), f16, missing
// weight/bias, a backward without dweight/dbias, and more rows than the persistent
// backward grid has warps (each warp then walks several rows). dweight/dbias must repeat
// bitwise.
TEST(CudaLayerNorm, RegisterRowPathsAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  struct Case {
    int64_t rows, C;
    bool affine;
  };
  const Case cases[] = {{2500, 8, true},  {2500, 256, false}, {61, 512, true},
                        {61, 768, true},  {2500, 1024, true}, {45, 2048, true},
                        {23, 4096, true}, {33, 1032, true}};
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const Case& k : cases) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(k.rows) + " C " +
                   std::to_string(k.C));
      const int64_t rows = k.rows, C = k.C;
      Tensor xh = host_randn({rows, C}, t, -0.7, 1.5);
      Tensor wh = k.affine ? host_randn({C}, t, 1.0, 0.3) : ones({C}, {.dtype = t});
      Tensor bh = k.affine ? host_randn({C}, t) : zeros({C}, {.dtype = t});
      const Tensor wd = k.affine ? to_gpu(wh) : Tensor(), bd = k.affine ? to_gpu(bh) : Tensor();
      Tensor x = to_gpu(xh), out = poisoned({rows, C}, t);
      Tensor mean = poisoned({rows}, DType::f32), rstd = poisoned({rows}, DType::f32);
      gpu().layer_norm(x, wd, bd, 1e-5, out, mean, rstd);
      const auto xv = values(xh), w = values(wh);
      LnRef r = ref_layer_norm(xv, w, values(bh), rows, C, 1e-5);
      expect_close(values(out), r.out, tolerance(t) * 2, "ln out");
      expect_close(values(mean), r.mean, 1e-5, "ln mean");
      expect_close(values(rstd), r.rstd, 1e-5, "ln rstd");

      Tensor dyh = host_randn({rows, C}, t);
      const auto dy = values(dyh);
      std::vector<double> rdx(xv.size()), rdw(C, 0.0), rdb(C, 0.0);
      for (int64_t i = 0; i < rows; ++i) {
        double mg = 0, mgx = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double xhat = (xv[i * C + c] - r.mean[i]) * r.rstd[i];
          mg += dy[i * C + c] * w[c];
          mgx += dy[i * C + c] * w[c] * xhat;
          rdw[c] += dy[i * C + c] * xhat;
          rdb[c] += dy[i * C + c];
        }
        for (int64_t c = 0; c < C; ++c) {
          const double xhat = (xv[i * C + c] - r.mean[i]) * r.rstd[i];
          rdx[i * C + c] = r.rstd[i] * (dy[i * C + c] * w[c] - mg / C - xhat * mgx / C);
        }
      }
      Tensor dy_d = to_gpu(dyh);
      Tensor dx = poisoned({rows, C}, t);
      Tensor dw = to_gpu(zeros({C}, {.dtype = t})), db = to_gpu(zeros({C}, {.dtype = t}));
      gpu().layer_norm_backward(dy_d, x, wd, mean, rstd, dx, dw, db);
      expect_close(values(dx), rdx, tolerance(t) * 3, "ln dx");
      expect_close(values(dw), rdw, tolerance(t) * 2, "ln dw");
      expect_close(values(db), rdb, tolerance(t) * 2, "ln db");

      // Again: the same bits (fixed-order sums, no atomics); and dx alone.
      Tensor dw2 = to_gpu(zeros({C}, {.dtype = t})), db2 = to_gpu(zeros({C}, {.dtype = t}));
      Tensor dx2 = poisoned({rows, C}, t);
      gpu().layer_norm_backward(dy_d, x, wd, mean, rstd, dx2, dw2, db2);
      EXPECT_EQ(values(dw2), values(dw)) << "dweight repeats bitwise";
      EXPECT_EQ(values(db2), values(db)) << "dbias repeats bitwise";
      Tensor dx3 = poisoned({rows, C}, t);
      gpu().layer_norm_backward(dy_d, x, wd, mean, rstd, dx3, Tensor(), Tensor());
      EXPECT_EQ(values(dx3), values(dx)) << "dx without dweight/dbias";
    }
  }
}

}  // namespace
}  // namespace tessera
