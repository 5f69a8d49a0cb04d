// GPT's fast MLP through mlp_gelu (GPTFastBlock::use_fused_mlp: on by default, TESSERA_FUSED_MLP=0
// turns it off) against the composed c_fc -> GELU -> c_proj: the same logits and gradients (bit for
// bit on the CPU, where mlp_gelu is that composition; to rounding through the fused tape
// node, with CPU stand-ins for the GPU's fused GEMMs), with gradient checkpointing too; hooks
// on c_fc/act/c_proj keep the composed path (they must see their module's call), hooks on
// the MLP and its block still fire.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "../autograd/cpu_mlp_entries.h"
#include "tessera/autograd/functions.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

namespace {

nn::GPTConfig odd_config(bool bias) {
  return {.vocab_size = 29,
          .block_size = 16,
          .n_layer = 2,
          .n_head = 3,
          .n_embd = 15,
          .bias = bias,
          .dropout = 0.0};
}

std::unique_ptr<nn::GPT> make_model(const nn::GPTConfig& cfg, bool fused_mlp) {
  Generator init(7);
  auto model = std::make_unique<nn::GPT>(cfg, &init, TensorOptions{.dtype = DType::f64});
  // Biases away from their zero init, so a dropped bias or bias gradient shows.
  Generator g(8);
  for (auto& [name, p] : model->named_parameters())
    if (name.find(".bias") != std::string::npos) {
      NoGradGuard no_grad;
      ops::copy_(p, normal(p.shape(), 0.0, 0.3, {.dtype = DType::f64}, &g));
    }
  for (nn::GPTFastBlock& block : model->fast_blocks) block.use_fused_mlp = fused_mlp;
  return model;
}

struct Pass {
  std::vector<double> logits, loss;
  std::vector<std::pair<std::string, std::vector<double>>> grads;
};

Pass train_pass(nn::GPT& model) {
  Generator data(9);
  const Tensor idx = randint(0, 29, {3, 13}, {.dtype = DType::i64}, &data);
  const Tensor targets = randint(0, 29, {3, 13}, {.dtype = DType::i64}, &data);
  Pass p;
  p.logits = ops::contiguous(model.forward(idx)).to_vector<double>();
  model.zero_grad();
  const Tensor loss = model.loss(idx, targets);
  p.loss = {loss.item()};
  loss.backward();
  for (auto& [name, t] : model.named_parameters())
    p.grads.emplace_back(name, ops::contiguous(t.grad()).to_vector<double>());
  return p;
}

void expect_close(const Pass& a, const Pass& b, double rtol) {
  auto check = [rtol](const std::vector<double>& x, const std::vector<double>& y,
                      const std::string& what) {
    ASSERT_EQ(x.size(), y.size()) << what;
    double err = 0, scale = 1e-30;
    for (size_t i = 0; i < x.size(); ++i) {
      err = std::max(err, std::abs(x[i] - y[i]));
      scale = std::max(scale, std::abs(y[i]));
    }
    EXPECT_LE(err / scale, rtol) << what;
  };
  check(a.logits, b.logits, "logits");
  check(a.loss, b.loss, "loss");
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    check(a.grads[i].second, b.grads[i].second, a.grads[i].first);
}

TEST(GPTMlpFusion, SameLogitsAndGradientsAsTheComposedMlp) {
  for (bool bias : {true, false}) {
    for (bool checkpointing : {false, true}) {
      SCOPED_TRACE(std::string(bias ? "with" : "without") + " bias" +
                   (checkpointing ? ", gradient checkpointing" : ""));
      auto fused = make_model(odd_config(bias), true), plain = make_model(odd_config(bias), false);
      fused->gradient_checkpointing_enable(checkpointing);
      plain->gradient_checkpointing_enable(checkpointing);
      const Pass pf = train_pass(*fused), pp = train_pass(*plain);
      // One forward for the logits and one for the loss (and one more per block recomputed).
      EXPECT_EQ(fused->fast_blocks[0].fused_mlp_calls(), checkpointing ? 3 : 2);
      EXPECT_EQ(plain->fast_blocks[0].fused_mlp_calls(), 0);
      // On the CPU mlp_gelu is the composition: the same operations, the same bits.
      expect_close(pf, pp, 0.0);
      // Through the fused tape node (CPU stand-ins for the GPU's GEMMs): equal to rounding.
      tessera::testing::CpuMlpEntries entries;
      const Pass pe = train_pass(*fused);
      EXPECT_GT(tessera::testing::CpuMlpEntries::forward_calls, 0);
      expect_close(pe, pp, 1e-12);
    }
  }
}

TEST(GPTMlpFusion, HooksOnTheInnerModulesKeepTheComposedPath) {
  auto model = make_model(odd_config(true), true);
  auto reference = make_model(odd_config(true), false);
  nn::MLP& mlp = model->transformer.blocks[0]->mlp;
  int c_fc_calls = 0, mlp_calls = 0, block_calls = 0;
  mlp.c_fc.register_forward_hook([&](nn::Module&, const Tensor&, const Tensor&) { ++c_fc_calls; });
  mlp.register_forward_hook([&](nn::Module&, const Tensor&, const Tensor&) { ++mlp_calls; });
  model->transformer.blocks[1]->register_forward_pre_hook(
      [&](nn::Module&, const Tensor&) { ++block_calls; });
  const Pass p = train_pass(*model);
  EXPECT_EQ(c_fc_calls, 2);  // the logits' forward and the loss's
  EXPECT_EQ(mlp_calls, 2);
  EXPECT_EQ(block_calls, 2);
  EXPECT_EQ(model->fast_blocks[0].fused_mlp_calls(), 0);  // hooked c_fc: composed
  EXPECT_EQ(model->fast_blocks[1].fused_mlp_calls(), 2);  // hooks only around it
  expect_close(p, train_pass(*reference), 0.0);
}

}  // namespace
