// The reference blocks (nn/gpt.cpp, nn/llama.cpp: x = x + attn(norm_1(x)); x = x + mlp(norm_2(x)))
// and the fast blocks (nn/gpt_fast.cpp, nn/llama_fast.cpp) on the same model, so on the same
// weights: the same logits, loss and parameter gradients in training (with and without
// gradient checkpointing), the same logits through a KV cache, the same greedy tokens, and one
// block on a non-contiguous input giving the same output and input gradient.
//
// Tolerances (max |a - b| / max |b|, ops::max_rel_error): the fast blocks compute the same
// formulas with the same roundings per element, only summed in other orders (a bias added
// inside the next norm instead of in its GEMM, q | k | v as one GEMM of stacked weights, the
// residual add inside the norm's kernel). In f64 that leaves ~1e-16 per op: bound 1e-12. In f32
// (2^-24 = 6e-8 per rounding), a reassociated sum of n terms moves by up to ~n ulps of its
// largest partial sum, and two layers, the head and the softmax backward chain a few such
// sums: bound 5e-6 (~80 ulps; Llama's stacked q | k | v GEMM measured 3.3e-7, GPT-2's fast
// blocks on the CPU give the reference's bits); a wrong formula (a missing bias, a misplaced
// norm, a wrong head split) errs by 1e-2 or more.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "tessera/autograd/functions.h"
#include "tessera/core/allocator.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"
#include "tessera/nn/llama_fast.h"

using namespace tessera;

namespace {

using Impl = nn::BlockImplementation;

double tolerance(DType dtype) { return dtype == DType::f64 ? 1e-12 : 5e-6; }

// Every parameter away from its initial value (norms at 1/0, biases at 0 would hide a
// misplaced norm or a dropped bias).
// `stddev` for the others: 0.3 on these small widths; wider models take less so that the
// attention's softmax does not saturate.
void perturb_parameters(nn::Module& model, uint64_t seed, double stddev = 0.3) {
  Generator g(seed);
  NoGradGuard no_grad;
  for (auto& [name, p] : model.named_parameters())
    ops::copy_(p, ops::to(normal(p.shape(),
                                 name.find("norm") != std::string::npos ||
                                         name.find("ln_") != std::string::npos
                                     ? 1.0
                                     : 0.0,
                                 stddev, {.dtype = DType::f64}, &g),
                          p.device(), p.dtype()));
}

nn::GPTConfig odd_gpt_config() {
  return {.vocab_size = 37,
          .block_size = 13,
          .n_layer = 2,
          .n_head = 3,
          .n_embd = 15,
          .tie_word_embeddings = false};
}

nn::LlamaConfig odd_llama_config() {
  return {.vocab_size = 41,
          .hidden_size = 12,
          .intermediate_size = 19,
          .num_hidden_layers = 2,
          .num_attention_heads = 3,
          .num_key_value_heads = 1,
          .max_position_embeddings = 13,
          .rms_norm_eps = 1e-5,
          .rope_theta = 300.0};
}

struct Pass {
  Tensor logits, loss;
  std::map<std::string, Tensor> grads;
};

Pass train_pass(nn::CausalLM& model, Impl impl, const Tensor& idx, const Tensor& targets) {
  model.set_block_implementation(impl);
  model.zero_grad();
  Pass p;
  p.logits = model.forward(idx).detach();
  const Tensor loss = model.loss(idx, targets);
  loss.backward();
  p.loss = loss.detach();
  for (const auto& [name, t] : model.named_parameters()) p.grads[name] = t.grad();
  return p;
}

void expect_same_pass(const Pass& fast, const Pass& reference, double tol) {
  EXPECT_LT(ops::max_rel_error(fast.logits, reference.logits), tol) << "logits";
  EXPECT_LT(ops::max_rel_error(fast.loss, reference.loss), tol) << "loss";
  ASSERT_EQ(fast.grads.size(), reference.grads.size());
  for (const auto& [name, g] : reference.grads) {
    ASSERT_TRUE(g.defined() && fast.grads.at(name).defined()) << name;
    EXPECT_LT(ops::max_rel_error(fast.grads.at(name), g), tol) << name;
  }
}

// Logits of a prompt of 5 tokens, then 1, then the rest, through a KV cache.
Tensor cached_logits(nn::CausalLM& model, Impl impl, const Tensor& idx) {
  model.set_block_implementation(impl);
  nn::KVCache cache = model.make_kv_cache(idx.size(0));
  const int64_t T = idx.size(1);
  return cat({model.forward_incremental(idx.narrow(1, 0, 5), cache),
              model.forward_incremental(idx.narrow(1, 5, 1), cache),
              model.forward_incremental(idx.narrow(1, 6, T - 6), cache)},
             1);
}

void expect_same_model_behaviour(nn::CausalLM& model, DType dtype, int64_t vocab, int64_t context) {
  Generator data(17);
  const Tensor idx = randint(0, vocab, {3, context}, {.dtype = DType::i64}, &data);
  const Tensor targets = randint(0, vocab, {3, context}, {.dtype = DType::i64}, &data);
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "gradient checkpointing" : "plain training");
    model.gradient_checkpointing_enable(checkpointing);
    const Pass reference = train_pass(model, Impl::reference, idx, targets);
    const Pass fast = train_pass(model, Impl::fast, idx, targets);
    expect_same_pass(fast, reference, tolerance(dtype));
  }
  model.gradient_checkpointing_enable(false);
  const Tensor want = cached_logits(model, Impl::reference, idx);
  EXPECT_LT(ops::max_rel_error(cached_logits(model, Impl::fast, idx), want), tolerance(dtype));
  EXPECT_LT(ops::max_rel_error(want, model.forward(idx)), tolerance(dtype)) << "cache vs full";
  model.set_block_implementation(Impl::reference);
  const Tensor prompt = idx.narrow(1, 0, 4);
  const Tensor greedy = model.generate(prompt, context, {.temperature = 0});  // past the context
  model.set_block_implementation(Impl::fast);
  if (dtype == DType::f64)  // f32 near-ties could flip an argmax
    EXPECT_EQ(greedy.to_vector<int64_t>(),
              model.generate(prompt, context, {.temperature = 0}).to_vector<int64_t>());
}

// x [2, 7, C] as the transpose of a [2, C, 7] tensor: not contiguous.
Tensor strided_input(int64_t C, DType dtype, uint64_t seed) {
  Generator g(seed);
  Tensor x = normal({2, C, 7}, 0, 1, {.dtype = dtype}, &g).transpose(1, 2);
  EXPECT_FALSE(x.is_contiguous());
  return x.detach().requires_grad_(true);
}

struct BlockResult {
  Tensor out, dx;
};

// On a GPU the fast blocks run the CUDA routes (the fused MLP, residual + norm kernels, the
// flash attention in bf16, the stacked q | k | v GEMM), the reference blocks the plain ops.
// Each is checked against the float64 CPU run of the same weights (the independent
// reference) and against the other. Head dimension 64 and a length of 40 (not a multiple of
// any tile) so the fused kernels take these shapes. Bounds: f32, 1e-4 (cuBLAS and the kernels
// sum in their own orders; TF32 is not used); bf16, 6e-2 (8 bits of mantissa, 4e-3 per
// rounding, chained through 2 layers, the head and the backward).
Pass to_f64_cpu(const Pass& p) {
  auto host = [](const Tensor& t) { return ops::to(t, Device::cpu(), DType::f64); };
  Pass out{host(p.logits), host(p.loss), {}};
  for (const auto& [name, g] : p.grads) out.grads[name] = host(g);
  return out;
}

template <class Model, class Config>
void expect_the_device_matches(const Config& cfg, int64_t vocab, int64_t context) {
  Generator init(21);
  Model want_model(cfg, &init, {.dtype = DType::f64});
  perturb_parameters(want_model, 22, 0.1);
  Generator data(23);
  const Tensor idx = randint(0, vocab, {3, context}, {.dtype = DType::i64}, &data);
  const Tensor targets = randint(0, vocab, {3, context}, {.dtype = DType::i64}, &data);
  const Pass want = train_pass(want_model, Impl::reference, idx, targets);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const double tol = dtype == DType::f32 ? 1e-4 : 6e-2;
    Model model(cfg, nullptr, {.dtype = DType::f64});
    {
      NoGradGuard no_grad;
      for (auto& [name, p] : model.named_parameters())
        ops::copy_(p, want_model.parameter(name).detach());
    }
    model.to(Device::cuda());
    model.to(dtype);
    const Tensor idx_gpu = idx.to(Device::cuda()), targets_gpu = targets.to(Device::cuda());
    const Pass reference = to_f64_cpu(train_pass(model, Impl::reference, idx_gpu, targets_gpu));
    const Pass fast = to_f64_cpu(train_pass(model, Impl::fast, idx_gpu, targets_gpu));
    {
      SCOPED_TRACE("fast blocks against float64");
      expect_same_pass(fast, want, tol);
    }
    {
      SCOPED_TRACE("reference blocks against float64");
      expect_same_pass(reference, want, tol);
    }
    {
      SCOPED_TRACE("fast against reference blocks, on the device");
      expect_same_pass(fast, reference, tol);
    }
  }
}

TEST(ReferenceAndFastBlocksCuda, GPTOnTheDeviceMatchesFloat64AndTheReference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const nn::GPTConfig cfg{.vocab_size = 97,
                          .block_size = 40,
                          .n_layer = 2,
                          .n_head = 2,
                          .n_embd = 128,
                          .tie_word_embeddings = true};
  expect_the_device_matches<nn::GPT>(cfg, cfg.vocab_size, cfg.block_size);
}

TEST(ReferenceAndFastBlocksCuda, LlamaOnTheDeviceMatchesFloat64AndTheReference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const nn::LlamaConfig cfg{.vocab_size = 89,
                            .hidden_size = 128,
                            .intermediate_size = 200,
                            .num_hidden_layers = 2,
                            .num_attention_heads = 2,
                            .num_key_value_heads = 1,
                            .max_position_embeddings = 40,
                            .rms_norm_eps = 1e-5,
                            .rope_theta = 1000.0};
  expect_the_device_matches<nn::Llama>(cfg, cfg.vocab_size, cfg.max_position_embeddings);
}

// block(x) and d(sum(block(x) * dy))/dx for a fresh non-contiguous leaf x [2, 7, C].
BlockResult run_block(const std::function<Tensor(const Tensor&)>& block, int64_t C, DType dtype) {
  const Tensor x = strided_input(C, dtype, 10);
  const Tensor dy = strided_input(C, dtype, 11).detach();
  const Tensor out = block(x);
  sum(out * dy).backward();
  return {out.detach(), x.grad()};
}

TEST(ReferenceAndFastBlocks, AutomaticIsFastAndNamesParse) {
  EXPECT_EQ(nn::chosen_block_implementation(Impl::automatic), Impl::fast);
  EXPECT_EQ(nn::chosen_block_implementation(Impl::reference), Impl::reference);
  EXPECT_EQ(nn::parse_block_implementation("reference"), Impl::reference);
  nn::GPT model(odd_gpt_config());
  EXPECT_TRUE(model.runs_fast_blocks());
  const Tensor idx = zeros({1, 5}, {.dtype = DType::i64});
  model.forward(idx);
  EXPECT_EQ(model.fast_blocks[0].fused_mlp_calls(), 1) << "automatic runs the fast blocks";
  model.set_block_implementation(Impl::reference);
  EXPECT_FALSE(model.runs_fast_blocks());
  model.forward(idx);
  EXPECT_EQ(model.fast_blocks[0].fused_mlp_calls(), 1) << "the reference runs none of them";
  try {
    nn::parse_block_implementation("fastest");
    FAIL() << "accepted an unknown name";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"fastest\""), std::string::npos) << e.what();
  }
}

// A model of config `cfg` in f64 and f32, its parameters perturbed, both implementations.
template <class Model, class Config>
void expect_same_model_behaviour(const Config& cfg) {
  for (DType dtype : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    Generator init(5);
    Model model(cfg, &init, {.dtype = dtype});
    perturb_parameters(model, 6);
    expect_same_model_behaviour(model, dtype, model.vocab_size(), model.context_length());
  }
}

TEST(ReferenceAndFastBlocks, GPTSameOutputsAndGradients) {
  expect_same_model_behaviour<nn::GPT>(odd_gpt_config());
}

TEST(ReferenceAndFastBlocks, LlamaSameOutputsAndGradients) {
  expect_same_model_behaviour<nn::Llama>(odd_llama_config());
}

TEST(ReferenceAndFastBlocks, GPTBlockOnANonContiguousInput) {
  for (DType dtype : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    nn::Block block(odd_gpt_config(), nullptr, {.dtype = dtype});
    perturb_parameters(block, 9);
    nn::GPTFastBlock fast(block);
    const BlockResult want = run_block([&](const Tensor& in) { return block(in); }, 15, dtype);
    const BlockResult got = run_block([&](const Tensor& in) { return fast.call(in); }, 15, dtype);
    EXPECT_LT(ops::max_rel_error(got.out, want.out), tolerance(dtype));
    EXPECT_LT(ops::max_rel_error(got.dx, want.dx), tolerance(dtype));
  }
}

TEST(ReferenceAndFastBlocks, LlamaLayerOnANonContiguousInput) {
  for (DType dtype : {DType::f64, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const nn::LlamaConfig cfg = odd_llama_config();
    nn::LlamaDecoderLayer layer(cfg, nullptr, {.dtype = dtype});
    perturb_parameters(layer, 12);
    const ops::RopeTables rope =
        ops::rope_tables(0, 7, cfg.attention_head_dim(), cfg.rope_theta, dtype, Device::cpu());
    const BlockResult want =
        run_block([&](const Tensor& in) { return layer.forward(in, rope, 0, nullptr); }, 12, dtype);
    const BlockResult got = run_block(
        [&](const Tensor& in) {
          const auto [h, mlp_out] = nn::llama_fast_layer(layer, in, Tensor(), rope, 0, nullptr);
          return h + mlp_out;
        },
        12, dtype);
    EXPECT_LT(ops::max_rel_error(got.out, want.out), tolerance(dtype));
    EXPECT_LT(ops::max_rel_error(got.dx, want.dx), tolerance(dtype));
  }
}

}  // namespace
