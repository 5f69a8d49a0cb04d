// nn::Llama: against Hugging Face transformers' LlamaForCausalLM (tests/nn/hf_llama_check.py)
// both ways (a model transformers saved loads here with the same logits; what Tessera saves
// loads there with the same logits), 10 AdamW steps against torch.optim.AdamW, and the
// KV-cache decoding path against the full forward.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "python_reference.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

const std::string kScript = TESSERA_SOURCE_DIR "/tests/nn/hf_llama_check.py";

using test::scratch_dir;

// Runs the reference; false (the caller skips) when transformers' Llama is not usable with
// this Python.
bool run_reference(const std::string& args) { return test::run_reference_script(kScript, args); }

// A small GQA Llama: 4 query heads sharing 2 key/value heads, head dim 8.
nn::LlamaConfig small_config(bool tied) {
  return nn::LlamaConfig{.vocab_size = 97,
                         .hidden_size = 32,
                         .intermediate_size = 56,
                         .num_hidden_layers = 2,
                         .num_attention_heads = 4,
                         .num_key_value_heads = 2,
                         .max_position_embeddings = 64,
                         .rms_norm_eps = 1e-6,
                         .rope_theta = 500.0,
                         .tie_word_embeddings = tied};
}

std::string config_json(const nn::LlamaConfig& c) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "'{\"vocab_size\": %lld, \"hidden_size\": %lld, \"intermediate_size\": %lld, "
                "\"num_hidden_layers\": %lld, \"num_attention_heads\": %lld, "
                "\"num_key_value_heads\": %lld, \"max_position_embeddings\": %lld, "
                "\"rms_norm_eps\": %g, \"rope_theta\": %g, \"tie_word_embeddings\": %s}'",
                (long long)c.vocab_size, (long long)c.hidden_size, (long long)c.intermediate_size,
                (long long)c.num_hidden_layers, (long long)c.num_attention_heads,
                (long long)c.num_key_value_heads, (long long)c.max_position_embeddings,
                c.rms_norm_eps, c.rope_theta, c.tie_word_embeddings ? "true" : "false");
  return buf;
}

struct Batch {
  Tensor idx, targets;
  std::string path;
};

Batch make_batch(const std::filesystem::path& dir, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  Batch b{randint(0, vocab, {3, 17}, {.dtype = DType::i64}, &gen),
          randint(0, vocab, {3, 17}, {.dtype = DType::i64}, &gen),
          (dir / "batch.safetensors").string()};
  save_safetensors(b.path, {{"idx", b.idx}, {"targets", b.targets}});
  return b;
}

// Logits, loss, first gradients and the parameters after 10 AdamW steps against the
// reference's; prints the figures.
void check_against_reference(nn::Llama& model, const Batch& batch, const SafetensorsContents& ref,
                             const char* label) {
  const Tensor logits = model.forward(batch.idx);
  const double logits_err = ops::max_rel_error(logits, ref.at("logits"));
  EXPECT_LT(logits_err, 1e-5);
  Tensor loss = model.loss(batch.idx, batch.targets);
  const double loss_err =
      std::abs(loss.item() - ref.at("loss").item()) / std::abs(ref.at("loss").item());
  EXPECT_LT(loss_err, 1e-5);
  loss.backward();
  double worst_grad = 0;
  const auto params = model.named_parameters();
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << name;
    const double err = ops::max_rel_error(p.grad(), ref.at("grad/" + name));
    worst_grad = std::max(worst_grad, err);
    EXPECT_LT(err, 1e-4) << name;
  }
  // AdamW as the reference: decay on rank >= 2 only, which Tessera's default grouping does.
  optim::AdamW opt(model.parameters(),
                   {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    model.loss(batch.idx, batch.targets).backward();
    opt.step();
  }
  // After 10 steps the parameters agree less closely than the gradients: AdamW's normalised
  // step m / sqrt(v) turns last-bit differences of a near-zero gradient (Eigen's accumulation
  // order against PyTorch's, which changes with the CPU's vector width) into differences of
  // up to lr per step: 1.12e-4 on an AMD EPYC builder (below 1e-4 on others). A wrong setting
  // stays far above the bound: half the weight decay gave 5.2e-4, beta2 0.99 for 0.95 1.2e-2.
  double worst_param = 0;
  for (const auto& [name, p] : params) {
    const double err = ops::max_rel_error(p, ref.at("param/" + name));
    worst_param = std::max(worst_param, err);
    EXPECT_LT(err, 2e-4) << name;
  }
  std::printf(
      "llama parity (%s): logits %.2e, loss %.2e, worst grad %.2e, worst param after 10 AdamW "
      "steps %.2e\n",
      label, logits_err, loss_err, worst_grad, worst_param);
}

TEST(LlamaParity, LoadsWhatTransformersSaved) {
  for (bool tied : {false, true}) {
    const auto dir = scratch_dir(std::string("llama_from_hf_") + (tied ? "tied" : "untied"));
    const nn::LlamaConfig cfg = small_config(tied);
    if (!run_reference("--make " + (dir / "hf").string() + " --config " + config_json(cfg)))
      GTEST_SKIP() << test::python_interpreter() << " has no usable transformers LlamaForCausalLM";
    auto model = nn::Llama::from_pretrained((dir / "hf").string());
    EXPECT_EQ(model->config().num_key_value_heads, 2);
    EXPECT_EQ(model->config().tie_word_embeddings, tied);
    const Batch batch = make_batch(dir, cfg.vocab_size, 1);
    ASSERT_TRUE(run_reference("--model " + (dir / "hf").string() + " --batch " + batch.path +
                              " --out " + (dir / "ref.safetensors").string()));
    check_against_reference(*model, batch, load_safetensors((dir / "ref.safetensors").string()),
                            tied ? "transformers-saved, tied" : "transformers-saved, untied");
  }
}

TEST(LlamaParity, TransformersLoadsWhatTesseraSaved) {
  const auto dir = scratch_dir("llama_to_hf");
  const nn::LlamaConfig cfg = small_config(false);
  Generator gen(7);
  nn::Llama model(cfg, &gen);
  for (auto& [name, p] : model.named_parameters())
    if (p.dim() == 1) normal_(p, 1.0, 0.1, &gen);  // RMSNorm weights that matter
  model.save_pretrained((dir / "tessera").string());
  const Batch batch = make_batch(dir, cfg.vocab_size, 2);
  if (!run_reference("--model " + (dir / "tessera").string() + " --batch " + batch.path +
                     " --out " + (dir / "ref.safetensors").string()))
    GTEST_SKIP() << test::python_interpreter() << " has no usable transformers LlamaForCausalLM";
  check_against_reference(model, batch, load_safetensors((dir / "ref.safetensors").string()),
                          "Tessera-saved, untied");
}

TEST(Llama, IncrementalDecodingMatchesTheFullForward) {
  Generator gen(3);
  nn::Llama model(small_config(false), &gen);
  Tensor idx = randint(0, 97, {2, 9}, {.dtype = DType::i64}, &gen);
  const Tensor full = model.forward(idx);
  nn::KVCache cache = model.make_kv_cache(2);
  const Tensor first = model.forward_incremental(ops::narrow(idx, 1, 0, 5), cache);
  const Tensor rest1 = model.forward_incremental(ops::narrow(idx, 1, 5, 1), cache);
  const Tensor rest = model.forward_incremental(ops::narrow(idx, 1, 6, 3), cache);
  EXPECT_LT(ops::max_rel_error(first, ops::narrow(full, 1, 0, 5)), 1e-5);
  EXPECT_LT(ops::max_rel_error(rest1, ops::narrow(full, 1, 5, 1)), 1e-5);
  EXPECT_LT(ops::max_rel_error(rest, ops::narrow(full, 1, 6, 3)), 1e-5);
  // Greedy generation equals picking the argmax of a full forward at every step.
  const Tensor generated = model.generate(ops::narrow(idx, 1, 0, 4), 6, {.temperature = 0.0});
  ASSERT_EQ(generated.shape(), (Shape{2, 10}));
  for (int64_t t = 4; t < 10; ++t) {
    const Tensor logits = model.forward(ops::narrow(generated, 1, 0, t));
    const Tensor want = ops::argmax(ops::select(logits, 1, t - 1), -1);
    EXPECT_TRUE(ops::allclose(want, ops::select(generated, 1, t), 0, 0)) << "position " << t;
  }
  // Top-k sampling stays inside the k most likely tokens of each step.
  Generator sample_gen(4);
  const Tensor sampled = model.generate(ops::narrow(idx, 1, 0, 4), 3,
                                        {.temperature = 1.0, .top_k = 3, .gen = &sample_gen});
  for (int64_t t = 4; t < 7; ++t) {
    const Tensor logits = ops::select(model.forward(ops::narrow(sampled, 1, 0, t)), 1, t - 1);
    const Tensor top = ops::topk(logits, 3, -1).indices;
    const Tensor hit = ops::sum(
        ops::binary(BinaryOp::Eq, top, ops::unsqueeze(ops::select(sampled, 1, t), 1)), {1});
    EXPECT_TRUE(ops::allclose(hit, ones({2}, {.dtype = DType::i64}), 0, 0)) << "position " << t;
  }
}

TEST(Llama, ConfigErrorsNameTheProblem) {
  nn::LlamaConfig bad = small_config(false);
  bad.num_key_value_heads = 3;
  try {
    nn::Llama model(bad);
    FAIL() << "a head count that the kv heads do not divide was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads"), std::string::npos) << e.what();
  }
  const auto dir = scratch_dir("llama_bad_config");
  std::ofstream(dir / "config.json") << R"({"model_type": "gpt2", "vocab_size": 10})";
  EXPECT_THROW(nn::llama_config_from_json_file((dir / "config.json").string()), Error);
  std::ofstream(dir / "config.json")
      << R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
    "rope_scaling": {"type": "linear", "factor": 2.0}})";
  EXPECT_THROW(nn::llama_config_from_json_file((dir / "config.json").string()), Error);
}

// transformers 5 saves the rotary base only as "rope_parameters": {"rope_theta": ...} (no
// top-level "rope_theta"); transformers 4 only at the top level. Both read the same base, the
// dict winning as in transformers 5; Tessera writes both keys; scaled RoPE is refused.
TEST(Llama, ConfigReadsTheRotaryBaseOfTransformers4And5) {
  const auto dir = scratch_dir("llama_rope_config");
  const std::string base = R"("model_type": "llama", "vocab_size": 10, "hidden_size": 8,
    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2)";
  auto read = [&](const std::string& extra) {
    std::ofstream(dir / "config.json") << "{" << base << extra << "}";
    return nn::llama_config_from_json_file((dir / "config.json").string());
  };
  EXPECT_EQ(
      read(R"(, "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"})").rope_theta,
      500.0);
  EXPECT_EQ(read(R"(, "rope_theta": 500.0, "rope_scaling": null)").rope_theta, 500.0);
  EXPECT_EQ(read(R"(, "rope_theta": 20.0, "rope_parameters": {"rope_theta": 500.0})").rope_theta,
            500.0);
  EXPECT_EQ(read("").rope_theta, 10000.0);
  for (const char* bad : {R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0})",
                          R"(, "rope_parameters": {"rope_type": "default", "rope_theta": "x"})",
                          R"(, "rope_parameters": 3)"}) {
    try {
      read(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rope_parameters"), std::string::npos) << e.what();
    }
  }
  nn::LlamaConfig cfg = small_config(false);
  nn::save_llama_config(cfg, (dir / "saved.json").string());
  std::ifstream in(dir / "saved.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"rope_theta\": 500.0"), std::string::npos) << text;
  EXPECT_NE(text.find("\"rope_parameters\""), std::string::npos) << text;
  EXPECT_EQ(nn::llama_config_from_json_file((dir / "saved.json").string()).rope_theta, 500.0);
}

// A Llama trains: the loss on a fixed batch falls under AdamW (GQA and tied head included).
TEST(Llama, LossFallsWhenTraining) {
  Generator gen(5);
  nn::Llama model(small_config(true), &gen);
  Tensor idx = randint(0, 97, {4, 16}, {.dtype = DType::i64}, &gen);
  Tensor targets = randint(0, 97, {4, 16}, {.dtype = DType::i64}, &gen);
  optim::AdamW opt(model.parameters(), {.lr = 3e-3});
  const double first = model.loss(idx, targets).item();
  for (int i = 0; i < 30; ++i) {
    opt.zero_grad();
    model.loss(idx, targets).backward();
    opt.step();
  }
  EXPECT_LT(model.loss(idx, targets).item(), 0.5 * first);
}

// Checkpointed layers recompute their forward inside backward, after the forward that built
// the rotary tables has returned: the gradients must equal the stored-activation run's.
TEST(Llama, GradientCheckpointingGivesTheSameGradients) {
  Generator gen(8), same(8);
  nn::Llama plain(small_config(false), &gen);
  nn::Llama checkpointed(small_config(false), &same);
  checkpointed.gradient_checkpointing_enable(true);
  Tensor idx = randint(0, 97, {3, 11}, {.dtype = DType::i64}, &gen);
  Tensor targets = randint(0, 97, {3, 11}, {.dtype = DType::i64}, &gen);
  plain.loss(idx, targets).backward();
  checkpointed.loss(idx, targets).backward();
  const auto a = plain.named_parameters(), b = checkpointed.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i].first);
    ASSERT_TRUE(b[i].second.grad().defined());
    EXPECT_EQ(a[i].second.grad().to_vector<float>(), b[i].second.grad().to_vector<float>());
  }
}

}  // namespace
