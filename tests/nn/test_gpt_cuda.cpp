// GPT training on a CUDA device against the same steps on the CPU (skips without a GPU).
#include <gtest/gtest.h>

#include "tessera/autograd/functions.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

TEST(GPTCuda, TrainingStepsMatchTheCPU) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const nn::GPTConfig cfg{.vocab_size = 101, .block_size = 40, .n_layer = 3, .n_head = 3, .n_embd = 48};
  Generator g1(5), g2(5);
  nn::GPT cpu(cfg, &g1), gpu(cfg, &g2);
  gpu.to(Device::cuda());
  EXPECT_TRUE(gpu.parameter("transformer.wte.weight").device().is_cuda());
  Generator data(6);
  Tensor idx = randint(0, 101, {4, 40}, {.dtype = DType::i64}, &data);
  Tensor targets = randint(0, 101, {4, 40}, {.dtype = DType::i64}, &data);
  Tensor idx_gpu = idx.to(Device::cuda()), targets_gpu = targets.to(Device::cuda());
  optim::AdamW opt_cpu(cpu.parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  optim::AdamW opt_gpu(gpu.parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  EXPECT_LT(ops::max_rel_error(gpu.forward(idx_gpu).cpu(), cpu.forward(idx)), 1e-4) << "logits";
  for (int step = 0; step < 5; ++step) {
    for (auto* pair : {&opt_cpu, &opt_gpu}) pair->zero_grad();
    Tensor lc = cpu.loss(idx, targets), lg = gpu.loss(idx_gpu, targets_gpu);
    EXPECT_NEAR(lg.item(), lc.item(), 1e-4 * std::abs(lc.item())) << "step " << step;
    lc.backward();
    lg.backward();
    const double nc = optim::clip_grad_norm_(cpu.parameters(), 1.0);
    const double ng = optim::clip_grad_norm_(gpu.parameters(), 1.0);
    EXPECT_NEAR(ng, nc, 1e-3 * nc) << "step " << step;
    opt_cpu.step();
    opt_gpu.step();
  }
  for (auto& [name, p] : cpu.named_parameters())
    EXPECT_LT(ops::max_rel_error(gpu.parameter(name).cpu(), p), 1e-3) << name;
  // The KV cache works on the device too.
  Tensor full = gpu.forward(idx_gpu);
  nn::KVCache cache = gpu.make_kv_cache(4);
  Tensor a = gpu.forward_incremental(idx_gpu.narrow(1, 0, 30), cache);
  Tensor b = gpu.forward_incremental(idx_gpu.narrow(1, 30, 10), cache);
  EXPECT_LT(ops::max_rel_error(ops::cat({a, b}, 1).cpu(), full.cpu()), 1e-4);
}

TEST(GPTCuda, FlashAttentionPathMatchesMaterialisedScores) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  // Head size 64 in bf16: the fused kernels apply.
  const nn::GPTConfig cfg{.vocab_size = 101, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 128};
  Generator g1(9), g2(9);
  nn::GPT fused(cfg, &g1), plain(cfg, &g2);
  for (nn::GPT* m : {&fused, &plain}) m->to(Device::cuda(), DType::bf16);
  for (nn::GPTFastBlock& block : plain.fast_blocks) block.use_fused_attention = false;
  Generator data(10);
  Tensor idx = randint(0, 101, {3, 64}, {.dtype = DType::i64}, &data).to(Device::cuda());
  Tensor targets = randint(0, 101, {3, 64}, {.dtype = DType::i64}, &data).to(Device::cuda());
  Tensor lf = fused.loss(idx, targets), lp = plain.loss(idx, targets);
  EXPECT_NEAR(lf.item(), lp.item(), 2e-2 * std::abs(lp.item()));
  EXPECT_EQ(fused.fast_blocks[0].fused_attention_calls(), 1);
  EXPECT_EQ(plain.fast_blocks[0].fused_attention_calls(), 0);
  lf.backward();
  lp.backward();
  for (auto& [name, p] : plain.named_parameters()) {
    const Tensor gf = fused.parameter(name).grad(), gp = p.grad();
    ASSERT_TRUE(gf.defined() && gp.defined()) << name;
    EXPECT_LT(ops::max_rel_error(gf.to(DType::f32).cpu(), gp.to(DType::f32).cpu()), 5e-2) << name;
  }
}
