#include "tessera/nn/causal_lm.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace tessera::nn {

std::string model_type_of(const std::string& config_path) {
  std::ifstream in(config_path);
  TESSERA_CHECK(in.good(), "model config: cannot open '", config_path, "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("model config: '", config_path, "' is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(j.is_object(), "model config: '", config_path, "' is not a JSON object");
  // GPT-2 files written before model_type existed carry none: GPT's reader accepts them.
  if (!j.contains("model_type")) return "gpt2";
  TESSERA_CHECK(j["model_type"].is_string(), "model config: '", config_path,
                "': \"model_type\" must be a string, got ", j["model_type"].dump());
  return j["model_type"].get<std::string>();
}

std::unique_ptr<CausalLM> load_causal_lm(const std::string& dir, TensorOptions opts) {
  const std::string type = model_type_of(dir + "/config.json");
  if (type == "gpt2") return GPT::from_pretrained(dir, opts);
  if (type == "llama") return Llama::from_pretrained(dir, opts);
  TESSERA_FAIL("model directory '", dir, "': model_type \"", type,
               "\" is not supported (expected \"gpt2\" or \"llama\")");
}

}  // namespace tessera::nn
