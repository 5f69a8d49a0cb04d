#include "tessera/train/run_checks.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace tessera::train {

namespace fs = std::filesystem;
using Json = nlohmann::json;

void check_training_file_size(const data::TokenFile& file, const TrainingArguments& args) {
  const std::string name = "tessera train: training file '" + file.path().string() + "'";
  TESSERA_CHECK(file.size() > 0, name, " is empty (0 tokens); prepare it from a non-empty text");
  const int64_t batch = args.per_device_train_batch_size, needed = batch * args.seq + 1;
  TESSERA_CHECK(file.size() >= needed, name, " holds ", file.size(),
                " tokens, fewer than one micro-batch takes: batch ", batch, " x seq ", args.seq,
                " + 1 target = ", needed, " tokens; use a longer file or a smaller --batch/--seq");
}

namespace {

// The model-shape settings (training_args.h's names) of a model directory's config.json.
Json shape_of_model_directory(const fs::path& dir) {
  const std::string config = (dir / "config.json").string();
  TESSERA_CHECK(fs::exists(config), "model directory '", dir.string(), "': config.json is missing");
  if (nn::model_type_of(config) == "llama") {
    const nn::LlamaConfig c = nn::llama_config_from_json_file(config);
    return {{"arch", "llama"},
            {"n_layer", c.num_hidden_layers},
            {"n_head", c.num_attention_heads},
            {"n_embd", c.hidden_size},
            {"n_kv_head", c.num_key_value_heads},
            {"intermediate_size", c.intermediate_size},
            {"rope_theta", c.rope_theta},
            {"block_size", c.max_position_embeddings},
            {"vocab_size", c.vocab_size},
            {"tie_word_embeddings", c.tie_word_embeddings}};
  }
  const nn::GPTConfig g = nn::gpt_config_from_json_file(config);
  return {{"arch", "gpt2"},          {"n_layer", g.n_layer},       {"n_head", g.n_head},
          {"n_embd", g.n_embd},      {"block_size", g.block_size}, {"vocab_size", g.vocab_size},
          {"tie_word_embeddings", g.tie_word_embeddings}};
}

}  // namespace

void check_init_shape(const TrainingArguments& args) {
  if (args.init.empty()) return;
  const Json from_dir = shape_of_model_directory(args.init);
  const Json requested = args.to_json();
  for (const std::string& key : model_shape_keys()) {
    if (!args.given.count(key) || key == "init") continue;
    TESSERA_CHECK(from_dir.contains(key), args.describe(key), " is ", requested[key].dump(), " but the --init model '",
                  args.init, "' is a ", from_dir["arch"].get<std::string>(), ", which has no such setting");
    TESSERA_CHECK(requested[key] == from_dir[key], args.describe(key), " is ", requested[key].dump(),
                  " but the --init model '", args.init, "' has ", from_dir[key].dump(),
                  "; leave it out (the model's shape comes from its directory), or start a fresh model");
  }
}

int64_t estimated_parameters(const TrainingArguments& a, int64_t vocab_size) {
  // In doubles, so that absurd sizes give a huge number rather than a wrapped one.
  const double C = static_cast<double>(a.n_embd), V = static_cast<double>(vocab_size);
  const double L = static_cast<double>(a.n_layer);
  const double T = static_cast<double>(a.block_size > 0 ? a.block_size : a.seq);
  const double head = a.tie_word_embeddings ? 0 : V * C;
  double total = 0;
  if (a.arch == "llama") {
    const double kv_heads = static_cast<double>(a.n_kv_head > 0 ? a.n_kv_head : a.n_head);
    const double kv = kv_heads * C / static_cast<double>(std::max<int64_t>(1, a.n_head));
    const double mlp = 3 * C * static_cast<double>(a.llama_intermediate_size());
    total = V * C + L * (2 * C * C + 2 * C * kv + mlp + 2 * C) + C + head;
  } else {
    total = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C + head;
  }
  return total >= 9.2e18 ? INT64_MAX : static_cast<int64_t>(total);
}

double estimated_training_bytes(const TrainingArguments& a, int64_t parameters, int64_t vocab_size) {
  const double logits = static_cast<double>(a.per_device_train_batch_size) * static_cast<double>(a.seq) *
                        static_cast<double>(vocab_size) * 4;
  return static_cast<double>(parameters) * 16 + logits;
}

void check_fits_in_memory(const TrainingArguments& a, int64_t parameters, int64_t vocab_size) {
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  if (!(memory > 0)) return;
  // On a GPU only the f32 weights are built in host memory first.
  const bool on_host = Device::parse(a.device).is_cpu();
  const double needed = on_host ? estimated_training_bytes(a, parameters, vocab_size) : 4.0 * static_cast<double>(parameters);
  const double gib = double(1 << 30);
  char text[256];
  std::snprintf(text, sizeof(text), "%.4g GiB (%lld parameters%s) but this machine has %.1f GiB of memory",
                needed / gib, static_cast<long long>(parameters),
                on_host ? " x 16 bytes for weights, gradients and AdamW, plus one micro-batch's logits" : " x 4 bytes",
                memory / gib);
  TESSERA_CHECK(needed <= memory, "tessera train: the model and batch need at least ", text,
                "; choose fewer/smaller layers (n_layer ", a.n_layer, ", n_embd ", a.n_embd, ") or a smaller batch (",
                a.per_device_train_batch_size, " x ", a.seq, " tokens)");
}

std::string data_fingerprint(const data::TokenFile& file) {
  std::ifstream in(file.path(), std::ios::binary);
  std::vector<char> chunk(size_t(1) << 20);
  uint32_t crc = 0;
  int64_t bytes = 0;
  while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
    crc = crc32(
        std::as_bytes(std::span<const char>(chunk.data(), static_cast<size_t>(in.gcount()))), crc);
    bytes += in.gcount();
  }
  return Json{{"path", file.path().string()}, {"bytes", bytes}, {"crc32", crc}}.dump(1);
}

void warn_if_data_replaced(const fs::path& checkpoint, const std::string& fingerprint) {
  const fs::path recorded_path = checkpoint / kDataFingerprintFile;
  if (!fs::exists(recorded_path)) return;  // written before fingerprints were recorded
  const Json then = Json::parse(read_file(recorded_path), nullptr, false);
  const Json now = Json::parse(fingerprint);
  if (!then.is_object() || (then.value("bytes", Json()) == now["bytes"] && then.value("crc32", Json()) == now["crc32"]))
    return;
  std::fprintf(stderr,
               "tessera train: warning: the training file '%s' is not the one the checkpoint was "
               "trained on ('%s': %s bytes, CRC-32 %s then; %s bytes, CRC-32 %s now); the run will "
               "not match an uninterrupted one\n",
               now["path"].get<std::string>().c_str(), then.value("path", std::string("?")).c_str(),
               then.value("bytes", Json()).dump().c_str(), then.value("crc32", Json()).dump().c_str(),
               now["bytes"].dump().c_str(), now["crc32"].dump().c_str());
}

namespace {
void check_tensor_finite(const std::string& name, const Tensor& tensor, const std::string& what) {
  const std::vector<float> values = tensor.to(Device::cpu(), DType::f32).contiguous().to_vector<float>();
  for (size_t i = 0; i < values.size(); ++i)
    TESSERA_CHECK(std::isfinite(values[i]), what, " hold ", values[i], " in '", name, "' (element ", i, " of ",
                  values.size(), "): the weights are damaged or diverged");
}
}  // namespace

void check_weights_finite(const nn::CausalLM& model, const std::string& what) {
  for (const auto& [name, tensor] : model.named_parameters()) check_tensor_finite(name, tensor, what);
}

void check_weights_finite(const std::filesystem::path& weights_file, const std::string& what) {
  const SafetensorsContents file = load_safetensors(weights_file.string(), {.memory_map = true});
  for (const auto& [name, tensor] : file.tensors)
    if (is_floating(tensor.dtype())) check_tensor_finite(name, tensor, what);
}

}  // namespace tessera::train
