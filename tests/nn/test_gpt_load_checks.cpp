// Issue 14, defect 4: GPT::from_pretrained checks config.json's sizes against the tensors
// in model.safetensors before it builds (allocates) the model, in Tessera's layout and in
// the prefix-less one of older Hugging Face files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/nn.h"

using namespace tessera;

namespace {

std::string load_error(const std::filesystem::path& dir) {
  try {
    nn::GPT::from_pretrained(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded)";
}

// Writes `config` with `key` set to `value` as the directory's config.json.
void write_config_with(const std::filesystem::path& dir, nlohmann::json config,
                       const std::string& key, int64_t value) {
  config[key] = value;
  std::ofstream(dir / "config.json", std::ios::trunc) << config.dump(2);
}

}  // namespace

TEST(GPTLoadChecks, ConfigSizesMustMatchAPrefixlessHuggingFaceFile) {
  const auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "gpt_load_checks";
  std::filesystem::remove_all(dir);
  Generator gen(5);
  const nn::GPTConfig cfg{
      .vocab_size = 37, .block_size = 11, .n_layer = 3, .n_head = 2, .n_embd = 6};
  nn::GPT model(cfg, &gen);
  model.save_pretrained(dir.string());
  // Rewrite the weights as older transformers files name them: no "transformer." prefix,
  // plus the attention mask buffers.
  std::vector<std::pair<std::string, Tensor>> hf;
  for (auto& [name, t] : model.state_dict())
    hf.emplace_back(name.substr(std::string("transformer.").size()), t);
  for (int layer = 0; layer < 3; ++layer)
    hf.emplace_back("h." + std::to_string(layer) + ".attn.bias", ones({1, 1, 11, 11}));
  save_safetensors((dir / "model.safetensors").string(), hf);
  const nlohmann::json config = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  auto loaded = nn::GPT::from_pretrained(dir.string());
  const Tensor idx = randint(0, 37, {2, 11}, {.dtype = DType::i64}, &gen);
  EXPECT_EQ(ops::max_rel_error(loaded->forward(idx), model.forward(idx)), 0.0);

  const std::vector<std::tuple<std::string, int64_t, std::string>> cases = {
      {"n_layer", 4, "holds 3 layer(s) (h.0 .. h.2)"},
      {"n_layer", 2, "holds 3 layer(s)"},
      {"n_embd", 8, "wte.weight of shape [37, 6]"},
      {"vocab_size", 40, "wte.weight of shape [37, 6]"},
      {"n_positions", 12, "wpe.weight of shape [11, 6]"},
      {"n_layer", 1000000, "above the limit"},
      {"n_embd", int64_t{1} << 31, "above the limit"},
      {"vocab_size", int64_t{1} << 40, "above the limit"},
  };
  for (const auto& [key, value, fragment] : cases) {
    write_config_with(dir, config, key, value);
    const std::string msg = load_error(dir);
    EXPECT_NE(msg.find("\"" + key + "\" is " + std::to_string(value)), std::string::npos) << msg;
    EXPECT_NE(msg.find((dir / "config.json").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
}
