// GPT's residual stream with every residual add fused into the layer norm after it (the next
// block's ln_1, the block's own ln_2, ln_f at the end): the same numbers as the blocks written
// out from their layers with every add separate (x + attn(ln_1(x)), + mlp(ln_2(.))), with and
// without dropout; Block::forward equal to its deferred form; the KV-cache path equal to the
// full forward; and the blocks' hooks still firing once per pass in order (ZeRO-3 gathers and
// releases parameters from them). These are the fast blocks' (nn/gpt_fast.h), GPT's default;
// blockwise_logits is the reference path written out.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

namespace {

nn::GPTConfig odd_config(double dropout, bool bias = true) {
  return {.vocab_size = 23,
          .block_size = 16,
          .n_layer = 3,
          .n_head = 3,
          .n_embd = 15,
          .bias = bias,
          .dropout = dropout};
}

std::unique_ptr<nn::GPT> make_model(const nn::GPTConfig& cfg, uint64_t seed) {
  Generator init(seed);
  auto model = std::make_unique<nn::GPT>(cfg, &init, TensorOptions{.dtype = DType::f64});
  // Layer norm parameters away from their 1/0 initial values, so a misplaced norm shows.
  Generator g(seed + 1);
  for (auto& [name, p] : model->named_parameters())
    if (name.find("ln_") != std::string::npos) {
      NoGradGuard no_grad;
      ops::copy_(p, normal(p.shape(), 0.5, 0.3, {.dtype = DType::f64}, &g));
    }
  return model;
}

Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator g(seed);
  return randint(0, vocab, {B, T}, {.dtype = DType::i64}, &g);
}

std::vector<double> values(const Tensor& t) {
  return ops::contiguous(ops::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

// The logits with every add separate, the blocks written out from their layers:
// x + attn(ln_1(x)), then + mlp(ln_2(.)), and ln_f of the last output.
Tensor blockwise_logits(nn::GPT& model, const Tensor& idx) {
  const int64_t T = idx.size(1);
  const Tensor pos = arange(0.0, static_cast<double>(T), 1.0, {.dtype = DType::i64});
  nn::GPTTransformer& t = model.transformer;
  Tensor x = t.drop(t.wte(idx) + t.wpe(pos));
  for (nn::Block* block : t.blocks) {
    x = x + block->attn(block->ln_1(x));
    x = x + block->mlp(block->ln_2(x));
  }
  return matmul(t.ln_f(x), model.output_weight().t());
}

TEST(GPTResidualFusion, SameLogitsAsSeparateAddsAndNorms) {
  for (double dropout : {0.0, 0.2}) {
    for (bool bias : {true, false}) {
      SCOPED_TRACE("dropout " + std::to_string(dropout) + (bias ? " with" : " without") + " bias");
      auto model = make_model(odd_config(dropout, bias), 5);
      const Tensor idx = random_tokens(2, 11, 23, 6);
      // On the CPU the fused op is the add and the norm: the same operations in the same order,
      // and with the generator reset the same dropout masks, so the same bits.
      manual_seed(41);
      const std::vector<double> fused = values(model->forward(idx));
      manual_seed(41);
      const std::vector<double> plain = values(blockwise_logits(*model, idx));
      EXPECT_EQ(fused, plain);
    }
  }
}

TEST(GPTResidualFusion, DeferredBlockOutputSumsToForward) {
  auto model = make_model(odd_config(0.0), 8);
  nn::GPTFastBlock& block = model->fast_blocks[1];
  Generator g(9);
  const Tensor residual = normal({2, 5, 15}, 0, 1, {.dtype = DType::f64}, &g);
  const Tensor delta = normal({2, 5, 15}, 0, 1, {.dtype = DType::f64}, &g);
  const nn::BlockOutput out = block.forward_deferred(residual, delta);
  EXPECT_FALSE(out.delta_bias.defined());
  EXPECT_EQ(values(out.residual + out.delta), values(block.forward(residual + delta)));
}

TEST(GPTResidualFusion, DeferredOutputBiasesGiveTheSameLossAndGradients) {
  // Without hooks or active dropout the output projections' biases are added inside the norms
  // after them; a hook anywhere turns that off. Both give the same loss and gradients.
  auto model = make_model(odd_config(0.0), 21);
  const Tensor idx = random_tokens(2, 11, 23, 22), targets = random_tokens(2, 11, 23, 23);
  auto run = [&] {
    model->zero_grad();
    const Tensor loss = model->loss(idx, targets);
    loss.backward();
    std::vector<std::vector<double>> out{values(loss)};
    for (const auto& [name, p] : model->named_parameters()) out.push_back(values(p.grad()));
    return out;
  };
  ASSERT_TRUE(nn::output_biases_deferrable(*model));
  const auto deferred = run();
  const uint64_t hook = model->transformer.blocks[1]->mlp.c_proj.register_forward_hook(
      [](nn::Module&, const Tensor&, const Tensor&) {});
  ASSERT_FALSE(nn::output_biases_deferrable(*model));
  const auto plain = run();
  model->transformer.blocks[1]->mlp.c_proj.remove_hook(hook);
  ASSERT_EQ(deferred.size(), plain.size());
  EXPECT_NEAR(deferred[0][0], plain[0][0], 1e-13);
  for (size_t i = 1; i < deferred.size(); ++i)
    for (size_t j = 0; j < deferred[i].size(); ++j)
      ASSERT_NEAR(deferred[i][j], plain[i][j], 1e-12 * (1 + std::abs(plain[i][j])))
          << "parameter " << i - 1 << " element " << j;
  // Active dropout after a projection, a model without biases, checkpointing: not deferred.
  EXPECT_FALSE(nn::output_biases_deferrable(*make_model(odd_config(0.2), 24)));
  auto evaluated = make_model(odd_config(0.2), 24);
  evaluated->eval();
  EXPECT_TRUE(nn::output_biases_deferrable(*evaluated));
  EXPECT_FALSE(nn::output_biases_deferrable(*make_model(odd_config(0.0, /*bias=*/false), 25)));
  auto checkpointed = make_model(odd_config(0.0), 26);
  checkpointed->gradient_checkpointing_enable();
  EXPECT_FALSE(nn::output_biases_deferrable(*checkpointed));
}

TEST(GPTResidualFusion, KVCacheForwardMatchesTheFullForward) {
  auto model = make_model(odd_config(0.0), 12);
  model->eval();
  const Tensor idx = random_tokens(2, 9, 23, 13);
  const Tensor full = model->forward(idx);
  nn::KVCache cache = model->make_kv_cache(2);
  const Tensor first = model->forward_incremental(idx.narrow(1, 0, 6), cache);
  const Tensor rest = model->forward_incremental(idx.narrow(1, 6, 3), cache);
  const Tensor incremental = cat({first, rest}, 1);
  EXPECT_LT(ops::max_rel_error(incremental, full), 1e-13);
}

TEST(GPTResidualFusion, BlockHooksFireOncePerPassInOrder) {
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointed" : "plain");
    auto model = make_model(odd_config(0.0), 14);
    if (checkpointing) model->gradient_checkpointing_enable();
    std::vector<std::string> events;
    const auto& blocks = model->transformer.blocks;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const std::string id = std::to_string(i);
      blocks[i]->register_forward_pre_hook(
          [&events, id](nn::Module&, const Tensor&) { events.push_back("pre " + id); });
      blocks[i]->register_forward_hook([&events, id](nn::Module&, const Tensor&, const Tensor&) {
        events.push_back("post " + id);
      });
      nn::Block* block = blocks[i];
      blocks[i]->register_backward_pre_hook([&events, id, block](nn::Module&) {
        // Before any of the block's own ops ran backward: none of its gradients exist yet.
        const bool none_yet = !block->ln_1.weight.grad().defined() &&
                              !block->mlp.c_proj.weight.grad().defined() &&
                              !block->ln_2.weight.grad().defined();
        events.push_back("backward " + id + (none_yet ? "" : " (late)"));
      });
    }
    const Tensor idx = random_tokens(2, 7, 23, 15);
    model->loss(idx, random_tokens(2, 7, 23, 16)).backward();
    // The checkpointed model runs each block's forward again right before its backward.
    const std::vector<std::string> want =
        checkpointing
            ? std::vector<std::string>{"pre 0",  "post 0",     "pre 1",  "post 1",     "pre 2",
                                       "post 2", "pre 2",      "post 2", "backward 2", "pre 1",
                                       "post 1", "backward 1", "pre 0",  "post 0",     "backward 0"}
            : std::vector<std::string>{"pre 0",  "post 0",     "pre 1",      "post 1",    "pre 2",
                                       "post 2", "backward 2", "backward 1", "backward 0"};
    EXPECT_EQ(events, want);
    for (nn::Block* block : blocks) EXPECT_TRUE(block->ln_1.weight.grad().defined());
  }
}

}  // namespace
