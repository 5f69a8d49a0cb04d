// GPT model directories: config.json with Hugging Face GPT-2 keys and
// model.safetensors with HF GPT-2 tensor names.
#include <algorithm>
#include <cctype>
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

// Upper bounds far above any model Tessera can train, so that a damaged or hostile
// config.json fails here, naming the key, instead of in a huge allocation.
struct SizeLimit {
  const char* key;
  int64_t GPTConfig::*field;
  int64_t max;
};
constexpr SizeLimit kSizeLimits[] = {
    {"vocab_size", &GPTConfig::vocab_size, int64_t{1} << 31},  // token ids are 32-bit
    {"n_positions", &GPTConfig::block_size, int64_t{1} << 24},
    {"n_layer", &GPTConfig::n_layer, int64_t{1} << 14},
    {"n_head", &GPTConfig::n_head, int64_t{1} << 20},
    {"n_embd", &GPTConfig::n_embd, int64_t{1} << 20},
};

// The sizes config.json states against the tensors model.safetensors holds, checked
// before the model is built: a config that disagrees with its weights is refused naming
// the key, instead of allocating what the config asks for and failing (or not) after.
void check_config_matches_weights(const GPTConfig& cfg, const std::string& config_path,
                                  const SafetensorsContents& weights) {
  const bool has_prefix = std::any_of(weights.tensors.begin(), weights.tensors.end(), [](const auto& e) {
    return e.first.rfind("transformer.", 0) == 0;
  });
  const std::string prefix = has_prefix ? "transformer." : "";
  auto shape_of = [&](const std::string& name) {
    auto it = weights.tensors.find(prefix + name);
    TESSERA_CHECK(it != weights.tensors.end(), "GPT: '", weights.path, "' has no tensor ", prefix + name);
    TESSERA_CHECK(it->second.dim() == 2, "GPT: '", weights.path, "': ", prefix + name, " has shape ",
                  shape_str(it->second.shape()), ", expected 2 dimensions");
    return it->second.shape();
  };
  auto check = [&](const char* key, int64_t stated, int64_t held, const std::string& tensor, const Shape& shape) {
    TESSERA_CHECK(stated == held, "GPT config: '", config_path, "': \"", key, "\" is ", stated, " but '",
                  weights.path, "' holds ", prefix + tensor, " of shape ", shape_str(shape), " (", key, " ",
                  held, ")");
  };
  const Shape wte = shape_of("wte.weight"), wpe = shape_of("wpe.weight");
  check("vocab_size", cfg.vocab_size, wte[0], "wte.weight", wte);
  check("n_embd", cfg.n_embd, wte[1], "wte.weight", wte);
  check("n_positions", cfg.block_size, wpe[0], "wpe.weight", wpe);
  check("n_embd", cfg.n_embd, wpe[1], "wpe.weight", wpe);
  // Layers are h.0 .. h.{n-1}: the highest index present says how many the file holds.
  int64_t layers = 0;
  const std::string layer_prefix = prefix + "h.";
  for (const auto& [name, tensor] : weights.tensors) {
    if (name.rfind(layer_prefix, 0) != 0) continue;
    const size_t end = name.find('.', layer_prefix.size());
    const std::string index = name.substr(layer_prefix.size(), end - layer_prefix.size());
    if (!index.empty() && index.size() < 10 && std::all_of(index.begin(), index.end(), ::isdigit))
      layers = std::max<int64_t>(layers, std::stoll(index) + 1);
  }
  TESSERA_CHECK(cfg.n_layer == layers, "GPT config: '", config_path, "': \"n_layer\" is ", cfg.n_layer, " but '",
                weights.path, "' holds ", layers, " layer(s) (", layer_prefix, "0 .. ", layer_prefix, layers - 1,
                ")");
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
  for (const SizeLimit& limit : kSizeLimits)
    TESSERA_CHECK(cfg.*limit.field <= limit.max, "GPT config: '", path, "': \"", limit.key, "\" is ",
                  cfg.*limit.field, ", above the limit of ", limit.max);
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
  const std::string config_path = (base / kConfigFile).string();
  const GPTConfig cfg = gpt_config_from_json_file(config_path);
  // Mapping the weights reads only their header; nothing is allocated before the check.
  check_config_matches_weights(cfg, config_path, load_safetensors((base / kWeightsFile).string()));
  auto model = std::make_unique<GPT>(cfg, nullptr, opts);
  model->load_safetensors_weights((base / kWeightsFile).string());
  return model;
}

}  // namespace tessera::nn
