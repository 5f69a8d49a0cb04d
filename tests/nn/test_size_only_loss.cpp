// The language-model loss in a size-only dry run (core/size_only.h) that takes the GPU's
// routes, as `tessera plan --device cuda` runs it: it must allocate what a GPU run does — the
// fused classifier, which writes the logits' gradient into the logits' own memory — and not
// what the CPU's composed cross entropy does (a gradient buffer as large as the logits).
#include <gtest/gtest.h>

#include "tessera/autograd/functions.h"
#include "tessera/core/memory_category.h"
#include "tessera/core/size_only.h"
#include "tessera/nn/nn.h"

using namespace tessera;

TEST(SizeOnlyLoss, GpuRouteAllocatesNoSecondLogitsSizedBuffer) {
  const int64_t B = 3, T = 17, C = 8, V = 50257, N = B * T;  // odd sizes, GPT-2's vocabulary
  SizeOnlyMode size_only(/*fused_routes=*/true);
  // The head of a GPT: hidden states [B, T, C] times the embedding matrix [V, C], in bf16.
  Tensor hidden = empty({B, T, C}, {.dtype = DType::bf16});
  Tensor wte = empty({V, C}, {.dtype = DType::bf16});
  hidden.requires_grad_(true);
  wte.requires_grad_(true);
  const Tensor targets = zeros({B, T}, {.dtype = DType::i64});
  const int64_t before = category_memory_stats(DeviceType::CPU).total_in_use();
  reset_category_peak(DeviceType::CPU);
  nn::language_model_loss(matmul(hidden, wte.t()), targets).backward();
  const CategoryMemoryStats stats = category_memory_stats(DeviceType::CPU);
  // The logits [N, V], the per-row losses (f32), the two gradients (of hidden and wte; the
  // latter computed for wte.t() and transposed once: twice its size at most), and O(N) bytes
  // of row mask and counts. The logits' gradient is written over the logits by
  // the fused kernel and, the incoming gradient being 1, handed on as it is.
  const int64_t logits_bytes = N * V * 2;
  const int64_t expected = logits_bytes + N * 4 + N * C * 2 + V * C * 2;
  const int64_t added = stats.peak - before;
  // At least the logits and the two gradients (the per-row losses may be freed before the
  // gradients reach their peak).
  EXPECT_GE(added, logits_bytes + N * C * 2 + V * C * 2);
  EXPECT_LE(added, expected + V * C * 2 + N * 8 + 1024)
      << "peak " << stats.peak << " bytes: another buffer (a logits-sized one is " << logits_bytes
      << " bytes) was allocated";
  EXPECT_EQ(hidden.grad().numel(), N * C);
  EXPECT_EQ(wte.grad().numel(), V * C);
}

// Without the GPU's routes the composed cross entropy runs (the CPU's own path), which does
// keep a separate gradient of the logits' size: the route is the device's, not the mode's.
TEST(SizeOnlyLoss, CpuRouteKeepsTheComposedCrossEntropy) {
  const int64_t B = 3, T = 17, V = 50257, N = B * T;
  SizeOnlyMode size_only(/*fused_routes=*/false);
  Tensor logits = empty({B, T, V}, {.dtype = DType::f32});
  logits.requires_grad_(true);
  const Tensor targets = zeros({B, T}, {.dtype = DType::i64});
  nn::language_model_loss(logits, targets).backward();
  ASSERT_TRUE(logits.grad().defined());
  EXPECT_NE(logits.grad().storage(), logits.storage());
  EXPECT_EQ(logits.grad().numel(), N * V);
}
