// GPT dropout (nanoGPT's sites and scaling) and gradient checkpointing, against
// independent references: a float64 forward written out here with the masks drawn in
// nanoGPT's order, binomial statistics, central differences, and the plain (not
// checkpointed) model bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/memory_stats.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

namespace {

nn::GPTConfig small_config(double dropout, int64_t n_layer = 2) {
  return {.vocab_size = 29,
          .block_size = 16,
          .n_layer = n_layer,
          .n_head = 2,
          .n_embd = 12,
          .dropout = dropout};
}

std::unique_ptr<nn::GPT> make_model(const nn::GPTConfig& cfg, uint64_t seed,
                                    DType dtype = DType::f32) {
  Generator init(seed);
  return std::make_unique<nn::GPT>(cfg, &init, TensorOptions{.dtype = dtype});
}

Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator g(seed);
  return randint(0, vocab, {B, T}, {.dtype = DType::i64}, &g);
}

std::vector<double> values(const Tensor& t) {
  return ops::contiguous(ops::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

// The mask nn::Dropout applies: each element kept when its uniform draw (f32, from the
// default generator) is >= p, and then scaled by 1/(1-p). Drawn here independently of the
// model, in float64.
Tensor reference_mask(const Shape& shape, double p) {
  const std::vector<float> u = rand(shape, {.dtype = DType::f32}).to_vector<float>();
  std::vector<double> mask(u.size());
  for (size_t i = 0; i < u.size(); ++i)
    mask[i] = u[i] >= static_cast<float>(p) ? 1.0 / (1.0 - p) : 0.0;
  return from_vector(mask, shape, {.dtype = DType::f64});
}

// nanoGPT's GPT.forward in float64 with dropout p at its four sites, written without the
// nn classes: embeddings -> drop; per block: attention probabilities -> drop, c_proj ->
// drop, mlp c_proj -> drop.
Tensor reference_logits(nn::GPT& model, const Tensor& idx, double p) {
  NoGradGuard no_grad;
  const nn::GPTConfig& cfg = model.config();
  const int64_t B = idx.size(0), T = idx.size(1), C = cfg.n_embd, H = cfg.n_head, D = C / H;
  const double eps = cfg.layer_norm_epsilon;
  std::vector<double> causal(T * T);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < T; ++j)
      causal[i * T + j] = j > i ? -std::numeric_limits<double>::infinity() : 0.0;
  const Tensor causal_mask = from_vector(causal, {T, T}, {.dtype = DType::f64});
  const Tensor pos = arange(0, static_cast<double>(T), 1.0, {.dtype = DType::i64});

  Tensor x =
      embedding(model.transformer.wte.weight, idx) + embedding(model.transformer.wpe.weight, pos);
  x = x * reference_mask({B, T, C}, p);
  for (nn::Block* block : model.transformer.blocks) {
    const Tensor h = layer_norm(x, block->ln_1.weight, block->ln_1.bias, eps);
    const auto qkv = split(matmul(h, block->attn.c_attn.weight) + block->attn.c_attn.bias, C, -1);
    auto heads = [&](const Tensor& t) { return t.reshape({B, T, H, D}).transpose(1, 2); };
    Tensor att =
        matmul(heads(qkv[0]), heads(qkv[1]).transpose(-2, -1)) * (1.0 / std::sqrt(double(D)));
    att = softmax(att + causal_mask, -1) * reference_mask({B, H, T, T}, p);
    Tensor y = matmul(att, heads(qkv[2])).transpose(1, 2).reshape({B, T, C});
    y = matmul(y, block->attn.c_proj.weight) + block->attn.c_proj.bias;
    x = x + y * reference_mask({B, T, C}, p);
    const Tensor h2 = layer_norm(x, block->ln_2.weight, block->ln_2.bias, eps);
    Tensor m = gelu(matmul(h2, block->mlp.c_fc.weight) + block->mlp.c_fc.bias);
    m = matmul(m, block->mlp.c_proj.weight) + block->mlp.c_proj.bias;
    x = x + m * reference_mask({B, T, C}, p);
  }
  x = layer_norm(x, model.transformer.ln_f.weight, model.transformer.ln_f.bias, eps);
  return matmul(x, model.transformer.wte.weight.t());
}

}  // namespace

TEST(GPTDropout, ZeroDropoutIsTheModelWithoutDropout) {
  auto plain = make_model(small_config(0.0), 3);
  auto with_dropout = make_model(small_config(0.3), 3);  // same weights, dropout off in eval
  const Tensor idx = random_tokens(3, 11, 29, 4);
  manual_seed(99);
  const Tensor train_logits = plain->forward(idx);
  EXPECT_EQ(default_generator().offset(), 0u) << "dropout 0 must not draw random numbers";
  plain->eval();
  const Tensor eval_logits = plain->forward(idx);
  with_dropout->eval();
  const Tensor dropout_eval_logits = with_dropout->forward(idx);
  EXPECT_EQ(values(train_logits), values(eval_logits));
  EXPECT_EQ(values(train_logits), values(dropout_eval_logits));
  with_dropout->train();
  EXPECT_NE(values(train_logits), values(with_dropout->forward(idx)));
  // set_dropout(0) turns every site off: the training forward is the plain model's again.
  with_dropout->set_dropout(0.0);
  EXPECT_EQ(with_dropout->config().dropout, 0.0);
  EXPECT_EQ(values(with_dropout->forward(idx)), values(train_logits));
  EXPECT_THROW(with_dropout->set_dropout(1.0), Error);
}

TEST(GPTDropout, KeepsTheMeanAndZeroesAFractionP) {
  for (double p : {0.1, 0.2, 0.5}) {
    manual_seed(static_cast<uint64_t>(p * 100));
    const Tensor base = uniform({333, 301}, 0.5, 1.5);
    const Tensor x = base.t();  // a non-contiguous view
    nn::Dropout drop(p);
    const Tensor y = drop(x);
    const auto xv = values(x), yv = values(y);
    const double n = static_cast<double>(xv.size());
    double zeros = 0, sum_x = 0, sum_y = 0, sum_x2 = 0;
    for (size_t i = 0; i < xv.size(); ++i) {
      sum_x += xv[i];
      sum_x2 += xv[i] * xv[i];
      sum_y += yv[i];
      if (yv[i] == 0) {
        ++zeros;
      } else {
        ASSERT_NEAR(yv[i], xv[i] / (1 - p), 1e-6 * xv[i]) << "kept elements are scaled by 1/(1-p)";
      }
    }
    // Zeroed count ~ Binomial(n, p); the mean of y has variance E[x²]·p/(1-p)/n around x's.
    EXPECT_NEAR(zeros / n, p, 5 * std::sqrt(p * (1 - p) / n)) << "p=" << p;
    EXPECT_NEAR(sum_y / n, sum_x / n, 5 * std::sqrt(sum_x2 / n * p / (1 - p) / n)) << "p=" << p;
    drop.eval();
    EXPECT_TRUE(drop(x).is_same(x));
  }
}

TEST(GPTDropout, SitesAndScalingFollowNanoGPT) {
  const double p = 0.2;
  auto model = make_model(small_config(p, 3), 5, DType::f64);
  const Tensor idx = random_tokens(2, 13, 29, 6);
  manual_seed(1234);
  const Tensor got = model->forward(idx);
  const uint64_t model_draws = default_generator().offset();
  manual_seed(1234);
  const Tensor want = reference_logits(*model, idx, p);
  EXPECT_EQ(default_generator().offset(), model_draws)
      << "the model draws other masks than nanoGPT's sites";
  const auto g = values(got), w = values(want);
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], 1e-10 * (1 + std::abs(w[i]))) << i;
  // Not the eval model: the masks mattered.
  model->eval();
  EXPECT_GT(ops::max_rel_error(model->forward(idx), want), 1e-3);
}

// With the generator reset before every forward the masks are fixed, so the loss is a
// smooth function of the parameters and central differences check the backward through
// every dropout site.
TEST(GPTDropout, GradientsMatchFiniteDifferencesWithAFixedMask) {
  auto model = make_model(small_config(0.3), 7, DType::f64);
  const Tensor idx = random_tokens(2, 9, 29, 8);
  // A random projection of the logits: a scalar in float64 all the way (the cross-entropy
  // reduction sums in f32, too coarse for differences at h = 1e-5).
  Generator g(9);
  const Tensor projection = randn({2, 9, 29}, {.dtype = DType::f64}, &g);
  auto loss_now = [&] {
    manual_seed(77);
    return sum(model->forward(idx) * projection);
  };
  model->zero_grad();
  loss_now().backward();
  nn::Block& first = *model->transformer.blocks[0];
  nn::Block& last = *model->transformer.blocks[1];
  const std::vector<std::pair<Tensor, int64_t>> probes = {
      {model->transformer.wte.weight, 40}, {model->transformer.wpe.weight, 17},
      {first.attn.c_attn.weight, 101},     {first.attn.c_attn.weight, 333},
      {last.attn.c_proj.weight, 50},       {last.mlp.c_fc.weight, 222},
      {last.mlp.c_proj.bias, 5},           {model->transformer.ln_f.weight, 3}};
  for (const auto& [param, flat] : probes) {
    const double analytic = values(param.grad())[flat];
    double* data = param.data<double>() + flat;
    const double saved = *data, h = 1e-5;
    double plus, minus;
    {
      NoGradGuard no_grad;
      *data = saved + h;
      plus = loss_now().item();
      *data = saved - h;
      minus = loss_now().item();
      *data = saved;
    }
    const double numeric = (plus - minus) / (2 * h);
    EXPECT_NEAR(analytic, numeric, 1e-7 + 1e-5 * std::abs(numeric)) << "element " << flat;
  }
}

namespace {

struct LossAndGrads {
  double loss;
  std::vector<std::vector<double>> grads;
  uint64_t generator_offset;
};

LossAndGrads train_step(nn::GPT& model, const Tensor& idx, const Tensor& targets,
                        std::optional<DType> autocast = std::nullopt) {
  model.zero_grad();
  manual_seed(2024);
  Tensor loss;
  {
    std::optional<autograd::AutocastGuard> guard;
    if (autocast) guard.emplace(*autocast);
    loss = model.loss(idx, targets);
  }
  loss.backward();  // outside the autocast scope, as a training loop runs it
  LossAndGrads out{loss.item(), {}, default_generator().offset()};
  for (const Tensor& p : model.parameters()) out.grads.push_back(values(p.grad()));
  return out;
}

}  // namespace

TEST(GradientCheckpointing, SameLossAndGradientsBitForBit) {
  const Tensor idx = random_tokens(3, 14, 29, 10), targets = random_tokens(3, 14, 29, 11);
  struct Case {
    double dropout;
    std::optional<DType> autocast;
  };
  for (const Case& c :
       {Case{0.0, std::nullopt}, Case{0.15, std::nullopt}, Case{0.1, DType::bf16}}) {
    auto plain = make_model(small_config(c.dropout, 3), 12);
    auto checkpointed = make_model(small_config(c.dropout, 3), 12);
    checkpointed->gradient_checkpointing_enable();
    ASSERT_TRUE(checkpointed->is_gradient_checkpointing());
    const LossAndGrads a = train_step(*plain, idx, targets, c.autocast);
    const LossAndGrads b = train_step(*checkpointed, idx, targets, c.autocast);
    const std::string what =
        "dropout " + std::to_string(c.dropout) + (c.autocast ? " under bf16 autocast" : "");
    EXPECT_EQ(a.loss, b.loss) << what;
    EXPECT_EQ(a.generator_offset, b.generator_offset)
        << what << ": the recompute must not draw new numbers";
    ASSERT_EQ(a.grads.size(), b.grads.size());
    for (size_t i = 0; i < a.grads.size(); ++i)
      EXPECT_EQ(a.grads[i], b.grads[i]) << what << ", parameter " << i;
  }
}

TEST(GradientCheckpointing, KeepsFewerActivationsForBackward) {
  const nn::GPTConfig cfg{
      .vocab_size = 64, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64, .dropout = 0.1};
  const Tensor idx = random_tokens(4, 64, 64, 13), targets = random_tokens(4, 64, 64, 14);
  struct Footprint {
    size_t held_after_forward, peak_through_backward;
  };
  auto measure = [&](bool checkpointing) {
    auto model = make_model(cfg, 15);
    model->gradient_checkpointing_enable(checkpointing);
    train_step(*model, idx, targets);  // gradients allocated, so only activations differ below
    manual_seed(3);
    const size_t before = host_memory_stats().in_use;
    reset_host_peak_memory();
    Tensor loss = model->loss(idx, targets);
    const size_t held = host_memory_stats().in_use - before;
    loss.backward();
    return Footprint{held, host_memory_stats().peak - before};
  };
  const Footprint plain = measure(false), checkpointed = measure(true);
  std::cout << "bytes held by the graph after forward: plain " << plain.held_after_forward
            << ", checkpointed " << checkpointed.held_after_forward
            << "; peak through backward: plain " << plain.peak_through_backward << ", checkpointed "
            << checkpointed.peak_through_backward << "\n";
  // Checkpointed, the graph keeps each block's input, not its dozen intermediates.
  EXPECT_LT(checkpointed.held_after_forward * 3, plain.held_after_forward);
  EXPECT_LT(checkpointed.peak_through_backward, plain.peak_through_backward);

  // In eval (or without grad) nothing is checkpointed and nothing differs.
  auto model = make_model(cfg, 15);
  model->gradient_checkpointing_enable();
  model->eval();
  auto reference = make_model(cfg, 15);
  reference->eval();
  EXPECT_EQ(values(model->forward(idx)), values(reference->forward(idx)));
}

// On a GPU the masks are the CPU's (one Philox numbering for every device), training with
// dropout in bf16 takes the flash kernels that draw attention dropout, and gradient
// checkpointing gives the plain run's gradients. Skips without a GPU.
TEST(GPTDropout, CudaDrawsTheCpuMasksAndTakesTheDropoutAttentionKernels) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  // Head size 64: the fused attention applies in bf16 when dropout is off.
  const nn::GPTConfig cfg{.vocab_size = 101,
                          .block_size = 64,
                          .n_layer = 2,
                          .n_head = 2,
                          .n_embd = 128,
                          .dropout = 0.2};
  auto cpu = make_model(cfg, 21);
  auto gpu = make_model(cfg, 21);
  gpu->to(Device::cuda());
  const Tensor idx = random_tokens(3, 64, 101, 22);
  manual_seed(5);
  const Tensor want = cpu->forward(idx);
  manual_seed(5);
  const Tensor got = gpu->forward(idx.to(Device::cuda()));
  EXPECT_LT(ops::max_rel_error(got.cpu(), want), 1e-4);

  gpu->to(DType::bf16);
  const Tensor targets = random_tokens(3, 64, 101, 23).to(Device::cuda());
  gpu->loss(idx.to(Device::cuda()), targets);
  EXPECT_EQ(gpu->fast_blocks[0].fused_attention_calls(), 1)
      << "dropout in training: the flash kernels";
  gpu->eval();
  gpu->loss(idx.to(Device::cuda()), targets);
  EXPECT_EQ(gpu->fast_blocks[0].fused_attention_calls(), 2)
      << "eval: the fused kernels without dropout";
  gpu->train();

  auto checkpointed = make_model(cfg, 21);
  checkpointed->to(Device::cuda(), DType::bf16);
  checkpointed->gradient_checkpointing_enable();
  const LossAndGrads a = train_step(*gpu, idx.to(Device::cuda()), targets);
  const LossAndGrads b = train_step(*checkpointed, idx.to(Device::cuda()), targets);
  EXPECT_EQ(a.loss, b.loss);
  // Not bit for bit: some CUDA backward kernels accumulate with atomics, and the gradients
  // are bf16, so a different summation order moves a value by a bf16 step or two (2^-7
  // relative at the largest magnitude; the position embedding's, a sum over the batch of the
  // first block's input gradient, moved by 1.4 steps on an H100); a wrong recompute (another
  // dropout mask) moves them by far more.
  for (size_t i = 0; i < a.grads.size(); ++i) {
    double diff = 0, scale = 0;
    for (size_t j = 0; j < a.grads[i].size(); ++j) {
      diff = std::max(diff, std::abs(a.grads[i][j] - b.grads[i][j]));
      scale = std::max(scale, std::abs(a.grads[i][j]));
    }
    EXPECT_LE(diff, 0x1p-6 * scale) << "parameter " << i;
  }
}
