// The CUDA kernels added for Llama-style models and issue 17 (RMSNorm forward/backward, RoPE,
// cumsum, topk, sampling, the f64 cross-entropy total, GELU's saturated gradient, long sums)
// against the CPU kernels on the same inputs. Skipped without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "tessera/autograd/functions.h"
#include "cuda_test_util.h"
#include "tessera/nn/llama.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::to_gpu;

Tensor on_cpu(const Tensor& t) { return raw::to(t, Device::cpu(), t.dtype()); }

double rel(const Tensor& gpu, const Tensor& cpu) { return ops::max_rel_error(on_cpu(gpu), cpu); }

TEST(CudaLlamaOps, RmsNormForwardBackwardMatchTheCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (int64_t C : {8, 37, 1024, 4099}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " C=" + std::to_string(C));
      const Tensor x = cuda_test::host_randn({5, 7, C}, dt),
                   w = cuda_test::host_randn({C}, dt, 1.0, 0.2);
      const Tensor dy = cuda_test::host_randn({5, 7, C}, dt);
      const ops::RmsNormOutput cpu = ops::rms_norm(x, w, 1e-5);
      const ops::RmsNormOutput gpu = ops::rms_norm(to_gpu(x), to_gpu(w), 1e-5);
      EXPECT_LE(rel(gpu.out, cpu.out), cuda_test::tolerance(dt));
      EXPECT_LE(rel(gpu.rstd, cpu.rstd), 1e-5);
      const ops::RmsNormGrads gc = ops::rms_norm_backward(dy, x, w, cpu.rstd, true);
      const ops::RmsNormGrads gg =
          ops::rms_norm_backward(to_gpu(dy), to_gpu(x), to_gpu(w), gpu.rstd, true);
      // dx sums over a row of up to 4099 in another order on the GPU: in f64 that measured
      // 1.4e-12 on an H100 (a few units of rounding), so f64 gets the same 4x as dweight.
      EXPECT_LE(rel(gg.dx, gc.dx), (dt == DType::f64 ? 4 : 1) * cuda_test::tolerance(dt));
      EXPECT_LE(rel(gg.dweight, gc.dweight), 4 * cuda_test::tolerance(dt));
    }
  }
  // A transposed (non-contiguous) input and no weight.
  const Tensor xt = raw::transpose(cuda_test::host_randn({64, 6}), 0, 1);
  EXPECT_LE(
      rel(ops::rms_norm(to_gpu(xt), Tensor(), 1e-6).out, ops::rms_norm(xt, Tensor(), 1e-6).out),
      1e-5);
}

TEST(CudaLlamaOps, RopeMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    SCOPED_TRACE(dtype_name(dt));
    // [B, H, T, D] stored, seen as [B, T, H, D].
    const Tensor x = raw::transpose(cuda_test::host_randn({2, 3, 11, 64}, dt), 1, 2);
    const ops::RopeTables cpu_tables = ops::rope_tables(5, 11, 64, 10000.0, dt);
    const ops::RopeTables gpu_tables = ops::rope_tables(5, 11, 64, 10000.0, dt, dev());
    for (bool inverse : {false, true}) {
      EXPECT_LE(rel(ops::rope(to_gpu(x), gpu_tables, inverse), ops::rope(x, cpu_tables, inverse)),
                cuda_test::tolerance(dt));
    }
  }
}

TEST(CudaLlamaOps, CumsumAndTopkMatchTheCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    const Tensor x = cuda_test::host_randn({6, 333, 5}, dt);
    for (int64_t dim : {0, 1, 2}) {
      for (bool reverse : {false, true})
        EXPECT_LE(rel(ops::cumsum(to_gpu(x), dim, reverse), ops::cumsum(x, dim, reverse)),
                  4 * cuda_test::tolerance(dt));
      const ops::TopK c = ops::topk(x, 3, dim), g = ops::topk(to_gpu(x), 3, dim);
      EXPECT_EQ(rel(g.values, c.values), 0.0);
      EXPECT_EQ(rel(g.indices, c.indices), 0.0);
      const ops::TopK cs = ops::topk(x, 2, dim, false), gs = ops::topk(to_gpu(x), 2, dim, false);
      EXPECT_EQ(rel(gs.indices, cs.indices), 0.0);
    }
  }
  const Tensor ints = from_vector<int64_t>({1, 2, 3, 4, 5}, {5}, {.dtype = DType::i64});
  EXPECT_EQ(rel(ops::cumsum(to_gpu(ints), 0), ops::cumsum(ints, 0)), 0.0);
}

TEST(CudaLlamaOps, SamplingStaysOnTheDevice) {
  TESSERA_REQUIRE_GPU();
  Generator gen(1);
  const Tensor probs =
      to_gpu(from_vector<double>({0.2, 0.0, 0.8, 0.0, 0.0, 1.0}, {2, 3}, {.dtype = DType::f32}));
  const Tensor draws = ops::multinomial(probs, 4000, &gen);
  EXPECT_TRUE(draws.device().is_cuda());
  const std::vector<int64_t> d = on_cpu(draws).to_vector<int64_t>();
  double first = 0;
  for (int64_t j = 0; j < 4000; ++j) {
    EXPECT_NE(d[j], 1);
    first += d[j] == 0 ? 1.0 / 4000 : 0.0;
    EXPECT_EQ(d[4000 + j], 2);
  }
  EXPECT_NEAR(first, 0.2, 0.03);
  const Tensor logits = to_gpu(cuda_test::host_randn({3, 50}));
  const Tensor picked = ops::sample_logits(logits, 0.8, 5, &gen);
  EXPECT_TRUE(picked.device().is_cuda());
  const Tensor top = on_cpu(ops::topk(logits, 5, -1).indices);
  const std::vector<int64_t> p = on_cpu(picked).to_vector<int64_t>(), t = top.to_vector<int64_t>();
  for (int64_t r = 0; r < 3; ++r)
    EXPECT_NE(std::find(t.begin() + 5 * r, t.begin() + 5 * r + 5, p[r]), t.begin() + 5 * r + 5);
}

TEST(CudaLlamaOps, PrecisionDefectsAreFixedOnTheGpuToo) {
  TESSERA_REQUIRE_GPU();
  // f64 cross-entropy keeps f64 through the total.
  const Tensor logits = cuda_test::host_randn({40, 13}, DType::f64, 0.0, 10.0);
  const Tensor targets = ops::argmax(cuda_test::host_randn({40, 13}, DType::f64), 1);
  const Tensor cpu_loss = ops::cross_entropy(logits, targets, -100, ops::Reduction::Sum);
  const Tensor gpu_loss =
      ops::cross_entropy(to_gpu(logits), to_gpu(targets), -100, ops::Reduction::Sum);
  EXPECT_EQ(gpu_loss.dtype(), DType::f64);
  EXPECT_NEAR(gpu_loss.item(), cpu_loss.item(), 1e-12 * std::fabs(cpu_loss.item()));
  // GELU's gradient at +-inf is its limit, not NaN.
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    const Tensor x =
        to_gpu(raw::to(from_vector<double>({inf, -inf, 1e30, -1e30}, {4}), Device::cpu(), dt));
    const std::vector<double> g =
        on_cpu(raw::to(ops::gelu_backward(x, ones_like(x)), dev(), DType::f64)).to_vector<double>();
    EXPECT_EQ(g, (std::vector<double>{1, 0, 1, 0})) << dtype_name(dt);
  }
  // A long f32 sum on the GPU against float64.
  Generator gen(2);
  const Tensor u = uniform({1000000}, 0.0, 1.0, {.dtype = DType::f32}, &gen);
  const double exact = ops::sum(raw::to(u, Device::cpu(), DType::f64)).item();
  EXPECT_LE(std::fabs(ops::sum(to_gpu(u)).item() - exact) / exact, 1e-7);
}

// f64 layer norm on the GPU keeps f64 statistics (mean, rstd saved as f64, as on the CPU),
// so its forward and backward agree with the CPU's to f64 rounding, not f32's. Rows of 1000
// (the general kernels) and of 96 (a multiple of 8, where other dtypes take the fast path).
TEST(CudaLlamaOps, Float64LayerNormKeepsFloat64Statistics) {
  TESSERA_REQUIRE_GPU();
  for (int64_t C : {1000, 96}) {
    const Tensor x = cuda_test::host_randn({37, C}, DType::f64, 3.0, 2.0);
    const Tensor w = cuda_test::host_randn({C}, DType::f64, 1.0, 0.5);
    const Tensor b = cuda_test::host_randn({C}, DType::f64);
    const Tensor dy = cuda_test::host_randn({37, C}, DType::f64);
    const ops::LayerNormOutput cpu = ops::layer_norm(x, w, b, 1e-5);
    const ops::LayerNormOutput gpu = ops::layer_norm(to_gpu(x), to_gpu(w), to_gpu(b), 1e-5);
    ASSERT_EQ(gpu.mean.dtype(), DType::f64);
    ASSERT_EQ(gpu.rstd.dtype(), DType::f64);
    const double out_err = rel(gpu.out, cpu.out), mean_err = rel(gpu.mean, cpu.mean),
                 rstd_err = rel(gpu.rstd, cpu.rstd);
    const ops::LayerNormGrads cpu_g = ops::layer_norm_backward(dy, x, w, cpu.mean, cpu.rstd, true);
    const ops::LayerNormGrads gpu_g = ops::layer_norm_backward(
        to_gpu(dy), to_gpu(x), to_gpu(w), gpu.mean, gpu.rstd, true);
    const double dx_err = rel(gpu_g.dx, cpu_g.dx), dw_err = rel(gpu_g.dweight, cpu_g.dweight),
                 db_err = rel(gpu_g.dbias, cpu_g.dbias);
    std::printf("f64 layer norm C=%lld: out %.2e mean %.2e rstd %.2e dx %.2e dw %.2e db %.2e\n",
                (long long)C, out_err, mean_err, rstd_err, dx_err, dw_err, db_err);
    for (double err : {out_err, mean_err, rstd_err, dx_err, dw_err, db_err})
      EXPECT_LE(err, 1e-12) << "C=" << C << ": out " << out_err << " mean " << mean_err
                            << " rstd " << rstd_err << " dx " << dx_err << " dw " << dw_err
                            << " db " << db_err;
  }
}

// swiglu on the GPU runs the fused kernels (one pass each way); its output and both input
// gradients match the CPU's composition silu(gate) * up computed in float64 from the same
// inputs (the reference: the CPU's own bf16/f16 composition rounds after every op, so it
// may sit a few ulps from the fused kernel's single rounding), in every float dtype, for
// packed rows (a multiple of 8 elements) and odd sizes.
TEST(CudaLlamaOps, FusedSwigluMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64})
    for (const Shape& shape : {Shape{16, 256}, Shape{7, 333}}) {
      const Tensor gate = cuda_test::host_randn(shape, dt, 0.0, 3.0);
      const Tensor up = cuda_test::host_randn(shape, dt);
      const Tensor dout = cuda_test::host_randn(shape, dt);
      auto run = [&](const Tensor& g_in, const Tensor& u_in, const Tensor& d) {
        Tensor g = g_in, u = u_in;
        g.requires_grad_();
        u.requires_grad_();
        const Tensor y = swiglu(g, u);
        y.backward(d);
        return std::vector<Tensor>{y, g.grad(), u.grad()};
      };
      const auto f64 = [](const Tensor& t) { return raw::to(t, Device::cpu(), DType::f64); };
      const auto cpu = run(f64(gate), f64(up), f64(dout));
      const auto gpu = run(to_gpu(gate), to_gpu(up), to_gpu(dout));
      const char* names[] = {"out", "dgate", "dup"};
      for (int i = 0; i < 3; ++i) {
        const double err = rel(gpu[i], cpu[i]);
        std::printf("swiglu %s %s %s: max rel error %.2e\n", dtype_name(dt),
                    shape_str(shape).c_str(), names[i], err);
        EXPECT_LE(err, cuda_test::tolerance(dt))
            << dtype_name(dt) << " " << shape_str(shape) << " " << names[i] << ": max rel error "
            << err;
      }
    }
}

// The Llama layers through autograd on the GPU against the CPU (fp32).
TEST(CudaLlamaOps, LlamaForwardAndGradientsMatchTheCpu) {
  TESSERA_REQUIRE_GPU();
  nn::LlamaConfig cfg{.vocab_size = 61,
                      .hidden_size = 64,
                      .intermediate_size = 96,
                      .num_hidden_layers = 2,
                      .num_attention_heads = 4,
                      .num_key_value_heads = 2,
                      .max_position_embeddings = 32};
  Generator gen(3);
  nn::Llama cpu_model(cfg, &gen), gpu_model(cfg);
  const nn::NamedTensors state = cpu_model.state_dict();
  gpu_model.load_state_dict(std::map<std::string, Tensor>(state.begin(), state.end()));
  gpu_model.to(dev());
  const Tensor idx = randint(0, 61, {2, 19}, {.dtype = DType::i64}, &gen);
  const Tensor targets = randint(0, 61, {2, 19}, {.dtype = DType::i64}, &gen);
  EXPECT_LE(rel(gpu_model.forward(to_gpu(idx)), cpu_model.forward(idx)), 1e-4);
  cpu_model.loss(idx, targets).backward();
  gpu_model.loss(to_gpu(idx), to_gpu(targets)).backward();
  const auto cpu_params = cpu_model.named_parameters(), gpu_params = gpu_model.named_parameters();
  for (size_t i = 0; i < cpu_params.size(); ++i)
    EXPECT_LE(rel(gpu_params[i].second.grad(), cpu_params[i].second.grad()), 1e-4)
        << cpu_params[i].first;
}

}  // namespace
}  // namespace tessera
