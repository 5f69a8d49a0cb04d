// The kernels behind the fused Llama training step against the CPU: the residual add fused
// into RMSNorm (forward and the backward that adds the residual stream's gradient), the
// register-resident RMSNorm paths with their parallel dweight reduction, RoPE reading strided
// inputs in 16-byte packs and writing strided outputs, Llama's attention straight from its
// fused q | k | v projection, gradient clipping's packed kernels, and a bf16 Llama's
// gradients against the fp32 CPU model.
// Skipped without a GPU.
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/nn/llama.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::to_gpu;

Tensor on_cpu(const Tensor& t) { return raw::to(t, Device::cpu(), t.dtype()); }
Tensor as_f64(const Tensor& t) { return raw::to(t, Device::cpu(), DType::f64); }
double rel(const Tensor& gpu, const Tensor& cpu) { return ops::max_rel_error(on_cpu(gpu), cpu); }

// The same random values (rounded to dt) on the host and on the device, both seen through
// one transpose: [a, b, C] views of stored [b, a, C] tensors (non-contiguous on both sides).
struct HostDevice {
  Tensor cpu, gpu;
};
HostDevice transposed_randn(int64_t a, int64_t b, int64_t C, DType dt) {
  const Tensor stored = cuda_test::host_randn({b, a, C}, dt);
  return {raw::transpose(stored, 0, 1), raw::transpose(to_gpu(stored), 0, 1)};
}

TEST(CudaLlamaFusions, ResidualRmsNormMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    // 8..1024: registers in both directions; 2048: registers forward only; 37, 4099: general.
    for (int64_t C : {8, 37, 768, 2048, 4099}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " C=" + std::to_string(C));
      const HostDevice xs = transposed_randn(5, 7, C, dt), rs = transposed_randn(5, 7, C, dt);
      const Tensor x = xs.cpu, r = rs.cpu, w = cuda_test::host_randn({C}, dt, 1.0, 0.2);
      ASSERT_FALSE(xs.gpu.is_contiguous());
      const ops::ResidualRmsNormOutput cpu = ops::residual_rms_norm(x, r, w, 1e-5);
      const ops::ResidualRmsNormOutput gpu =
          ops::residual_rms_norm(xs.gpu, rs.gpu, to_gpu(w), 1e-5);
      // One rounding of the same f32 (f64) sum on both sides.
      EXPECT_LE(rel(gpu.sum, cpu.sum), cuda_test::tolerance(dt));
      EXPECT_LE(rel(gpu.out, cpu.out), cuda_test::tolerance(dt));
      EXPECT_LE(rel(gpu.rstd, cpu.rstd), 1e-5);
      // Against float64 math on the same (rounded) inputs.
      const ops::RmsNormOutput exact =
          ops::rms_norm(ops::binary(BinaryOp::Add, as_f64(x), as_f64(r)), as_f64(w), 1e-5);
      EXPECT_LE(ops::max_rel_error(as_f64(gpu.out), exact.out), 2 * cuda_test::tolerance(dt));

      const HostDevice dys = transposed_randn(5, 7, C, dt), dress = transposed_randn(5, 7, C, dt);
      const Tensor dy = dys.cpu, dres = dress.cpu;
      const ops::RmsNormGrads gc =
          ops::rms_norm_backward_residual(dy, cpu.sum, w, cpu.rstd, dres, true);
      const ops::RmsNormGrads gg =
          ops::rms_norm_backward_residual(dys.gpu, gpu.sum, to_gpu(w), gpu.rstd, dress.gpu, true);
      EXPECT_LE(rel(gg.dx, gc.dx), (dt == DType::f64 ? 4 : 2) * cuda_test::tolerance(dt));
      EXPECT_LE(rel(gg.dweight, gc.dweight), 4 * cuda_test::tolerance(dt));
      const ops::RmsNormGrads exact_grads = ops::rms_norm_backward_residual(
          as_f64(dy), as_f64(cpu.sum), as_f64(w), exact.rstd, as_f64(dres), true);
      EXPECT_LE(ops::max_rel_error(as_f64(gg.dx), exact_grads.dx), 2 * cuda_test::tolerance(dt));
      EXPECT_LE(ops::max_rel_error(as_f64(gg.dweight), exact_grads.dweight),
                4 * cuda_test::tolerance(dt));
      // dweight accumulates into what is there (+=), as the plain backward's.
      const Tensor dw = to_gpu(cuda_test::host_randn({C}, dt));
      const Tensor dw_before = on_cpu(dw);
      cuda_test::gpu().rms_norm_backward(to_gpu(dy), gpu.sum, to_gpu(w), gpu.rstd,
                                         empty(x.shape(), {.dtype = dt, .device = dev()}), dw);
      const ops::RmsNormGrads plain = ops::rms_norm_backward(dy, cpu.sum, w, cpu.rstd, true);
      EXPECT_LE(rel(dw, ops::binary(BinaryOp::Add, dw_before, plain.dweight)),
                4 * cuda_test::tolerance(dt));
    }
  }
}

TEST(CudaLlamaFusions, RmsNormWithoutWeightAndOddRowCountsMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  // One row, 3 rows, and more rows than the persistent grid holds warps.
  for (int64_t rows : {1, 3, 20011}) {
    SCOPED_TRACE(rows);
    const Tensor x = cuda_test::host_randn({rows, 64}, DType::bf16);
    const Tensor r = cuda_test::host_randn({rows, 64}, DType::bf16);
    const ops::ResidualRmsNormOutput cpu = ops::residual_rms_norm(x, r, Tensor(), 1e-6);
    const ops::ResidualRmsNormOutput gpu =
        ops::residual_rms_norm(to_gpu(x), to_gpu(r), Tensor(), 1e-6);
    EXPECT_LE(rel(gpu.out, cpu.out), cuda_test::tolerance(DType::bf16));
    const Tensor dy = cuda_test::host_randn({rows, 64}, DType::bf16);
    const Tensor w = cuda_test::host_randn({64}, DType::bf16, 1.0, 0.3);
    const ops::RmsNormGrads gc = ops::rms_norm_backward(dy, cpu.sum, w, cpu.rstd, true);
    const ops::RmsNormGrads gg =
        ops::rms_norm_backward(to_gpu(dy), gpu.sum, to_gpu(w), gpu.rstd, true);
    EXPECT_LE(rel(gg.dx, gc.dx), cuda_test::tolerance(DType::bf16));
    EXPECT_LE(rel(gg.dweight, gc.dweight), 4 * cuda_test::tolerance(DType::bf16));
  }
}

TEST(CudaLlamaFusions, RopeReadsStridedInputsInEveryLayout) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (int64_t D : {6, 16, 64, 128}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " D=" + std::to_string(D));
      const int64_t B = 2, T = 13, H = 3;
      // Heads of the middle third of a fused [B, T, 3 * H * D] projection (row stride 3HD),
      // [B, H, T, D] stored seen as [B, T, H, D], and a contiguous input; each view taken on
      // the host and on the device alike.
      const Tensor fused = cuda_test::host_randn({B, T, 3 * H * D}, dt);
      const Tensor head_major = cuda_test::host_randn({B, H, T, D}, dt);
      const Tensor contiguous = cuda_test::host_randn({B, T, H, D}, dt);
      auto from_fused = [&](const Tensor& t) {
        return raw::view(raw::narrow(t, 2, H * D, H * D), {B, T, H, D});
      };
      auto seq_major = [](const Tensor& t) { return raw::transpose(t, 1, 2); };
      const std::vector<HostDevice> inputs{{from_fused(fused), from_fused(to_gpu(fused))},
                                           {seq_major(head_major), seq_major(to_gpu(head_major))},
                                           {contiguous, to_gpu(contiguous)}};
      const ops::RopeTables cpu_tables = ops::rope_tables(3, T, D, 10000.0, dt);
      const ops::RopeTables gpu_tables = ops::rope_tables(3, T, D, 10000.0, dt, dev());
      const ops::RopeTables exact_tables = ops::rope_tables(3, T, D, 10000.0, DType::f64);
      for (const HostDevice& x : inputs) {
        for (bool inverse : {false, true}) {
          const Tensor got = ops::rope(x.gpu, gpu_tables, inverse);
          EXPECT_TRUE(got.is_contiguous());
          EXPECT_LE(rel(got, ops::rope(x.cpu, cpu_tables, inverse)), cuda_test::tolerance(dt));
          // And against float64 math on the same inputs.
          EXPECT_LE(
              ops::max_rel_error(as_f64(got), ops::rope(as_f64(x.cpu), exact_tables, inverse)),
              2 * cuda_test::tolerance(dt));
          // Written into heads 1..H of a [B, T, H + 2, D] buffer: a strided output, the
          // heads around it left as they were.
          const Tensor buffer = to_gpu(cuda_test::host_randn({B, T, H + 2, D}, dt));
          const Tensor before = on_cpu(buffer);
          ops::rope_into(x.gpu, gpu_tables, inverse, raw::narrow(buffer, 2, 1, H));
          EXPECT_LE(rel(raw::narrow(buffer, 2, 1, H), ops::rope(x.cpu, cpu_tables, inverse)),
                    cuda_test::tolerance(dt));
          EXPECT_EQ(rel(raw::narrow(buffer, 2, 0, 1), raw::narrow(before, 2, 0, 1)), 0.0);
          EXPECT_EQ(rel(raw::narrow(buffer, 2, H + 1, 1), raw::narrow(before, 2, H + 1, 1)), 0.0);
        }
      }
    }
  }
}

// Llama's attention from its fused projection: one RoPE launch for q | k, attention on views,
// and dv, dq, dk written into one d(qkv). Against float64 math on the host (the composed
// reference path), for each attention backend, with and without grouped-query heads.
TEST(CudaLlamaFusions, RotaryAttentionFromTheFusedProjectionMatchesFloat64) {
  TESSERA_REQUIRE_GPU();
  std::vector<AttentionBackend> backends{AttentionBackend::Flash};
  std::string why;
  const FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  if (fused.cudnn_attention_available && fused.cudnn_attention_available(&why))
    backends.push_back(AttentionBackend::Cudnn);
  const AttentionBackendRestorer restore_backend;
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{77, 6, 2}, {130, 4, 4}};
  for (AttentionBackend backend : backends) {
    set_attention_backend(backend);
    for (DType dt : {DType::bf16, DType::f16}) {
      for (int64_t D : {64, 128}) {
        for (auto [T, H, Hkv] : shapes) {
          SCOPED_TRACE(std::string(attention_backend_name(backend)) + " " + dtype_name(dt) +
                       " D=" + std::to_string(D) + " T=" + std::to_string(T) +
                       " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv));
          const int64_t B = 2, W = (H + 2 * Hkv) * D;
          const Tensor qkv_host = cuda_test::host_randn({B, T, W}, dt);
          const Tensor dy_host = cuda_test::host_randn({B, T, H * D}, dt);
          Tensor exact_in = as_f64(qkv_host).requires_grad_();
          const Tensor exact = rotary_causal_attention_qkv(
              exact_in, H, Hkv, ops::rope_tables(0, T, D, 10000.0, DType::f64));
          exact.backward(as_f64(dy_host));
          const ops::RopeTables tables = ops::rope_tables(0, T, D, 10000.0, dt, dev());
          for (bool allow_fused : {true, false}) {
            Tensor qkv = to_gpu(qkv_host).requires_grad_();
            const Tensor y = rotary_causal_attention_qkv(qkv, H, Hkv, tables, allow_fused);
            ASSERT_EQ(y.shape(), (Shape{B, T, H * D}));
            y.backward(to_gpu(dy_host));
            const double tol = 2 * cuda_test::tolerance(dt);
            EXPECT_LE(ops::max_rel_error(as_f64(y), exact), tol) << "fused " << allow_fused;
            EXPECT_LE(ops::max_rel_error(as_f64(qkv.grad()), exact_in.grad()), 2 * tol)
                << "fused " << allow_fused;
          }
        }
      }
    }
  }
}

// Gradient clipping's kernels move 16-byte packs where a chunk is aligned and single elements
// elsewhere: odd sizes, views starting off a 16-byte boundary, every float dtype.
TEST(CudaLlamaFusions, ClippingNormAndScaleMatchTheCpuInEveryAlignment) {
  TESSERA_REQUIRE_GPU();
  std::vector<Tensor> host, device;
  double sum_squares = 0;
  for (auto [n, offset, dt] :
       std::vector<std::tuple<int64_t, int64_t, DType>>{{100003, 0, DType::bf16},
                                                        {70001, 3, DType::bf16},
                                                        {33, 0, DType::f16},
                                                        {40000, 5, DType::f16},
                                                        {65539, 1, DType::f32},
                                                        {9, 0, DType::f32}}) {
    // [offset, offset + n) of a longer buffer: contiguous, but off alignment when offset > 0.
    const Tensor buffer = cuda_test::host_randn({offset + n}, dt);
    host.push_back(raw::contiguous(raw::narrow(buffer, 0, offset, n)));
    device.push_back(raw::narrow(to_gpu(buffer), 0, offset, n));
    for (double x : cuda_test::values(host.back())) sum_squares += x * x;
  }
  const Tensor norm = cuda::global_grad_norm(device);
  EXPECT_NEAR(norm.item(), std::sqrt(sum_squares), 1e-5 * std::sqrt(sum_squares));
  EXPECT_EQ(cuda::global_grad_norm(device).item(), norm.item()) << "fixed summation order";
  // Clipping to half the norm scales every element by the same factor (on the device).
  const double max_norm = 0.5 * norm.item();
  const double factor = max_norm / (norm.item() + 1e-6);
  cuda::multi_tensor_clip_(device, norm, max_norm);
  for (size_t i = 0; i < host.size(); ++i) {
    SCOPED_TRACE(i);
    const Tensor expected = ops::binary(BinaryOp::Mul, as_f64(host[i]), factor);
    EXPECT_LE(ops::max_rel_error(as_f64(device[i]), expected),
              cuda_test::tolerance(host[i].dtype()));
  }
  // A plain scale by 2 is exact in every dtype.
  const std::vector<double> before = cuda_test::values(on_cpu(device[1]));
  cuda::multi_tensor_scale_(device, 2.0);
  const std::vector<double> after = cuda_test::values(on_cpu(device[1]));
  for (size_t j = 0; j < before.size(); ++j) ASSERT_EQ(after[j], 2 * before[j]) << j;
}

// A bf16 Llama with head dim 64 runs the fused attention kernels, the residual-fused norms
// and the packed RoPE; its gradients must match the fp32 CPU model's to bf16 accuracy.
TEST(CudaLlamaFusions, Bf16LlamaGradientsMatchTheCpu) {
  TESSERA_REQUIRE_GPU();
  nn::LlamaConfig cfg{.vocab_size = 67,
                      .hidden_size = 128,
                      .intermediate_size = 200,
                      .num_hidden_layers = 2,
                      .num_attention_heads = 2,
                      .num_key_value_heads = 1,
                      .max_position_embeddings = 64};
  Generator gen(5);
  nn::Llama cpu_model(cfg, &gen), gpu_model(cfg);
  const nn::NamedTensors state = cpu_model.state_dict();
  gpu_model.load_state_dict(std::map<std::string, Tensor>(state.begin(), state.end()));
  gpu_model.to(dev(), DType::bf16);
  const Tensor idx = randint(0, 67, {3, 40}, {.dtype = DType::i64}, &gen);
  const Tensor targets = randint(0, 67, {3, 40}, {.dtype = DType::i64}, &gen);
  cpu_model.loss(idx, targets).backward();
  gpu_model.loss(to_gpu(idx), to_gpu(targets)).backward();
  const auto cpu_params = cpu_model.named_parameters(), gpu_params = gpu_model.named_parameters();
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    const Tensor g = gpu_params[i].second.grad();
    ASSERT_TRUE(g.defined()) << gpu_params[i].first;
    EXPECT_TRUE(g.is_contiguous()) << gpu_params[i].first;
    EXPECT_LE(ops::max_rel_error(as_f64(g), as_f64(cpu_params[i].second.grad())), 5e-2)
        << cpu_params[i].first;
  }
}

}  // namespace
}  // namespace tessera
