// GPT model directories: config.json with Hugging Face GPT-2 keys and
// model.safetensors with HF GPT-2 tensor names.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/core/safetensors.h"
#include "tessera/nn/gpt.h"

namespace tessera::nn {

namespace {
constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

GPTConfig gpt_config_from_json_file(const std::string& path) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), "GPT config: cannot open '", path, "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("GPT config: '", path, "' is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(j.is_object(), "GPT config: '", path, "' is not a JSON object");
  if (j.contains("model_type"))
    TESSERA_CHECK(j["model_type"] == "gpt2", "GPT config: '", path, "' has model_type ",
                  j["model_type"].dump(), "; only \"gpt2\" is supported");
  GPTConfig cfg;
  auto read_int = [&](const char* key, int64_t& field, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      TESSERA_CHECK(!required, "GPT config: '", path, "' lacks \"", key, "\"");
      return;
    }
    TESSERA_CHECK(j[key].is_number_integer(), "GPT config: '", path, "': \"", key,
                  "\" must be an integer, got ", j[key].dump());
    field = j[key].get<int64_t>();
  };
  read_int("vocab_size", cfg.vocab_size, true);
  read_int("n_positions", cfg.block_size, true);
  read_int("n_layer", cfg.n_layer, true);
  read_int("n_head", cfg.n_head, true);
  read_int("n_embd", cfg.n_embd, true);
  if (j.contains("layer_norm_epsilon")) cfg.layer_norm_epsilon = j["layer_norm_epsilon"].get<double>();
  if (j.contains("tie_word_embeddings"))
    cfg.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  if (j.contains("bias")) cfg.bias = j["bias"].get<bool>();
  if (j.contains("resid_pdrop") && j["resid_pdrop"].is_number())
    cfg.dropout = j["resid_pdrop"].get<double>();
  if (j.contains("activation_function")) {
    const auto act = j["activation_function"].get<std::string>();
    TESSERA_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", "GPT config: '", path,
                  "': activation_function \"", act, "\" is not supported (tanh GELU only)");
  }
  try {
    cfg.validate();
  } catch (const Error& e) {
    TESSERA_FAIL("GPT config: '", path, "': ", e.what());
  }
  return cfg;
}

void save_gpt_config(const GPTConfig& cfg, const std::string& path) {
  nlohmann::ordered_json j;
  j["model_type"] = "gpt2";
  j["architectures"] = {"GPT2LMHeadModel"};
  j["vocab_size"] = cfg.vocab_size;
  j["n_positions"] = cfg.block_size;
  j["n_ctx"] = cfg.block_size;
  j["n_embd"] = cfg.n_embd;
  j["n_layer"] = cfg.n_layer;
  j["n_head"] = cfg.n_head;
  j["n_inner"] = nullptr;
  j["layer_norm_epsilon"] = cfg.layer_norm_epsilon;
  j["tie_word_embeddings"] = cfg.tie_word_embeddings;
  j["activation_function"] = "gelu_new";
  j["resid_pdrop"] = cfg.dropout;
  j["embd_pdrop"] = cfg.dropout;
  j["attn_pdrop"] = cfg.dropout;
  j["initializer_range"] = 0.02;
  j["bias"] = cfg.bias;
  write_file_atomic(path, j.dump(2) + "\n");
}

void GPT::save_pretrained(const std::string& dir) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(!ec, "GPT::save_pretrained: cannot create '", dir, "': ", ec.message());
  NamedTensors tensors = state_dict();
  save_safetensors((std::filesystem::path(dir) / kWeightsFile).string(), tensors,
                   {{"format", "pt"}});
  save_gpt_config(cfg_, (std::filesystem::path(dir) / kConfigFile).string());
}

void GPT::load_safetensors_weights(const std::string& path) {
  const SafetensorsContents file = load_safetensors(path);
  // Files of HF's bare GPT2Model name tensors without the "transformer." prefix.
  const bool has_prefix = std::any_of(file.tensors.begin(), file.tensors.end(), [](const auto& e) {
    return e.first.rfind("transformer.", 0) == 0;
  });
  std::map<std::string, Tensor> state;
  for (const auto& [name, t] : file.tensors) {
    const bool is_head = name == "lm_head.weight";
    state[has_prefix || is_head ? name : "transformer." + name] = t;
  }
  LoadStateDictOptions opts;
  const bool tied = cfg_.tie_word_embeddings;
  opts.ignore = [tied](const std::string& key) {
    return ends_with(key, ".attn.bias") || ends_with(key, ".attn.masked_bias") ||
           (tied && key == "lm_head.weight");
  };
  try {
    load_state_dict(state, opts);
  } catch (const Error& e) {
    TESSERA_FAIL("GPT: loading '", path, "': ", e.what());
  }
}

std::unique_ptr<GPT> GPT::from_pretrained(const std::string& dir, TensorOptions opts) {
  const auto base = std::filesystem::path(dir);
  const GPTConfig cfg = gpt_config_from_json_file((base / kConfigFile).string());
  auto model = std::make_unique<GPT>(cfg, nullptr, opts);
  model->load_safetensors_weights((base / kWeightsFile).string());
  return model;
}

}  // namespace tessera::nn
