#include "tessera/nn/causal_lm.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/autograd/functions.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace tessera::nn {

std::pair<Tensor, Tensor> KVCache::Layer::append(const Tensor& k_new, const Tensor& v_new,
                                                 int64_t past) {
  const int64_t T = k_new.size(2);
  TESSERA_CHECK(past >= 0 && past + T <= k.size(2), "KVCache: the cache holds ", k.size(2),
                " positions; cannot add ", T, " after ", past);
  ops::copy_(ops::narrow(k, 2, past, T), k_new);
  ops::copy_(ops::narrow(v, 2, past, T), v_new);
  return {ops::narrow(k, 2, 0, past + T), ops::narrow(v, 2, 0, past + T)};
}

KVCache make_kv_cache(int64_t layers, const Shape& shape, TensorOptions opts) {
  TESSERA_CHECK(shape.size() == 4 && shape[0] > 0, "make_kv_cache: batch must be > 0, got ",
                shape.empty() ? 0 : shape[0]);
  KVCache cache;
  cache.batch = shape[0];
  for (int64_t i = 0; i < layers; ++i)
    cache.layers.push_back({zeros(shape, opts), zeros(shape, opts)});
  return cache;
}

const char* block_implementation_name(BlockImplementation implementation) {
  switch (implementation) {
    case BlockImplementation::automatic:
      return "automatic";
    case BlockImplementation::reference:
      return "reference";
    case BlockImplementation::fast:
      return "fast";
  }
  return "?";
}

BlockImplementation parse_block_implementation(const std::string& name) {
  for (BlockImplementation b :
       {BlockImplementation::automatic, BlockImplementation::reference, BlockImplementation::fast})
    if (name == block_implementation_name(b)) return b;
  TESSERA_FAIL("block implementation \"", name,
               "\" is not one of \"automatic\", \"reference\", \"fast\"");
}

BlockImplementation chosen_block_implementation(BlockImplementation requested) {
  return requested == BlockImplementation::automatic ? BlockImplementation::fast : requested;
}

void CausalLM::gradient_checkpointing_enable(const CheckpointPolicy& policy) {
  policy.check_model(num_blocks());
  checkpointing_ = policy;
}

CheckpointRegion CausalLM::checkpoint_region(int64_t index, const Module& body) const {
  if (!checkpointing_.enabled() || !body.is_training() || !autograd::is_grad_enabled())
    return CheckpointRegion::none;
  return checkpointing_.region(index);
}

Tensor CausalLM::generate(const Tensor& idx, int64_t max_new_tokens, const GenerateOptions& opts) {
  NoGradGuard no_grad;
  TESSERA_CHECK(idx.dim() == 2 && idx.size(1) > 0 && max_new_tokens >= 0, type_name(),
                "::generate: idx must be [B, T] with T > 0 (got ", shape_str(idx.shape()),
                ") and max_new_tokens >= 0 (got ", max_new_tokens, ")");
  const std::vector<Tensor> params = parameters();
  TESSERA_CHECK(!params.empty(), type_name(), "::generate: the model has no parameters");
  const int64_t context = context_length();
  KVCache cache = make_kv_cache(idx.size(0));
  // Sampled where the logits are: the tokens stay on the device until the end.
  Tensor tokens = ops::to(idx, params.front().device(), DType::i64);
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t length = tokens.size(1);
    // Past the context the positions shift every step, so the last window is recomputed.
    const Tensor logits =
        length <= context ? forward_incremental(
                                ops::narrow(tokens, 1, cache.length, length - cache.length), cache)
                          : forward(ops::narrow(tokens, 1, length - context, context));
    const Tensor last = ops::select(logits, 1, logits.size(1) - 1);
    const Tensor next = ops::sample_logits(last, opts.temperature, opts.top_k, opts.gen);
    tokens = ops::cat({tokens, ops::unsqueeze(next, 1)}, 1);
  }
  return ops::to(tokens, Device::cpu(), DType::i64);
}

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
