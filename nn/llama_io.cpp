// Llama model directories: config.json with Hugging Face Llama keys and model.safetensors
// with LlamaForCausalLM's tensor names (the module tree mirrors them, so the state dict is
// the file's contents).
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/core/safetensors.h"
#include "tessera/nn/llama.h"

namespace tessera::nn {

namespace {
constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

nlohmann::json read_json_object(const std::string& path) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), "Llama config: cannot open '", path, "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("Llama config: '", path, "' is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(j.is_object(), "Llama config: '", path, "' is not a JSON object");
  return j;
}
// The rotary settings. transformers 4 writes a top-level "rope_theta" and "rope_scaling"
// (null for plain RoPE); transformers 5 writes "rope_parameters": {"rope_type": "default",
// "rope_theta": ...} and no top-level "rope_theta" (reading the old keys too). As there, the
// dict's rope_theta wins over the top-level one. Scaled RoPE (linear, dynamic, yarn, llama3,
// ...) is refused, naming the key.
void read_rope_parameters(const nlohmann::json& j, const std::string& path, LlamaConfig& cfg) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const nlohmann::json& rope = j[key];
    TESSERA_CHECK(rope.is_object(), "Llama config: '", path, "': \"", key,
                  "\" must be an object or null, got ", rope.dump());
    const nlohmann::json type = rope.contains("rope_type") ? rope["rope_type"]
                                : rope.contains("type")    ? rope["type"]
                                                           : nlohmann::json("default");
    TESSERA_CHECK(type == "default", "Llama config: '", path, "': \"", key, "\" = ", rope.dump(),
                  " is not supported (plain RoPE only: rope_type \"default\")");
    if (rope.contains("rope_theta") && !rope["rope_theta"].is_null()) {
      TESSERA_CHECK(rope["rope_theta"].is_number(), "Llama config: '", path, "': \"", key,
                    "\".rope_theta must be a number, got ", rope["rope_theta"].dump());
      cfg.rope_theta = rope["rope_theta"].get<double>();
    }
  }
}
}  // namespace

LlamaConfig llama_config_from_json_file(const std::string& path) {
  const nlohmann::json j = read_json_object(path);
  TESSERA_CHECK(j.contains("model_type") && j["model_type"] == "llama", "Llama config: '", path,
                "' has model_type ", j.contains("model_type") ? j["model_type"].dump() : "(none)",
                "; expected \"llama\"");
  LlamaConfig cfg;
  auto read_int = [&](const char* key, int64_t& field, bool required) {
    if (!j.contains(key) || j[key].is_null()) {
      TESSERA_CHECK(!required, "Llama config: '", path, "' lacks \"", key, "\"");
      return;
    }
    TESSERA_CHECK(j[key].is_number_integer(), "Llama config: '", path, "': \"", key,
                  "\" must be an integer, got ", j[key].dump());
    field = j[key].get<int64_t>();
  };
  auto read_number = [&](const char* key, double& field) {
    if (!j.contains(key) || j[key].is_null()) return;
    TESSERA_CHECK(j[key].is_number(), "Llama config: '", path, "': \"", key,
                  "\" must be a number, got ", j[key].dump());
    field = j[key].get<double>();
  };
  read_int("vocab_size", cfg.vocab_size, true);
  read_int("hidden_size", cfg.hidden_size, true);
  read_int("intermediate_size", cfg.intermediate_size, true);
  read_int("num_hidden_layers", cfg.num_hidden_layers, true);
  read_int("num_attention_heads", cfg.num_attention_heads, true);
  cfg.num_key_value_heads = cfg.num_attention_heads;  // HF's default when the key is absent
  read_int("num_key_value_heads", cfg.num_key_value_heads, false);
  read_int("head_dim", cfg.head_dim, false);
  read_int("max_position_embeddings", cfg.max_position_embeddings, false);
  read_number("rms_norm_eps", cfg.rms_norm_eps);
  read_number("rope_theta", cfg.rope_theta);
  read_number("initializer_range", cfg.initializer_range);
  read_rope_parameters(j, path, cfg);
  if (j.contains("tie_word_embeddings"))
    cfg.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  auto refuse_if = [&](const char* key, bool bad, const char* why) {
    TESSERA_CHECK(!bad, "Llama config: '", path, "': \"", key, "\" = ", j[key].dump(),
                  " is not supported (", why, ")");
  };
  if (j.contains("hidden_act")) refuse_if("hidden_act", j["hidden_act"] != "silu", "SiLU only");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (j.contains(key)) refuse_if(key, j[key] != false, "projections without bias only");
  }
  try {
    cfg.validate();
  } catch (const Error& e) {
    TESSERA_FAIL("Llama config: '", path, "': ", e.what());
  }
  return cfg;
}

void save_llama_config(const LlamaConfig& cfg, const std::string& path) {
  nlohmann::ordered_json j;
  j["model_type"] = "llama";
  j["architectures"] = {"LlamaForCausalLM"};
  j["vocab_size"] = cfg.vocab_size;
  j["hidden_size"] = cfg.hidden_size;
  j["intermediate_size"] = cfg.intermediate_size;
  j["num_hidden_layers"] = cfg.num_hidden_layers;
  j["num_attention_heads"] = cfg.num_attention_heads;
  j["num_key_value_heads"] = cfg.num_key_value_heads;
  j["head_dim"] = cfg.attention_head_dim();
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["rms_norm_eps"] = cfg.rms_norm_eps;
  // The rotary base under both versions' keys (see read_rope_parameters).
  j["rope_theta"] = cfg.rope_theta;
  j["rope_scaling"] = nullptr;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", cfg.rope_theta}};
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["tie_word_embeddings"] = cfg.tie_word_embeddings;
  j["initializer_range"] = cfg.initializer_range;
  j["torch_dtype"] = "float32";
  write_file_atomic(path, j.dump(2) + "\n");
}

void Llama::save_pretrained(const std::string& dir) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(!ec, "Llama::save_pretrained: cannot create '", dir, "': ", ec.message());
  save_safetensors((std::filesystem::path(dir) / kWeightsFile).string(), state_dict(),
                   {{"format", "pt"}});
  save_llama_config(cfg_, (std::filesystem::path(dir) / kConfigFile).string());
}

void Llama::load_safetensors_weights(const std::string& path) {
  const SafetensorsContents file = load_safetensors(path);
  LoadStateDictOptions opts;
  const bool tied = cfg_.tie_word_embeddings;
  opts.ignore = [tied](const std::string& key) {
    return ends_with(key, ".rotary_emb.inv_freq") || (tied && key == "lm_head.weight");
  };
  try {
    load_state_dict(file.tensors, opts);
  } catch (const Error& e) {
    TESSERA_FAIL("Llama: loading '", path, "': ", e.what());
  }
}

std::unique_ptr<Llama> Llama::from_pretrained(const std::string& dir, TensorOptions opts) {
  const auto base = std::filesystem::path(dir);
  const LlamaConfig cfg = llama_config_from_json_file((base / kConfigFile).string());
  auto model = std::make_unique<Llama>(cfg, nullptr, opts);
  model->load_safetensors_weights((base / kWeightsFile).string());
  return model;
}

}  // namespace tessera::nn
