// The fused-op table's answers on the CPU (which has no fused entries of its own) and under a
// size-only dry run, which silences the CPU row through the hook the table registers with core
// (register_size_only_table) and puts it back afterwards.
#include <gtest/gtest.h>

#include "tessera/core/size_only.h"
#include "tessera/core/tensor.h"
#include "tessera/kernels/fused_table.h"

namespace tessera::test {
namespace {

Tensor heads(DType dtype, int64_t D = 64) { return zeros({1, 2, 8, D}, {.dtype = dtype}); }

TEST(FusedTable, TheCpuRowHasNoAttentionSwigluOrMlpEntries) {
  const Tensor q = heads(DType::bf16);
  EXPECT_FALSE(attention_takes(q, q, q, /*causal=*/true));
  EXPECT_FALSE(attention_takes(q, q, q, /*causal=*/false));
  EXPECT_FALSE(masked_attention_kernels(q, q, q, 0.0).has_value());
  const Tensor g = zeros({4, 8});
  EXPECT_FALSE(swiglu_takes(g, g));
  const Tensor x = zeros({4, 8}), w_fc = zeros({8, 16}), w_proj = zeros({16, 8});
  EXPECT_FALSE(linear_gelu_takes(x, w_fc, Tensor(), w_proj, Tensor()));
  EXPECT_FALSE(attention_qkv_takes(zeros({1, 8, 3 * 128}, {.dtype = DType::bf16}), 2));
}

TEST(FusedTable, SizeOnlyModeOffersTheGpuRoutesAndRestoresTheCpuRow) {
  const FusedKernelTable before = fused_kernel_table(DeviceType::CPU);
  const Tensor q = heads(DType::bf16), q32 = heads(DType::f32), q_d32 = heads(DType::bf16, 32);
  const Tensor x = zeros({4, 8}), w_fc = zeros({8, 16}), w_proj = zeros({16, 8});
  {
    SizeOnlyMode mode(/*fused_routes=*/true);
    const FusedKernelTable& t = fused_kernel_table(DeviceType::CPU);
    EXPECT_NE(t.flash_attention_forward, nullptr);
    EXPECT_NE(t.classifier, nullptr);
    EXPECT_NE(t.multi_tensor_adamw, nullptr);
    // The answers follow the row: causal bf16 heads of D 64 take the flash route; f32, a head
    // size the kernels lack and dropout (no dropout entries offered) do not.
    EXPECT_TRUE(attention_takes(q, q, q, /*causal=*/true));
    EXPECT_FALSE(attention_takes(q32, q32, q32, /*causal=*/true));
    EXPECT_FALSE(attention_takes(q_d32, q_d32, q_d32, /*causal=*/true));
    EXPECT_FALSE(attention_takes(q, q, q, /*causal=*/true, 0.1));
    EXPECT_TRUE(linear_gelu_takes(x, w_fc, Tensor(), w_proj, Tensor()));
    EXPECT_FALSE(
        linear_gelu_takes(x, zeros({8, 16}, {.dtype = DType::f64}), Tensor(), w_proj, Tensor()));
  }
  {
    // Without the GPU's routes only the in-place updates become no-ops: the routes stay.
    SizeOnlyMode mode(/*fused_routes=*/false);
    const FusedKernelTable& t = fused_kernel_table(DeviceType::CPU);
    EXPECT_EQ(t.flash_attention_forward, nullptr);
    EXPECT_NE(t.multi_tensor_adamw, nullptr);
    EXPECT_FALSE(attention_takes(q, q, q, /*causal=*/true));
  }
  const FusedKernelTable& after = fused_kernel_table(DeviceType::CPU);
  EXPECT_EQ(after.flash_attention_forward, before.flash_attention_forward);
  EXPECT_EQ(after.multi_tensor_adamw, before.multi_tensor_adamw);
  EXPECT_EQ(after.classifier, before.classifier);
  EXPECT_EQ(after.linear_gelu_forward, before.linear_gelu_forward);
  EXPECT_FALSE(attention_takes(q, q, q, /*causal=*/true));
}

TEST(FusedTable, AttentionRoutesHaveNames) {
  EXPECT_STREQ(attention_route_name(AttentionRoute::Composed), "composed");
  EXPECT_STREQ(attention_route_name(AttentionRoute::Fused), "fused");
  EXPECT_STREQ(attention_route_name(AttentionRoute::FusedProjection), "fused_projection");
}

}  // namespace
}  // namespace tessera::test
