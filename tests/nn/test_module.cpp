// nn::Module and the layers: names, state dicts and their errors, modes, to(), hooks,
// layer math against float64 references, GPT init, model directories and the KV cache.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

nn::GPTConfig tiny_config(bool tied = true) {
  return nn::GPTConfig{.vocab_size = 33,
                       .block_size = 16,
                       .n_layer = 2,
                       .n_head = 2,
                       .n_embd = 8,
                       .tie_word_embeddings = tied};
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<double> as_f64(const Tensor& t) {
  return ops::contiguous(ops::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

}  // namespace

TEST(Module, GPTParameterNamesFollowHuggingFace) {
  nn::GPT model(tiny_config());
  std::vector<std::string> names;
  for (auto& [n, p] : model.named_parameters()) names.push_back(n);
  std::vector<std::string> expected{"transformer.wte.weight", "transformer.wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    for (const char* s :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
          "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"})
      expected.push_back(h + s);
  }
  expected.push_back("transformer.ln_f.weight");
  expected.push_back("transformer.ln_f.bias");
  EXPECT_EQ(names, expected);
  EXPECT_EQ(model.parameter("transformer.h.1.attn.c_attn.weight").shape(), (Shape{8, 24}));
  EXPECT_EQ(model.parameter("transformer.h.0.mlp.c_fc.weight").shape(), (Shape{8, 32}));
  EXPECT_EQ(model.parameter("transformer.h.0.mlp.c_proj.weight").shape(), (Shape{32, 8}));
  // C*V + T*C + L*(12C^2 + 13C) + 2C
  EXPECT_EQ(model.num_parameters(), 8 * 33 + 16 * 8 + 2 * (12 * 64 + 13 * 8) + 16);

  nn::GPT untied(tiny_config(false));
  EXPECT_EQ(untied.named_parameters().back().first, "lm_head.weight");
  EXPECT_EQ(untied.parameter("lm_head.weight").shape(), (Shape{33, 8}));
  // GPT keeps no buffers (the causal mask is made by the attention function), so the
  // state dict is exactly the parameters.
  EXPECT_TRUE(model.named_buffers().empty());
  EXPECT_EQ(model.state_dict().size(), model.named_parameters().size());
}

TEST(Module, GPTInitFollowsGPT2) {
  Generator gen(3);
  nn::GPTConfig cfg{.vocab_size = 257, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 64};
  nn::GPT model(cfg, &gen);
  auto stddev = [](const Tensor& t) {
    auto v = as_f64(t);
    double s = 0, s2 = 0;
    for (double x : v) s += x, s2 += x * x;
    const double m = s / v.size();
    return std::sqrt(s2 / v.size() - m * m);
  };
  for (auto& [name, p] : model.named_parameters()) {
    auto v = as_f64(p);
    if (name.find("ln") != std::string::npos) {
      const double expect = name.ends_with("weight") ? 1.0 : 0.0;
      for (double x : v) ASSERT_EQ(x, expect) << name;
    } else if (name.ends_with("bias")) {
      for (double x : v) ASSERT_EQ(x, 0.0) << name;
    } else if (name.find("c_proj") != std::string::npos) {
      EXPECT_NEAR(stddev(p), 0.02 / std::sqrt(8.0), 0.1 * 0.02 / std::sqrt(8.0)) << name;
    } else {
      EXPECT_NEAR(stddev(p), 0.02, 0.002) << name;
    }
  }
}

TEST(Module, StrictLoadListsEveryProblem) {
  nn::GPT model(tiny_config());
  std::map<std::string, Tensor> state;
  for (auto& [n, t] : model.state_dict()) state[n] = ops::clone(t);
  state.erase("transformer.h.1.ln_2.bias");
  state["transformer.h.9.attn.c_attn.weight"] = zeros({8, 24});
  state["transformer.wpe.weight"] = zeros({17, 8});
  const std::string msg = error_of([&] { model.load_state_dict(state); });
  EXPECT_NE(msg.find("missing keys: transformer.h.1.ln_2.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected keys: transformer.h.9.attn.c_attn.weight"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("transformer.wpe.weight: checkpoint [17, 8] vs model [16, 8]"),
            std::string::npos)
      << msg;

  // Non-strict: reports instead of raising, and loads what matches.
  state["transformer.wpe.weight"] = full({16, 8}, 0.25);
  auto result = model.load_state_dict(state, {.strict = false, .ignore = nullptr});
  EXPECT_EQ(result.missing_keys, std::vector<std::string>{"transformer.h.1.ln_2.bias"});
  EXPECT_EQ(result.unexpected_keys, std::vector<std::string>{"transformer.h.9.attn.c_attn.weight"});
  EXPECT_EQ(as_f64(model.parameter("transformer.wpe.weight"))[5], 0.25);
}

TEST(Module, LoadCopiesIntoTheSameTensorsAndConvertsDType) {
  nn::Linear a(7, 5), b(7, 5);
  const Tensor w_before = b.weight;
  std::map<std::string, Tensor> state;
  for (auto& [n, t] : a.state_dict()) state[n] = ops::to(t, Device::cpu(), DType::f64);
  b.load_state_dict(state);
  EXPECT_TRUE(b.weight.is_same(w_before));
  EXPECT_EQ(b.weight.dtype(), DType::f32);
  EXPECT_EQ(ops::max_rel_error(b.weight, a.weight), 0.0);
}

TEST(Module, RegistrationErrors) {
  struct Twice : nn::Module {
    Twice() {
      register_parameter("w", ones({2}));
      register_parameter("w", ones({2}));
    }
  };
  EXPECT_NE(error_of([] { Twice t; }).find("already used"), std::string::npos);
  struct Dotted : nn::Module {
    Dotted() { register_parameter("a.b", ones({2})); }
  };
  EXPECT_NE(error_of([] { Dotted d; }).find("'a.b'"), std::string::npos);
  struct IntParam : nn::Module {
    IntParam() { register_parameter("i", zeros({2}, {.dtype = DType::i64})); }
  };
  EXPECT_NE(error_of([] { IntParam p; }).find("floating"), std::string::npos);
  EXPECT_THROW(nn::ModuleList().forward(ones({1})), Error);
  EXPECT_THROW(nn::GPT(nn::GPTConfig{.n_head = 5, .n_embd = 8}), Error);
}

TEST(Module, LinearMatchesFloat64ReferenceOnStridedInput) {
  Generator gen(11);
  nn::Linear lin(7, 33, true, 0.02, &gen);
  normal_(lin.bias, 0, 1, &gen);
  Tensor base = normal({3, 7, 5}, 0, 1, {}, &gen);
  Tensor x = base.transpose(1, 2);  // [3, 5, 7], non-contiguous
  Tensor y = lin(x);
  ASSERT_EQ(y.shape(), (Shape{3, 5, 33}));
  auto xv = as_f64(x), wv = as_f64(lin.weight), bv = as_f64(lin.bias), yv = as_f64(y);
  double worst = 0;
  for (int r = 0; r < 15; ++r)
    for (int o = 0; o < 33; ++o) {
      double acc = bv[o];
      for (int i = 0; i < 7; ++i) acc += xv[r * 7 + i] * wv[i * 33 + o];
      worst = std::max(worst, std::abs(acc - yv[r * 33 + o]));
    }
  EXPECT_LT(worst, 1e-5);
  EXPECT_THROW(lin(ones({2, 6})), Error);
}

TEST(Module, DropoutIsSeededAndOffInEval) {
  Tensor x = ones({257, 33});
  Generator g1(5), g2(5);
  nn::Dropout d1(0.3, &g1), d2(0.3, &g2);
  Tensor a = d1(x), b = d2(x);
  EXPECT_EQ(ops::max_rel_error(a, b), 0.0);
  auto v = as_f64(a);
  int64_t zeros_count = 0;
  for (double e : v) {
    if (e == 0)
      ++zeros_count;
    else
      ASSERT_NEAR(e, 1.0 / 0.7, 1e-6);
  }
  EXPECT_NEAR(double(zeros_count) / v.size(), 0.3, 0.03);
  d1.eval();
  EXPECT_EQ(ops::max_rel_error(d1(x), x), 0.0);
  nn::GPT model(nn::GPTConfig{
      .vocab_size = 11, .block_size = 4, .n_layer = 1, .n_head = 1, .n_embd = 4, .dropout = 0.1});
  model.eval();
  for (auto& [name, m] : model.named_modules()) EXPECT_FALSE(m->is_training()) << name;
  model.train();
  EXPECT_TRUE(model.transformer.blocks[0]->attn.attn_dropout.is_training());
  EXPECT_THROW(nn::Dropout(1.0), Error);
}

TEST(Module, ToKeepsTensorIdentity) {
  nn::GPT model(tiny_config());
  const Tensor w = model.parameter("transformer.h.0.attn.c_attn.weight");
  const auto before = as_f64(w);
  model.to(DType::f64);
  EXPECT_EQ(w.dtype(), DType::f64);
  EXPECT_EQ(model.parameter("transformer.h.0.attn.c_attn.weight").dtype(), DType::f64);
  EXPECT_EQ(as_f64(w), before);
  Tensor logits = model.forward(zeros({1, 3}, {.dtype = DType::i64}));
  EXPECT_EQ(logits.dtype(), DType::f64);
  EXPECT_THROW(model.to(DType::i32), Error);
}

TEST(Module, HooksFireAroundForwardAndBeforeBackward) {
  nn::Linear first(7, 5), second(5, 3);
  std::vector<std::string> events;
  auto id = first.register_forward_pre_hook(
      [&](nn::Module&, const Tensor& in) { events.push_back("pre " + shape_str(in.shape())); });
  first.register_forward_hook([&](nn::Module&, const Tensor&, const Tensor& out) {
    events.push_back("post " + shape_str(out.shape()));
  });
  first.register_backward_pre_hook([&](nn::Module& m) {
    // Runs before this module's own backward: its weights have no gradient yet.
    events.push_back(std::string("backward first: first.grad=") +
                     (first.weight.grad().defined() ? "yes" : "no"));
  });
  Tensor x = normal({2, 7}, 0, 1);
  Tensor loss = sum(second(first(x)));
  loss.backward();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0], "pre [2, 7]");
  EXPECT_EQ(events[1], "post [2, 5]");
  EXPECT_EQ(events[2], "backward first: first.grad=no");
  EXPECT_TRUE(first.weight.grad().defined());
  first.remove_hook(id);
  events.clear();
  first(x);
  EXPECT_EQ(events.size(), 1u);
}

TEST(Module, ZeroGradAndParametersShareTensors) {
  nn::Linear lin(3, 2);
  sum(lin(ones({4, 3}))).backward();
  ASSERT_TRUE(lin.weight.grad().defined());
  EXPECT_EQ(as_f64(lin.bias.grad()), (std::vector<double>{4, 4}));
  lin.zero_grad(false);
  EXPECT_EQ(as_f64(lin.bias.grad()), (std::vector<double>{0, 0}));
  lin.zero_grad();
  EXPECT_FALSE(lin.weight.grad().defined());
  EXPECT_TRUE(lin.parameters()[0].is_same(lin.weight));
}

TEST(GPT, KVCacheMatchesFullForward) {
  Generator gen(21);
  nn::GPT model(tiny_config(false), &gen);
  Tensor idx = randint(0, 33, {3, 11}, {.dtype = DType::i64}, &gen);
  Tensor full_logits = model.forward(idx);
  nn::KVCache cache = model.make_kv_cache(3);
  // A prompt of 4 tokens, then one token at a time.
  std::vector<Tensor> pieces{model.forward_incremental(idx.narrow(1, 0, 4), cache)};
  for (int64_t t = 4; t < 11; ++t)
    pieces.push_back(model.forward_incremental(idx.narrow(1, t, 1), cache));
  EXPECT_EQ(cache.length, 11);
  EXPECT_LT(ops::max_rel_error(ops::cat(pieces, 1), full_logits), 1e-5);
  EXPECT_THROW(model.forward_incremental(zeros({3, 6}, {.dtype = DType::i64}), cache), Error);
  EXPECT_THROW(model.forward(zeros({1, 17}, {.dtype = DType::i64})), Error);
}

TEST(GPT, GreedyGenerationFollowsArgmaxBeyondTheContext) {
  Generator gen(8);
  nn::GPT model(tiny_config(), &gen);
  Tensor prompt = randint(0, 33, {2, 5}, {.dtype = DType::i64}, &gen);
  Tensor out = model.generate(prompt, 14, {.temperature = 0});
  ASSERT_EQ(out.shape(), (Shape{2, 19}));
  // Reference: full forward over the last block_size tokens each step.
  std::vector<int64_t> seq = out.to_vector<int64_t>();
  for (int64_t len = 5; len < 19; ++len) {
    const int64_t start = std::max<int64_t>(0, len - 16);
    for (int64_t b = 0; b < 2; ++b) {
      Tensor ctx = out.narrow(0, b, 1).narrow(1, start, len - start);
      auto logits = as_f64(model.forward(ctx).select(1, len - start - 1));
      const int64_t best = std::max_element(logits.begin(), logits.end()) - logits.begin();
      ASSERT_EQ(seq[b * 19 + len], best) << "row " << b << " position " << len;
    }
  }
  // Sampling is reproducible from the generator.
  Generator s1(4), s2(4);
  EXPECT_EQ(
      model.generate(prompt, 6, {.temperature = 0.8, .top_k = 5, .gen = &s1}).to_vector<int64_t>(),
      model.generate(prompt, 6, {.temperature = 0.8, .top_k = 5, .gen = &s2}).to_vector<int64_t>());
}

TEST(GPT, ModelDirectoryRoundTrip) {
  const auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "gpt_dir";
  std::filesystem::remove_all(dir);
  for (bool tied : {true, false}) {
    Generator gen(tied ? 1 : 2);
    nn::GPT model(tiny_config(tied), &gen);
    model.save_pretrained(dir.string());
    const auto file = load_safetensors((dir / "model.safetensors").string());
    EXPECT_EQ(file.contains("lm_head.weight"), !tied);
    auto loaded = nn::GPT::from_pretrained(dir.string());
    EXPECT_EQ(loaded->config().tie_word_embeddings, tied);
    Tensor idx = randint(0, 33, {2, 9}, {.dtype = DType::i64}, &gen);
    EXPECT_EQ(ops::max_rel_error(loaded->forward(idx), model.forward(idx)), 0.0);
  }
  // A file with HF's extra mask buffers and without the "transformer." prefix still loads.
  nn::GPT model(tiny_config());
  std::vector<std::pair<std::string, Tensor>> hf;
  for (auto& [n, t] : model.state_dict())
    hf.emplace_back(n.substr(std::string("transformer.").size()), t);
  hf.emplace_back("h.0.attn.bias", ones({1, 1, 16, 16}));
  hf.emplace_back("h.0.attn.masked_bias", full({}, -1e4));
  const auto path = (dir / "hf.safetensors").string();
  save_safetensors(path, hf);
  nn::GPT other(tiny_config());
  other.load_safetensors_weights(path);
  EXPECT_EQ(ops::max_rel_error(other.parameter("transformer.h.1.mlp.c_fc.weight"),
                               model.parameter("transformer.h.1.mlp.c_fc.weight")),
            0.0);
  // A file for another shape is refused naming the file and the tensor.
  nn::GPT wider(
      nn::GPTConfig{.vocab_size = 33, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 12});
  const std::string msg = error_of([&] { wider.load_safetensors_weights(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("transformer.wte.weight: checkpoint [33, 8] vs model [33, 12]"),
            std::string::npos)
      << msg;
}

TEST(Module, BuffersPersistOrNotAndKeepIntegerDTypes) {
  struct WithBuffers : nn::Module {
    WithBuffers() {
      w = register_parameter("w", ones({3}));
      counts = register_buffer("counts", zeros({2}, {.dtype = DType::i64}));
      stats = register_buffer("stats", full({2}, 0.5));
      scratch = register_buffer("scratch", zeros({4}), /*persistent=*/false);
    }
    Tensor w, counts, stats, scratch;
  } m;
  std::vector<std::string> names;
  for (auto& [n, t] : m.state_dict()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"w", "counts", "stats"}));
  EXPECT_EQ(m.named_buffers().size(), 3u);
  m.to(DType::f64);
  EXPECT_EQ(m.counts.dtype(), DType::i64);
  EXPECT_EQ(m.stats.dtype(), DType::f64);
  EXPECT_EQ(m.w.dtype(), DType::f64);
  std::map<std::string, Tensor> state{{"w", full({3}, 2.0)},
                                      {"counts", full({2}, 7.0, {.dtype = DType::i64})},
                                      {"stats", zeros({2})}};
  m.load_state_dict(state);
  EXPECT_EQ(m.counts.to_vector<int64_t>(), (std::vector<int64_t>{7, 7}));
  state.erase("stats");
  EXPECT_THROW(m.load_state_dict(state), Error);
}
