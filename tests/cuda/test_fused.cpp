// Fused kernels: classifier, multi-tensor AdamW, global grad norm, flash attention (forward
// and backward) and the tensor-core GEMM, each against a float64 reference.
#include <cmath>

#include "cuda_test_util.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {
using namespace cuda_test;

// Vocabularies for each kernel: 5003 (rows not in 8-element packs), 5000 (packed rows kept in
// shared memory between the passes), 60000 (bf16 rows of 117 KB, f32 of 234 KB: too long to
// keep, read twice).
TEST(CudaFused, ClassifierMatchesCrossEntropyAndItsGradient) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) for (const int64_t vocab : {5003, 5000, 60000}) {
    SCOPED_TRACE(::testing::Message() << dtype_name(t) << " vocab " << vocab);
    const int64_t rows = 37;
    Tensor lh = host_randn({rows, vocab}, t, 0.0, 3.0);
    std::vector<int64_t> tg = randint(0, vocab, {rows}, {.dtype = DType::i64}).to_vector<int64_t>();
    tg[5] = -1;  // ignored
    const auto x = values(lh);
    std::vector<double> ref_loss(rows, 0.0), ref_grad(x.size(), 0.0);
    const double scale = 1.0 / (rows - 1);
    for (int64_t r = 0; r < rows; ++r) {
      if (tg[r] == -1) continue;
      double m = -INFINITY, s = 0;
      for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[r * vocab + i]);
      for (int64_t i = 0; i < vocab; ++i) s += std::exp(x[r * vocab + i] - m);
      ref_loss[r] = std::log(s) + m - x[r * vocab + tg[r]];
      for (int64_t i = 0; i < vocab; ++i)
        ref_grad[r * vocab + i] = scale * (std::exp(x[r * vocab + i] - m) / s - (i == tg[r]));
    }
    Tensor logits = to_gpu(lh);
    Tensor losses = poisoned({rows}, DType::f32);
    cuda::fused_classifier(logits, to_gpu(from_vector(tg, {rows}, {.dtype = DType::i64})), -1, scale,
                           losses);
    expect_close(values(losses), ref_loss, 1e-5, "row losses");
    expect_close(values(logits), ref_grad, tolerance(t), "dlogits in place");
  }
  Tensor bad_logits = to_gpu(host_randn({2, 8}));
  Tensor losses = empty({2}, {.device = dev()});
  EXPECT_THROW(cuda::fused_classifier(bad_logits, to_gpu(from_vector(std::vector<int32_t>{0, 8}, {2}, {.dtype = DType::i32})),
                                      -100, 1.0, losses),
               Error);
}

// column_sums (a Linear's bias gradient): one row, fewer rows than a chunk, and enough rows for
// hundreds of chunks; and the layouts it declines.
TEST(CudaFused, ColumnSumsMatchFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const auto& [rows, H] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {13, 40}, {5003, 776}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " rows " << rows << " H " << H);
      const Tensor gh = host_randn({rows, H}, t);
      const auto g = values(gh);
      std::vector<double> ref(static_cast<size_t>(H), 0.0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < H; ++c) ref[c] += g[r * H + c];
      Tensor sums = poisoned({H}, t);
      ASSERT_TRUE(cuda::column_sums(to_gpu(gh), sums));
      // Sums of up to 5003 values, rounded once to the dtype.
      expect_close(values(sums), ref, t == DType::f32 ? 1e-4 : tolerance(t), "column sums");
    }
  }
  const Tensor g = to_gpu(host_randn({16, 24}, DType::bf16));
  Tensor sums = poisoned({24}, DType::bf16);
  EXPECT_FALSE(
      cuda::column_sums(to_gpu(host_randn({16, 12}, DType::bf16)), poisoned({12}, DType::bf16)));
  EXPECT_FALSE(
      cuda::column_sums(raw::transpose(to_gpu(host_randn({24, 16}, DType::bf16)), 0, 1), sums));
  EXPECT_FALSE(cuda::column_sums(g, poisoned({24}, DType::f32)));
  EXPECT_FALSE(cuda::column_sums(g, poisoned({23}, DType::bf16)));
}

// sum_scaled (the two-rank all-reduce's add, dist/cuda/peer_all_reduce.h): (a + b) * scale
// against float64, and bit for bit the add and then the multiply it replaces; sizes with and
// without a tail after the 8-element packs, 16-byte aligned and not, in place as the
// all-reduce calls it; and the operands it refuses.
TEST(CudaFused, SumScaledIsAnAddAndAMultiplyInOnePass) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16})
    for (const int64_t n : {1, 7, 1001, 65539})
      for (const int64_t skip : {0, 1})
        for (const double scale : {1.0, 0.5}) {
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(t) << " n " << n << " skip " << skip << " scale " << scale);
          const Tensor ah = host_randn({n + skip}, t, 0.0, 3.0);
          const Tensor bh = host_randn({n + skip}, t, 0.0, 3.0);
          const Tensor a = raw::narrow(to_gpu(ah), 0, skip, n);
          const Tensor b = raw::narrow(to_gpu(bh), 0, skip, n);
          const auto x = values(raw::narrow(ah, 0, skip, n)),
                     y = values(raw::narrow(bh, 0, skip, n));
          std::vector<double> ref(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) ref[i] = (x[i] + y[i]) * scale;
          Tensor two_passes = poisoned({n}, t);
          gpu().binary(BinaryOp::Add, a, b, two_passes);
          gpu().binary(BinaryOp::Mul, two_passes,
                       raw::expand(to_gpu(full({}, scale, {.dtype = t})), {n}), two_passes);
          Tensor out = poisoned({n}, t);
          cuda::sum_scaled(a, b, scale, out);
          expect_close(values(out), ref, tolerance(t), "sum_scaled");
          EXPECT_EQ(values(out), values(two_passes));
          const Tensor in_place = raw::clone(a);
          cuda::sum_scaled(in_place, b, scale, in_place);
          EXPECT_EQ(values(in_place), values(two_passes));
        }
  const Tensor a = to_gpu(host_randn({16}, DType::bf16));
  EXPECT_THROW(
      cuda::sum_scaled(a, to_gpu(host_randn({16}, DType::f32)), 1.0, poisoned({16}, DType::bf16)),
      Error);
  EXPECT_THROW(cuda::sum_scaled(a, a, 1.0, poisoned({15}, DType::bf16)), Error);
  EXPECT_THROW(
      cuda::sum_scaled(a, raw::as_strided(a, {8}, {2}, 0), 1.0, poisoned({8}, DType::bf16)), Error);
  EXPECT_THROW(
      cuda::sum_scaled(a, raw::to(a, Device::cpu(), DType::bf16), 1.0, poisoned({16}, DType::bf16)),
      Error);
}

TEST(CudaFused, MultiTensorAdamWMatchesPyTorchFormula) {
  TESSERA_REQUIRE_GPU();
  cuda::AdamWConfig cfg;
  cfg.lr = 1e-2f;
  cfg.beta1 = 0.9f;
  cfg.beta2 = 0.95f;
  cfg.eps = 1e-8f;
  cfg.weight_decay = 0.1f;
  cfg.grad_scale = 0.5f;
  const std::vector<Shape> shapes = {{7, 33}, {1}, {70001}};
  for (bool with_master : {false, true}) {
    std::vector<Tensor> p, g, m, v, master;
    std::vector<std::vector<double>> rp, rm, rv, rg;
    std::vector<bool> decay = {true, false, true};
    for (const Shape& s : shapes) {
      Tensor ph = host_randn(s), gh = host_randn(s, with_master ? DType::bf16 : DType::f32);
      Tensor mh = host_randn(s, DType::f32, 0.0, 0.1), vh = host_uniform(s, 0.0, 0.1);
      rp.push_back(values(ph));
      rg.push_back(values(gh));
      rm.push_back(values(mh));
      rv.push_back(values(vh));
      if (with_master) {
        master.push_back(to_gpu(ph));
        p.push_back(to_gpu(raw::to(ph, Device::cpu(), DType::bf16)));
      } else {
        p.push_back(to_gpu(ph));
      }
      g.push_back(to_gpu(gh));
      m.push_back(to_gpu(mh));
      v.push_back(to_gpu(vh));
    }
    for (int64_t step = 1; step <= 3; ++step) {
      cfg.step = step;
      cuda::multi_tensor_adamw(p, g, m, v, master, decay, cfg);
      const double b1c = 1 - std::pow(0.9, step), b2c = 1 - std::pow(0.95, step);
      for (size_t i = 0; i < shapes.size(); ++i)
        for (size_t e = 0; e < rp[i].size(); ++e) {
          const double grad = rg[i][e] * 0.5;
          rm[i][e] = 0.9 * rm[i][e] + 0.1 * grad;
          rv[i][e] = 0.95 * rv[i][e] + 0.05 * grad * grad;
          rp[i][e] *= 1 - 1e-2 * (decay[i] ? 0.1 : 0.0);  // PyTorch: decay first
          rp[i][e] -= 1e-2 * (rm[i][e] / b1c) / (std::sqrt(rv[i][e] / b2c) + 1e-8);
        }
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      expect_close(values(with_master ? master[i] : p[i]), rp[i], 1e-5, "params");
      expect_close(values(m[i]), rm[i], 1e-5, "exp_avg");
      expect_close(values(v[i]), rv[i], 1e-5, "exp_avg_sq");
      if (with_master)  // the bf16 param is the master rounded
        EXPECT_EQ(values(p[i]), values(raw::to(master[i], Device::cpu(), DType::bf16)));
    }
  }
  std::vector<Tensor> one = {to_gpu(host_randn({3}))};
  std::vector<Tensor> wrong = {to_gpu(host_randn({4}))};
  EXPECT_THROW(cuda::multi_tensor_adamw(one, wrong, one, one, {}, {true}, cfg), Error);
}

TEST(CudaFused, GlobalGradNormOverMixedTensors) {
  TESSERA_REQUIRE_GPU();
  std::vector<Tensor> grads;
  double ss = 0;
  for (auto [shape, t] : std::vector<std::pair<Shape, DType>>{
           {{7, 33}, DType::f32}, {{100003}, DType::bf16}, {{1}, DType::f32}, {{257, 3}, DType::f16}}) {
    Tensor h = host_randn(shape, t);
    for (double x : values(h)) ss += x * x;
    grads.push_back(to_gpu(h));
  }
  // A non-contiguous one too.
  Tensor h = host_randn({9, 5});
  for (double x : values(h)) ss += x * x;
  grads.push_back(raw::transpose(to_gpu(h), 0, 1));
  Tensor norm = cuda::global_grad_norm(grads);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_NEAR(norm.item(), std::sqrt(ss), 1e-5 * std::sqrt(ss));
  EXPECT_EQ(cuda::global_grad_norm(grads).item(), norm.item()) << "fixed summation order";
}

// Causal attention in float64 from bf16/f16 inputs: out and lse.
void ref_attention(const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, int64_t BH, int64_t T, int64_t D, double scale,
                   std::vector<double>& out, std::vector<double>& lse, const std::vector<double>* dout,
                   std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) {
  out.assign(BH * T * D, 0.0);
  lse.assign(BH * T, 0.0);
  if (dout) {
    dq->assign(BH * T * D, 0.0);
    dk->assign(BH * T * D, 0.0);
    dv->assign(BH * T * D, 0.0);
  }
  std::vector<double> p(T), dp(T);
  for (int64_t z = 0; z < BH; ++z)
    for (int64_t i = 0; i < T; ++i) {
      const double* qi = &q[(z * T + i) * D];
      double m = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += qi[d] * k[(z * T + j) * D + d];
        p[j] = s * scale;
        m = std::max(m, p[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - m);
      lse[z * T + i] = m + std::log(sum);
      for (int64_t j = 0; j <= i; ++j) {
        p[j] = std::exp(p[j] - m) / sum;
        for (int64_t d = 0; d < D; ++d) out[(z * T + i) * D + d] += p[j] * v[(z * T + j) * D + d];
      }
      if (!dout) continue;
      const double* doi = &(*dout)[(z * T + i) * D];
      double delta = 0;
      for (int64_t d = 0; d < D; ++d) delta += doi[d] * out[(z * T + i) * D + d];
      for (int64_t j = 0; j <= i; ++j) {
        double dpj = 0;
        for (int64_t d = 0; d < D; ++d) dpj += doi[d] * v[(z * T + j) * D + d];
        const double ds = p[j] * (dpj - delta) * scale;
        for (int64_t d = 0; d < D; ++d) {
          (*dv)[(z * T + j) * D + d] += p[j] * doi[d];
          (*dq)[(z * T + i) * D + d] += ds * k[(z * T + j) * D + d];
          (*dk)[(z * T + j) * D + d] += ds * qi[d];
        }
      }
    }
}

TEST(CudaFused, FlashAttentionForwardBackwardAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f16}) {
    for (int64_t D : {64, 128}) {
      const int64_t B = 2, H = 3, T = 200;  // several tiles, the last one partial
      const double scale = 1.0 / std::sqrt(double(D));
      // q, k, v as views of one fused [B, T, 3, H, D] projection, permuted to [B, H, T, D].
      Tensor qkv_h = host_randn({B, T, 3, H, D}, t);
      Tensor qkv = to_gpu(qkv_h);
      auto head_view = [&](const Tensor& x, int64_t which) {
        return raw::permute(raw::select(x, 2, which), {0, 2, 1, 3});
      };
      Tensor q = head_view(qkv, 0), k = head_view(qkv, 1), v = head_view(qkv, 2);
      ASSERT_FALSE(q.is_contiguous());
      auto host_bhtd = [&](int64_t which) {
        return values(raw::contiguous(head_view(qkv_h, which)));
      };
      const auto qv = host_bhtd(0), kv = host_bhtd(1), vv = host_bhtd(2);
      Tensor dout_h = host_randn({B, H, T, D}, t);
      const auto dov = values(dout_h);
      std::vector<double> ro, rl, rdq, rdk, rdv;
      ref_attention(qv, kv, vv, B * H, T, D, scale, ro, rl, &dov, &rdq, &rdk, &rdv);

      Tensor out = poisoned({B, H, T, D}, t), lse = poisoned({B, H, T}, DType::f32);
      cuda::flash_attention_forward(q, k, v, scale, out, lse);
      expect_close(values(out), ro, tolerance(t), "flash out");
      expect_close(values(lse), rl, 1e-5, "flash lse");

      Tensor nout = poisoned({B, H, T, D}, t), nlse = poisoned({B, H, T}, DType::f32);
      cuda::naive_attention_forward(q, k, v, scale, nout, nlse);
      expect_close(values(nout), ro, tolerance(t), "naive out");

      Tensor dq = poisoned({B, H, T, D}, t), dk = poisoned({B, H, T, D}, t), dv = poisoned({B, H, T, D}, t);
      cuda::flash_attention_backward(q, k, v, out, to_gpu(dout_h), lse, scale, dq, dk, dv);
      expect_close(values(dq), rdq, 2 * tolerance(t), "dq");
      expect_close(values(dk), rdk, 2 * tolerance(t), "dk");
      expect_close(values(dv), rdv, 2 * tolerance(t), "dv");
    }
  }
  Tensor bad = to_gpu(host_randn({1, 1, 8, 32}, DType::bf16));
  Tensor o = empty_like(bad), l = empty({1, 1, 8}, {.device = dev()});
  EXPECT_THROW(cuda::flash_attention_forward(bad, bad, bad, 1.0, o, l), Error);  // D = 32
}

TEST(CudaFused, TensorCoreGemmTiledAndNaivePaths) {
  TESSERA_REQUIRE_GPU();
  // Sizes with M % 128, N % 256, K % 64 == 0 take the tiled path: on H100/H200 the wgmma + TMA
  // kernel (4-stage ring), elsewhere the WMMA one. 128x256x64: one tile, one k-tile (fewer k-tiles
  // than stages); 384x1280x576: 3x5 blocks, 9 k-tiles wrap the stage ring twice; 256x512x1088:
  // 17 k-tiles; 512x768x1024: a 3-wide grid of 256-column tiles; 1280x3584x192: 140 tiles, more
  // than the 132 SMs, so persistent blocks take a second tile with the stage ring mid-cycle (3
  // k-tiles per tile, 4 stages). The others take the naive kernel: 33x7x19, and 130x260x70,
  // which misses every tile size by a little.
  const std::vector<std::array<int64_t, 3>> sizes = {
      {256, 512, 192}, {128, 256, 64}, {384, 1280, 576}, {256, 512, 1088},
      {512, 768, 1024}, {1280, 3584, 192}, {33, 7, 19}, {130, 260, 70}};
  for (DType t : {DType::bf16, DType::f16}) {
    for (auto [M, N, K] : sizes) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " " << M << "x" << N << "x" << K);
      Tensor ah = host_randn({M, K}, t), bh = host_randn({K, N}, t);
      const auto a = values(ah), b = values(bh);
      std::vector<double> ref(M * N, 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t j = 0; j < N; ++j) ref[i * N + j] += a[i * K + k] * b[k * N + j];
      Tensor c = poisoned({M, N}, t);
      cuda::tensor_core_gemm(to_gpu(ah), to_gpu(bh), c);
      expect_close(values(c), ref, tolerance(t), "tensor_core_gemm");
    }
  }
}


// The classifier's packed path (vocab a multiple of 8, up to GPT-2's 50304) and its element
// path (odd vocab), f16, and masked (-inf) logits that are not the target, against float64.
TEST(CudaFused, ClassifierPackedRowsAndMaskedLogits) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (int64_t vocab : {8, 33, 4104, 50304}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " vocab " + std::to_string(vocab));
      const int64_t rows = vocab > 5000 ? 4 : 19;
      std::vector<double> x = values(host_randn({rows, vocab}, t, 0.0, 3.0));
      std::vector<int64_t> tg = randint(0, vocab, {rows}, {.dtype = DType::i64}).to_vector<int64_t>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = r % 5; i < vocab; i += 7)
          if (i != tg[r]) x[r * vocab + i] = -INFINITY;
      Tensor lh = raw::to(from_vector(x, {rows, vocab}, {.dtype = DType::f64}), Device::cpu(), t);
      x = values(lh);
      const double scale = 0.7;
      std::vector<double> ref_loss(rows), ref_grad(x.size());
      for (int64_t r = 0; r < rows; ++r) {
        double m = -INFINITY, s = 0;
        for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[r * vocab + i]);
        for (int64_t i = 0; i < vocab; ++i) s += std::exp(x[r * vocab + i] - m);
        ref_loss[r] = std::log(s) + m - x[r * vocab + tg[r]];
        for (int64_t i = 0; i < vocab; ++i)
          ref_grad[r * vocab + i] = scale * (std::exp(x[r * vocab + i] - m) / s - (i == tg[r]));
      }
      Tensor logits = to_gpu(lh), losses = poisoned({rows}, DType::f32);
      cuda::fused_classifier(logits, to_gpu(from_vector(tg, {rows}, {.dtype = DType::i64})), -1,
                             scale, losses);
      expect_close(values(losses), ref_loss, 1e-5, "row losses");
      expect_close(values(logits), ref_grad, tolerance(t), "dlogits in place");
    }
  }
}

}  // namespace
}  // namespace tessera
