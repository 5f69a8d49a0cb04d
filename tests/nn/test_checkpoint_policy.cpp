// Activation checkpointing by policy (nn/checkpoint_policy.h): the names read and refused, the
// blocks each policy names, and for GPT-2 (dropout on, so a recompute must replay the draws)
// and Llama, on the reference and the fast blocks, every policy's loss and every parameter's
// gradient bit for bit those of the same model without checkpointing. Which sub-layers ran
// twice is counted through the modules' forward hooks, and what the graph holds after forward
// through the host allocator, so a policy that changed nothing could not pass.
#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/core/memory_stats.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

using namespace tessera;
using nn::CheckpointPolicy;
using nn::CheckpointRegion;

namespace {

std::string refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(nothing was refused)";
}

TEST(CheckpointPolicy, ReadsEveryPolicyAndWritesItBack) {
  for (const char* name : {"none", "full", "every_k:1", "every_k:2", "every_k:17", "attention", "mlp"})
    EXPECT_EQ(CheckpointPolicy::parse(name).name(), name);
  EXPECT_FALSE(CheckpointPolicy::parse("none").enabled());
  EXPECT_TRUE(CheckpointPolicy::parse("mlp").enabled());
  EXPECT_EQ(CheckpointPolicy::parse("every_k:3").k(), 3);
  EXPECT_EQ(CheckpointPolicy::parse("every_k:03"), CheckpointPolicy::every_k(3));
  EXPECT_EQ(CheckpointPolicy(), CheckpointPolicy::parse("none"));
}

TEST(CheckpointPolicy, RefusesBadNamesQuotingThem) {
  for (const char* bad : {"", "Full", "all", "every_k", "every_k:", "every_k:0", "every_k:-1",
                          "every_k:+2", "every_k:2.5", "every_k:x", "every_k: 2", "every_k:2 ",
                          "every_k:1e2", "every_k:99999999999999999999", "attention,mlp"}) {
    const std::string message = refusal([&] { CheckpointPolicy::parse(bad); });
    EXPECT_NE(message.find("'" + std::string(bad) + "'"), std::string::npos) << bad << ": " << message;
  }
  EXPECT_NE(refusal([] { CheckpointPolicy::every_k(0); }).find("every_k:0"), std::string::npos);
}

TEST(CheckpointPolicy, ReadsHuggingFaceKwargs) {
  using Json = nlohmann::json;
  EXPECT_EQ(CheckpointPolicy::from_kwargs(Json::object()), CheckpointPolicy::full());
  EXPECT_EQ(CheckpointPolicy::from_kwargs({{"use_reentrant", false}}), CheckpointPolicy::full());
  EXPECT_EQ(CheckpointPolicy::from_kwargs({{"use_reentrant", true}, {"policy", "every_k:2"}}),
            CheckpointPolicy::every_k(2));
  EXPECT_EQ(CheckpointPolicy::from_kwargs({{"policy", "none"}}), CheckpointPolicy());
  EXPECT_NE(refusal([] { CheckpointPolicy::from_kwargs({{"policy", "every_k:0"}}); }).find("'every_k:0'"),
            std::string::npos);
  EXPECT_NE(refusal([] { CheckpointPolicy::from_kwargs({{"policy", 2}}); }).find("\"policy\""),
            std::string::npos);
  EXPECT_NE(refusal([] { CheckpointPolicy::from_kwargs({{"polcy", "mlp"}}); }).find("\"polcy\""),
            std::string::npos);
  EXPECT_NE(refusal([] { CheckpointPolicy::from_kwargs(Json("mlp")); }).find("dict"), std::string::npos);
}

TEST(CheckpointPolicy, NamesTheBlocksOfEachPolicy) {
  auto regions = [](const CheckpointPolicy& p) {
    std::vector<CheckpointRegion> out;
    for (int64_t i = 0; i < 5; ++i) out.push_back(p.region(i));
    return out;
  };
  using R = CheckpointRegion;
  EXPECT_EQ(regions(CheckpointPolicy()), std::vector<R>(5, R::none));
  EXPECT_EQ(regions(CheckpointPolicy::full()), std::vector<R>(5, R::block));
  EXPECT_EQ(regions(CheckpointPolicy::every_k(1)), std::vector<R>(5, R::block));
  EXPECT_EQ(regions(CheckpointPolicy::every_k(2)),
            (std::vector<R>{R::block, R::none, R::block, R::none, R::block}));
  EXPECT_EQ(regions(CheckpointPolicy::every_k(3)),
            (std::vector<R>{R::block, R::none, R::none, R::block, R::none}));
  EXPECT_EQ(regions(CheckpointPolicy::every_k(5)),
            (std::vector<R>{R::block, R::none, R::none, R::none, R::none}));
  EXPECT_EQ(regions(CheckpointPolicy::attention()), std::vector<R>(5, R::attention));
  EXPECT_EQ(regions(CheckpointPolicy::mlp()), std::vector<R>(5, R::mlp));
}

// ---- models ----

const std::vector<std::string> kPolicies = {"none", "full", "every_k:1", "every_k:2", "every_k:3",
                                            "attention", "mlp"};

// 5 blocks, 3 heads of 8 channels, an odd vocabulary and length; dropout at every site.
nn::GPTConfig gpt_config() {
  return {.vocab_size = 29, .block_size = 16, .n_layer = 5, .n_head = 3, .n_embd = 24, .dropout = 0.15};
}

nn::LlamaConfig llama_config() {
  nn::LlamaConfig c;
  c.vocab_size = 31;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  return c;
}

Tensor tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator g(seed);
  return randint(0, vocab, {B, T}, {.dtype = DType::i64}, &g);
}

struct Step {
  double loss = 0;
  uint64_t generator_offset = 0;
  std::vector<std::vector<float>> grads;  // named_parameters' order
  size_t held_after_forward = 0;          // host bytes the graph keeps for backward
};

// One training step from a fixed generator state: loss, backward, every parameter's gradient.
Step train_step(nn::CausalLM& model, const Tensor& idx, const Tensor& targets) {
  model.zero_grad();
  manual_seed(2024);
  const size_t before = host_memory_stats().in_use;
  Tensor loss = model.loss(idx, targets);
  Step out;
  out.held_after_forward = host_memory_stats().in_use - before;
  loss.backward();
  out.loss = loss.item();
  out.generator_offset = default_generator().offset();
  for (const auto& [name, p] : model.named_parameters()) {
    EXPECT_TRUE(p.grad().defined()) << name;
    out.grads.push_back(p.grad().defined() ? p.grad().to_vector<float>() : std::vector<float>{});
  }
  return out;
}

void expect_bitwise_equal(const Step& got, const Step& want, nn::CausalLM& model) {
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.generator_offset, want.generator_offset) << "a recompute must not draw new numbers";
  const auto params = model.named_parameters();
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_EQ(got.grads[i], want.grads[i]) << "gradient of " << params[i].first;
}

// Runs every policy on `model` (both block implementations) against its own run without
// checkpointing; `count` gives the sub-layer forward calls of one step as {attention, mlp}
// summed over blocks (empty when the model's sub-layers have no hooks to count with).
void check_every_policy(nn::CausalLM& model, const Tensor& idx, const Tensor& targets,
                        const std::function<std::pair<int64_t, int64_t>()>& count) {
  const int64_t n = model.num_blocks();
  for (auto impl : {nn::BlockImplementation::reference, nn::BlockImplementation::fast}) {
    model.set_block_implementation(impl);
    model.gradient_checkpointing_disable();
    const Step plain = train_step(model, idx, targets);
    std::map<std::string, size_t> held;
    for (const std::string& name : kPolicies) {
      SCOPED_TRACE(std::string(nn::block_implementation_name(impl)) + " blocks, policy " + name);
      const CheckpointPolicy policy = CheckpointPolicy::parse(name);
      model.gradient_checkpointing_enable(policy);
      ASSERT_EQ(model.gradient_checkpointing_policy(), policy);
      const auto calls_before = count ? count() : std::pair<int64_t, int64_t>{};
      const Step step = train_step(model, idx, targets);
      expect_bitwise_equal(step, plain, model);
      held[name] = step.held_after_forward;
      if (count) {
        const auto calls = count();
        int64_t twice = 0;  // blocks run again in backward
        for (int64_t i = 0; i < n; ++i) twice += policy.region(i) == CheckpointRegion::block;
        const bool attention = policy.kind() == CheckpointPolicy::Kind::attention;
        const bool mlp = policy.kind() == CheckpointPolicy::Kind::mlp;
        EXPECT_EQ(calls.first - calls_before.first, n + twice + (attention ? n : 0)) << "attention calls";
        EXPECT_EQ(calls.second - calls_before.second, n + twice + (mlp ? n : 0)) << "MLP calls";
      }
    }
    std::cout << nn::block_implementation_name(impl) << " blocks, bytes kept for backward after forward:";
    for (const auto& [name, bytes] : held) std::cout << " " << name << " " << bytes;
    std::cout << "\n";
    for (const char* name : {"full", "every_k:2", "every_k:3", "attention", "mlp"})
      EXPECT_LT(held[name], held["none"]) << name;
    EXPECT_EQ(held["every_k:1"], held["full"]);
    EXPECT_LT(held["full"], held["every_k:2"]);
    // More blocks recomputed, less kept (every_k:2 and every_k:3 name as many of 4 blocks).
    EXPECT_LE(held["every_k:2"], held["every_k:3"]);
  }
  model.set_block_implementation(nn::BlockImplementation::automatic);
}

TEST(CheckpointPolicy, GPTEveryPolicyGivesThePlainLossAndGradientsBitForBit) {
  Generator init(31);
  nn::GPT model(gpt_config(), &init);
  int64_t attention_calls = 0, mlp_calls = 0;
  for (nn::Block* block : model.transformer.blocks) {
    block->attn.register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++attention_calls; });
    block->mlp.register_forward_pre_hook([&](nn::Module&, const Tensor&) { ++mlp_calls; });
  }
  check_every_policy(model, tokens(3, 13, 29, 32), tokens(3, 13, 29, 33),
                     [&] { return std::pair{attention_calls, mlp_calls}; });
}

TEST(CheckpointPolicy, LlamaEveryPolicyGivesThePlainLossAndGradientsBitForBit) {
  Generator init(41);
  nn::Llama model(llama_config(), &init);
  check_every_policy(model, tokens(3, 11, 31, 42), tokens(3, 11, 31, 43), nullptr);
}

TEST(CheckpointPolicy, APolicyBeyondTheModelIsRefusedAndTheOldOneKept) {
  Generator init(51);
  nn::GPT gpt(gpt_config(), &init);
  gpt.gradient_checkpointing_enable(CheckpointPolicy::mlp());
  const std::string message = refusal([&] { gpt.gradient_checkpointing_enable(CheckpointPolicy::every_k(6)); });
  EXPECT_NE(message.find("'every_k:6'"), std::string::npos) << message;
  EXPECT_NE(message.find("5 blocks"), std::string::npos) << message;
  EXPECT_EQ(gpt.gradient_checkpointing_policy(), CheckpointPolicy::mlp());
  gpt.gradient_checkpointing_enable(CheckpointPolicy::every_k(5));  // block 0 alone
  nn::Llama llama(llama_config(), &init);
  EXPECT_NE(refusal([&] { llama.gradient_checkpointing_enable(CheckpointPolicy::every_k(5)); }).find("every_k:5"),
            std::string::npos);
  // Hugging Face's call with its kwargs, and the switch it was before policies.
  llama.gradient_checkpointing_enable(nlohmann::json{{"policy", "attention"}, {"use_reentrant", false}});
  EXPECT_EQ(llama.gradient_checkpointing_policy(), CheckpointPolicy::attention());
  llama.gradient_checkpointing_enable(true);
  EXPECT_EQ(llama.gradient_checkpointing_policy(), CheckpointPolicy::full());
  llama.gradient_checkpointing_enable(false);
  EXPECT_FALSE(llama.is_gradient_checkpointing());
}

// In eval, or without grad mode, no policy recomputes anything: the forward is the plain one.
TEST(CheckpointPolicy, EvaluationIsNeverCheckpointed) {
  Generator a(61), b(61);
  nn::GPT plain(gpt_config(), &a), checkpointed(gpt_config(), &b);
  checkpointed.gradient_checkpointing_enable(CheckpointPolicy::attention());
  plain.eval();
  checkpointed.eval();
  const Tensor idx = tokens(2, 9, 29, 62);
  EXPECT_EQ(checkpointed.forward(idx).to_vector<float>(), plain.forward(idx).to_vector<float>());
  EXPECT_EQ(checkpointed.checkpoint_region(0, checkpointed.transformer), CheckpointRegion::none);
  checkpointed.train();
  EXPECT_EQ(checkpointed.checkpoint_region(0, checkpointed.transformer), CheckpointRegion::attention);
  NoGradGuard no_grad;
  EXPECT_EQ(checkpointed.checkpoint_region(0, checkpointed.transformer), CheckpointRegion::none);
}

}  // namespace
