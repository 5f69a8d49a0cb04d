// The residual add of GPT-2's pre-norm blocks fused into LayerNorm on the GPU, against float64
// math on the CPU: the forward (sum and norm in one pass) and the backward that adds the
// residual stream's gradient into dx, in every dtype, for rows that take the register-resident
// kernels and rows that take the general ones, with and without weight and bias; the weight
// and bias gradients repeat bit for bit. Skipped without a GPU.
#include <string>

#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::to_gpu;

Tensor as_f64(const Tensor& t) { return raw::to(t, Device::cpu(), DType::f64); }
using cuda_test::host_values;

// The same random values (rounded to dt) on the host and on the device, both seen through one
// transpose: [a, b, C] views of stored [b, a, C] tensors (non-contiguous on both sides).
struct HostDevice {
  Tensor cpu, gpu;
};
HostDevice transposed_randn(int64_t a, int64_t b, int64_t C, DType dt) {
  const Tensor stored = cuda_test::host_randn({b, a, C}, dt);
  return {raw::transpose(stored, 0, 1), raw::transpose(to_gpu(stored), 0, 1)};
}

// Runs the GPU's fused forward and backward on rows of length C in dtype dt and compares them
// with the float64 composition (the add, then layer_norm, and its backward plus dresidual).
void check_against_float64(DType dt, int64_t a, int64_t b, int64_t C, bool with_weight,
                           bool with_bias, bool with_x_bias = false) {
  const HostDevice xs = transposed_randn(a, b, C, dt), rs = transposed_randn(a, b, C, dt);
  if (a > 1 && b > 1) ASSERT_FALSE(xs.gpu.is_contiguous());  // a size-1 dim leaves it dense
  const Tensor w = with_weight ? cuda_test::host_randn({C}, dt, 1.0, 0.2) : Tensor();
  const Tensor bias = with_bias ? cuda_test::host_randn({C}, dt, 0.0, 0.3) : Tensor();
  // A projection's bias added inside the norm (GPT's deferred output biases).
  const Tensor xb = with_x_bias ? cuda_test::host_randn({C}, dt, 0.0, 0.5) : Tensor();
  auto gpu_or_none = [](const Tensor& t) { return t.defined() ? to_gpu(t) : Tensor(); };
  auto f64_or_none = [](const Tensor& t) { return t.defined() ? as_f64(t) : Tensor(); };
  const ops::ResidualLayerNormOutput gpu = ops::residual_layer_norm(
      xs.gpu, rs.gpu, gpu_or_none(w), gpu_or_none(bias), 1e-5, gpu_or_none(xb));
  const double tol = cuda_test::tolerance(dt);
  // The float64 sum, rounded to dt on the GPU (twice with x_bias: after each add, as the
  // composition on the device, which it equals bit for bit).
  const Tensor x_biased =
      with_x_bias ? ops::binary(BinaryOp::Add, as_f64(xs.cpu), as_f64(xb)) : as_f64(xs.cpu);
  const Tensor exact_sum = ops::binary(BinaryOp::Add, x_biased, as_f64(rs.cpu));
  cuda_test::expect_close(host_values(gpu.sum), host_values(exact_sum), with_x_bias ? 2 * tol : tol,
                          "sum");
  if (with_x_bias) {
    const Tensor composed =
        ops::binary(BinaryOp::Add, ops::binary(BinaryOp::Add, xs.gpu, to_gpu(xb)), rs.gpu);
    EXPECT_EQ(host_values(gpu.sum), host_values(composed));
  }
  // The norm of that (rounded) sum in float64.
  const Tensor sum64 = as_f64(gpu.sum);
  const ops::LayerNormOutput exact =
      ops::layer_norm(sum64, f64_or_none(w), f64_or_none(bias), 1e-5);
  cuda_test::expect_close(host_values(gpu.out), host_values(exact.out), 2 * tol, "out");
  cuda_test::expect_close(host_values(gpu.mean), host_values(exact.mean), 1e-5, "mean");
  cuda_test::expect_close(host_values(gpu.rstd), host_values(exact.rstd), 1e-5, "rstd");

  const HostDevice dys = transposed_randn(a, b, C, dt), dress = transposed_randn(a, b, C, dt);
  auto backward = [&] {
    return ops::layer_norm_backward_residual(dys.gpu, gpu.sum, gpu_or_none(w), gpu.mean, gpu.rstd,
                                             dress.gpu, true, with_x_bias);
  };
  const ops::LayerNormGrads gg = backward();
  const ops::LayerNormGrads exact_grads =
      ops::layer_norm_backward_residual(as_f64(dys.cpu), sum64, f64_or_none(w), exact.mean,
                                        exact.rstd, as_f64(dress.cpu), true, with_x_bias);
  cuda_test::expect_close(host_values(gg.dx), host_values(exact_grads.dx), 2 * tol, "dx");
  cuda_test::expect_close(host_values(gg.dweight), host_values(exact_grads.dweight), 4 * tol,
                          "dweight");
  cuda_test::expect_close(host_values(gg.dbias), host_values(exact_grads.dbias), 4 * tol, "dbias");
  ASSERT_EQ(gg.dx_bias.defined(), with_x_bias);
  if (with_x_bias) {
    // The column sums of dx as the kernel stored it (rounded to dt), summed in float64.
    std::vector<int64_t> rows_dims(static_cast<size_t>(gg.dx.dim() - 1));
    for (size_t i = 0; i < rows_dims.size(); ++i) rows_dims[i] = static_cast<int64_t>(i);
    const Tensor dx_sums = ops::sum(as_f64(gg.dx), rows_dims);
    cuda_test::expect_close(host_values(gg.dx_bias), host_values(dx_sums), 2 * tol, "dx_bias");
  }
  // Fixed-order sums: a second run gives the same bits.
  const ops::LayerNormGrads again = backward();
  EXPECT_EQ(host_values(again.dweight), host_values(gg.dweight));
  EXPECT_EQ(host_values(again.dbias), host_values(gg.dbias));
  EXPECT_EQ(host_values(again.dx), host_values(gg.dx));
  if (with_x_bias) EXPECT_EQ(host_values(again.dx_bias), host_values(gg.dx_bias));
}

TEST(CudaLayerNormFusion, TheFusedKernelsAreRegistered) {
  const FusedKernelTable& t = fused_kernel_table(DeviceType::CUDA);
  EXPECT_NE(t.residual_layer_norm, nullptr);
  EXPECT_NE(t.layer_norm_backward_residual, nullptr);
}

TEST(CudaLayerNormFusion, ResidualLayerNormMatchesFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    // 8..2048: registers in both directions (768: GPT-2 124M, 1280: 774M); 37, 4099: the
    // general kernels.
    for (int64_t C : {8, 37, 768, 1280, 2048, 4099}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " C=" + std::to_string(C));
      check_against_float64(dt, 5, 7, C, /*with_weight=*/true, /*with_bias=*/true);
    }
  }
}

TEST(CudaLayerNormFusion, DeferredProjectionBiasMatchesFloat64) {
  TESSERA_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    // Each backward kernel width (1, 2, 3, 4, 5, 8 packs per lane), and the general kernels
    // (37, 2056).
    for (int64_t C : {64, 37, 512, 768, 1024, 1280, 2048, 2056}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " C=" + std::to_string(C));
      check_against_float64(dt, 5, 7, C, /*with_weight=*/true, /*with_bias=*/true,
                            /*with_x_bias=*/true);
    }
  }
  // More rows than the persistent grid holds warps, no weight.
  check_against_float64(DType::bf16, 20011, 1, 768, false, false, true);
}

TEST(CudaLayerNormFusion, WithoutWeightOrBiasAndOddRowCounts) {
  TESSERA_REQUIRE_GPU();
  // One row, 3 rows, and more rows than the persistent grid holds warps.
  for (int64_t rows : {1, 3, 20011}) {
    SCOPED_TRACE(rows);
    check_against_float64(DType::bf16, rows, 1, 64, /*with_weight=*/false, /*with_bias=*/false);
    check_against_float64(DType::f16, rows, 1, 64, /*with_weight=*/true, /*with_bias=*/false);
  }
}

TEST(CudaLayerNormFusion, DifferentiableFormMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  // Both outputs used: the gradients of x, residual, weight and bias against the CPU in f32.
  const Tensor x = cuda_test::host_randn({6, 5, 768}), r = cuda_test::host_randn({6, 5, 768});
  const Tensor w = cuda_test::host_randn({768}, DType::f32, 1.0, 0.2);
  const Tensor b = cuda_test::host_randn({768}, DType::f32, 0.0, 0.2);
  const Tensor g_sum = cuda_test::host_randn({6, 5, 768}),
               g_out = cuda_test::host_randn({6, 5, 768});
  auto run = [&](Device d) {
    std::vector<Tensor> leaves;
    for (const Tensor& t : {x, r, w, b}) {
      Tensor l = raw::to(t, d, t.dtype());
      l.requires_grad_(true);
      leaves.push_back(l);
    }
    const auto [s, n] = residual_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3], 1e-5);
    (sum(s * raw::to(g_sum, d, DType::f32)) + sum(n * raw::to(g_out, d, DType::f32))).backward();
    std::vector<Tensor> out{s, n};
    for (const Tensor& l : leaves) out.push_back(l.grad());
    return out;
  };
  const std::vector<Tensor> cpu = run(Device::cpu()), gpu = run(dev());
  const char* names[] = {"sum", "out", "dx", "dresidual", "dweight", "dbias"};
  for (size_t i = 0; i < cpu.size(); ++i)
    cuda_test::expect_close(host_values(gpu[i]), host_values(cpu[i]), 1e-4, names[i]);
}

TEST(CudaLayerNormFusion, MismatchedOperandsAreNamed) {
  TESSERA_REQUIRE_GPU();
  const Tensor x = to_gpu(cuda_test::host_randn({4, 16}, DType::bf16));
  const Tensor r = to_gpu(cuda_test::host_randn({4, 16}, DType::f16));
  const Tensor out = empty({4, 16}, {.dtype = DType::bf16, .device = dev()});
  const Tensor stat = empty({4}, {.dtype = DType::f32, .device = dev()});
  try {
    cuda::fused_residual_layer_norm(x, r, Tensor(), Tensor(), Tensor(), 1e-5, out, out, stat, stat);
    ADD_FAILURE() << "a bf16 input with an f16 residual was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float16"), std::string::npos) << e.what();
  }
  try {
    ops::residual_layer_norm(x, to_gpu(cuda_test::host_randn({4, 15}, DType::bf16)), Tensor(),
                             Tensor(), 1e-5);
    ADD_FAILURE() << "a residual of another shape was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 15]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
