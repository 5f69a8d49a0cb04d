// A masked scaled_dot_product_attention on a GPU, in bf16 with D = 64, causal and Tq == Tk:
// the shape the flash kernels take unmasked. With a mask it must take the composed path: the
// result and the gradients match the CPU's masked composition of the same inputs, a row with
// no key left is exactly 0 (the unmasked kernels cannot give that), and masked keys get no
// gradient.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::host_randn;
using cuda_test::host_values;

TEST(CudaMaskedAttention, TakesTheComposedPathWhereFlashWouldApply) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 2, H = 2, T = 33, D = 64;
  std::vector<Tensor> host, device;
  for (int i = 0; i < 4; ++i) host.push_back(host_randn({B, H, T, D}, DType::bf16));
  ASSERT_TRUE(flash_attention_applies(raw::to(host[0], dev(), DType::bf16),
                                      raw::to(host[1], dev(), DType::bf16),
                                      raw::to(host[2], dev(), DType::bf16), true));
  // Row 1 is left-padded by 5: its first 5 queries see only padding under causal.
  std::vector<uint8_t> keep(B * T, 1);
  for (int64_t j = 0; j < 5; ++j) keep[T + j] = 0;
  const Tensor mask_host = ops::binary(
      BinaryOp::Ne, from_vector(keep, {B, 1, 1, T}, {.dtype = DType::u8}), 0.0);
  auto run = [&](Device where, DType dtype) {
    std::vector<Tensor> qkv;
    for (int i = 0; i < 3; ++i) {
      qkv.push_back(raw::to(host[i], where, dtype));
      qkv.back().requires_grad_(true);
    }
    const Tensor mask = raw::to(mask_host, where, DType::boolean);
    Tensor out = scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], mask, /*causal=*/true);
    out.backward(raw::to(host[3], where, dtype));
    return std::vector<Tensor>{out, qkv[0].grad(), qkv[1].grad(), qkv[2].grad()};
  };
  const std::vector<Tensor> gpu = run(dev(), DType::bf16), cpu = run(Device::cpu(), DType::f32);
  for (size_t i = 0; i < gpu.size(); ++i) {
    const std::vector<double> g = host_values(gpu[i]), c = host_values(cpu[i]);
    double worst = 0, scale = 0;
    for (size_t e = 0; e < g.size(); ++e) {
      worst = std::max(worst, std::abs(g[e] - c[e]));
      scale = std::max(scale, std::abs(c[e]));
    }
    EXPECT_LT(worst, 3e-2 * scale) << "output/dq/dk/dv " << i;
  }
  // The 5 queries of row 1 with no key: exactly 0, as on the CPU.
  const std::vector<double> out = host_values(raw::narrow(raw::select(gpu[0], 0, 1), 1, 0, 5));
  for (double x : out) EXPECT_EQ(x, 0.0);
  // Masked keys (row 1's first 5) get no gradient.
  for (int which : {2, 3})
    for (double x : host_values(raw::narrow(raw::select(gpu[which], 0, 1), 1, 0, 5)))
      EXPECT_EQ(x, 0.0);
}

}  // namespace
}  // namespace tessera
