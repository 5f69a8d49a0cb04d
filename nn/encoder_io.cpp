// Model directories of the encoders: config.json with Hugging Face BertConfig /
// DistilBertConfig keys, model.safetensors with HF tensor names (the module trees mirror them,
// so the state dict is the file's contents), and the config.json reading they share
// (nn/hf_config.h).
#include <filesystem>
#include <fstream>

#include "tessera/core/safetensors.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/distilbert.h"
#include "tessera/nn/hf_config.h"

namespace tessera::nn {

namespace hf {

std::string config_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kConfigFile).string();
}
std::string weights_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kWeightsFile).string();
}

ConfigFile::ConfigFile(const std::string& path, const char* model) : path_(path), model_(model) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), model, " config: cannot open '", path, "'");
  try {
    in >> json_;
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(model, " config: '", path, "' is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(json_.is_object(), model, " config: '", path, "' is not a JSON object");
}

void ConfigFile::require_model_type(const char* type) const {
  TESSERA_CHECK(has("model_type") && at("model_type") == type, model_, " config: '", path_,
                "' has model_type ", has("model_type") ? at("model_type").dump() : "(none)",
                "; expected \"", type, "\"");
}

bool ConfigFile::has(const char* key) const { return json_.contains(key) && !at(key).is_null(); }

int64_t ConfigFile::optional_id(const char* key, int64_t fallback) const {
  if (json_.contains(key) && at(key).is_null()) return -1;
  const int64_t id = integer(key, fallback);
  refuse_unless(id >= 0, key, "must be a token id >= 0 or null");
  return id;
}

void ConfigFile::refuse_unless(bool ok, const char* key, const char* why) const {
  TESSERA_CHECK(ok, model_, " config: '", path_, "': \"", key, "\" = ",
                json_.contains(key) ? at(key).dump() : "(none)", " ", why);
}

int64_t ConfigFile::integer(const char* key, int64_t fallback) const {
  if (!has(key)) return fallback;
  refuse_unless(at(key).is_number_integer(), key, "must be an integer");
  return at(key).get<int64_t>();
}

double ConfigFile::number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  refuse_unless(at(key).is_number(), key, "must be a number");
  return at(key).get<double>();
}

bool ConfigFile::boolean(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  refuse_unless(at(key).is_boolean(), key, "must be true or false");
  return at(key).get<bool>();
}

std::string ConfigFile::string(const char* key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  refuse_unless(at(key).is_string(), key, "must be a string");
  return at(key).get<std::string>();
}

SequenceClassificationConfig ConfigFile::labels() const {
  SequenceClassificationConfig labels;
  labels.num_labels = integer("num_labels", 2);
  if (has("id2label")) {
    const nlohmann::json& names = at("id2label");
    refuse_unless(names.is_object() && !names.empty(), "id2label",
                  "must be an object of label names by id");
    labels.id2label.assign(names.size(), "");
    for (const auto& [id, name] : names.items()) {
      const size_t n = names.size();
      const bool valid = name.is_string() && !id.empty() && id.size() < 10 &&
                         id.find_first_not_of("0123456789") == std::string::npos &&
                         std::stoull(id) < n && labels.id2label[std::stoull(id)].empty();
      refuse_unless(valid, "id2label", "must name each id 0 .. n-1 once, with a string");
      labels.id2label[std::stoull(id)] = name.get<std::string>();
    }
    refuse_unless(!has("num_labels") || labels.num_labels == int64_t(names.size()), "num_labels",
                  "disagrees with the size of id2label");
    labels.num_labels = static_cast<int64_t>(names.size());
  }
  labels.problem_type = parse_problem_type(string("problem_type", ""), path_);
  try {
    labels.validate();
  } catch (const Error& e) {
    TESSERA_FAIL(model_, " config: '", path_, "': ", e.what());
  }
  return labels;
}

void write_labels(nlohmann::ordered_json& j, const SequenceClassificationConfig& labels) {
  nlohmann::ordered_json id2label = nlohmann::ordered_json::object();
  nlohmann::ordered_json label2id = nlohmann::ordered_json::object();
  for (int64_t i = 0; i < labels.num_labels; ++i) {
    id2label[std::to_string(i)] = labels.label_name(i);
    label2id[labels.label_name(i)] = i;
  }
  j["id2label"] = id2label;
  j["label2id"] = label2id;
  const std::string problem = problem_type_name(labels.problem_type);
  j["problem_type"] = problem.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(problem);
}

void write_config(const std::string& path, const nlohmann::ordered_json& j) {
  write_file_atomic(path, j.dump(2) + "\n");
}

void save_model_directory(const std::string& dir, const Module& model,
                          const std::function<void(const std::string&)>& write_config_to) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TESSERA_CHECK(!ec, model.type_name(), "::save_pretrained: cannot create '", dir, "': ",
                ec.message());
  save_safetensors(weights_path(dir), model.state_dict(), {{"format", "pt"}});
  write_config_to(config_path(dir));
}

void merge_into_config(const std::string& path, const nlohmann::ordered_json& extra) {
  std::ifstream in(path);
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(in);
  for (const auto& [key, value] : extra.items()) j[key] = value;
  write_config(path, j);
}

}  // namespace hf

namespace {
// Checkpoint tensors the encoders skip: position/token-type id buffers of older files and the
// pretraining heads (BertForPreTraining's cls.*, DistilBertForMaskedLM's vocab_* layers).
bool ignored_encoder_tensor(const std::string& name) {
  for (const char* suffix : {"embeddings.position_ids", "embeddings.token_type_ids"})
    if (name.size() >= std::string(suffix).size() &&
        name.compare(name.size() - std::string(suffix).size(), std::string::npos, suffix) == 0)
      return true;
  for (const char* prefix : {"cls.", "vocab_transform.", "vocab_layer_norm.", "vocab_projector."})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

// cfg after its validate(), whose error then names the file.
template <class Config>
Config validated(const Config& cfg, const std::string& path, const char* model) {
  try {
    cfg.validate();
  } catch (const Error& e) {
    TESSERA_FAIL(model, " config: '", path, "': ", e.what());
  }
  return cfg;
}

// The config's dropout in [0, 1), or a clear error naming the key.
double dropout_key(const hf::ConfigFile& file, const char* key, double fallback) {
  const double p = file.number(key, fallback);
  file.refuse_unless(p >= 0 && p < 1, key, "must lie in [0, 1)");
  return p;
}
}  // namespace

BertConfig bert_config_from_json_file(const std::string& path) {
  const hf::ConfigFile file(path, "BERT");
  file.require_model_type("bert");
  BertConfig cfg;
  cfg.vocab_size = file.integer("vocab_size", cfg.vocab_size);
  cfg.hidden_size = file.integer("hidden_size", cfg.hidden_size);
  cfg.num_hidden_layers = file.integer("num_hidden_layers", cfg.num_hidden_layers);
  cfg.num_attention_heads = file.integer("num_attention_heads", cfg.num_attention_heads);
  cfg.intermediate_size = file.integer("intermediate_size", cfg.intermediate_size);
  cfg.hidden_act = parse_activation(file.string("hidden_act", "gelu"), path);
  cfg.hidden_dropout_prob = dropout_key(file, "hidden_dropout_prob", cfg.hidden_dropout_prob);
  cfg.attention_probs_dropout_prob =
      dropout_key(file, "attention_probs_dropout_prob", cfg.attention_probs_dropout_prob);
  cfg.classifier_dropout = file.has("classifier_dropout") ? dropout_key(file, "classifier_dropout", 0) : -1;
  cfg.max_position_embeddings = file.integer("max_position_embeddings", cfg.max_position_embeddings);
  cfg.type_vocab_size = file.integer("type_vocab_size", cfg.type_vocab_size);
  cfg.initializer_range = file.number("initializer_range", cfg.initializer_range);
  cfg.layer_norm_eps = file.number("layer_norm_eps", cfg.layer_norm_eps);
  cfg.pad_token_id = file.optional_id("pad_token_id", cfg.pad_token_id);
  file.refuse_unless(file.string("position_embedding_type", "absolute") == "absolute",
                     "position_embedding_type", "is not supported (\"absolute\" only)");
  file.refuse_unless(!file.boolean("is_decoder", false), "is_decoder",
                     "is not supported (the encoder only)");
  cfg.labels = file.labels();
  return validated(cfg, path, "BERT");
}

void save_bert_config(const BertConfig& cfg, const std::string& path) {
  nlohmann::ordered_json j;
  j["model_type"] = "bert";
  j["architectures"] = {"BertForSequenceClassification"};
  j["vocab_size"] = cfg.vocab_size;
  j["hidden_size"] = cfg.hidden_size;
  j["num_hidden_layers"] = cfg.num_hidden_layers;
  j["num_attention_heads"] = cfg.num_attention_heads;
  j["intermediate_size"] = cfg.intermediate_size;
  j["hidden_act"] = activation_name(cfg.hidden_act);
  j["hidden_dropout_prob"] = cfg.hidden_dropout_prob;
  j["attention_probs_dropout_prob"] = cfg.attention_probs_dropout_prob;
  j["classifier_dropout"] =
      cfg.classifier_dropout >= 0 ? nlohmann::ordered_json(cfg.classifier_dropout) : nlohmann::ordered_json();
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["type_vocab_size"] = cfg.type_vocab_size;
  j["initializer_range"] = cfg.initializer_range;
  j["layer_norm_eps"] = cfg.layer_norm_eps;
  j["pad_token_id"] = hf::nullable_id(cfg.pad_token_id);
  j["position_embedding_type"] = "absolute";
  j["torch_dtype"] = "float32";
  hf::write_labels(j, cfg.labels);
  hf::write_config(path, j);
}

void BertForSequenceClassification::save_config(const std::string& path) const {
  save_bert_config(cfg_, path);
}

std::unique_ptr<BertForSequenceClassification> BertForSequenceClassification::from_pretrained(
    const std::string& dir, TensorOptions opts) {
  auto model = std::make_unique<BertForSequenceClassification>(
      bert_config_from_json_file(hf::config_path(dir)), nullptr, opts);
  model->fresh_keys_ = load_classifier_checkpoint(*model, hf::weights_path(dir), "bert.",
                                                  ignored_encoder_tensor, {"classifier."});
  return model;
}

DistilBertConfig distilbert_config_from_json_file(const std::string& path) {
  const hf::ConfigFile file(path, "DistilBERT");
  file.require_model_type("distilbert");
  DistilBertConfig cfg;
  cfg.vocab_size = file.integer("vocab_size", cfg.vocab_size);
  cfg.max_position_embeddings = file.integer("max_position_embeddings", cfg.max_position_embeddings);
  cfg.n_layers = file.integer("n_layers", cfg.n_layers);
  cfg.n_heads = file.integer("n_heads", cfg.n_heads);
  cfg.dim = file.integer("dim", cfg.dim);
  cfg.hidden_dim = file.integer("hidden_dim", cfg.hidden_dim);
  cfg.dropout = dropout_key(file, "dropout", cfg.dropout);
  cfg.attention_dropout = dropout_key(file, "attention_dropout", cfg.attention_dropout);
  cfg.seq_classif_dropout = dropout_key(file, "seq_classif_dropout", cfg.seq_classif_dropout);
  cfg.activation = parse_activation(file.string("activation", "gelu"), path);
  cfg.initializer_range = file.number("initializer_range", cfg.initializer_range);
  cfg.pad_token_id = file.optional_id("pad_token_id", cfg.pad_token_id);
  file.refuse_unless(!file.boolean("sinusoidal_pos_embds", false), "sinusoidal_pos_embds",
                     "is not supported (learned position embeddings only)");
  cfg.labels = file.labels();
  return validated(cfg, path, "DistilBERT");
}

void save_distilbert_config(const DistilBertConfig& cfg, const std::string& path) {
  nlohmann::ordered_json j;
  j["model_type"] = "distilbert";
  j["architectures"] = {"DistilBertForSequenceClassification"};
  j["vocab_size"] = cfg.vocab_size;
  j["max_position_embeddings"] = cfg.max_position_embeddings;
  j["sinusoidal_pos_embds"] = false;
  j["n_layers"] = cfg.n_layers;
  j["n_heads"] = cfg.n_heads;
  j["dim"] = cfg.dim;
  j["hidden_dim"] = cfg.hidden_dim;
  j["dropout"] = cfg.dropout;
  j["attention_dropout"] = cfg.attention_dropout;
  j["seq_classif_dropout"] = cfg.seq_classif_dropout;
  j["activation"] = activation_name(cfg.activation);
  j["initializer_range"] = cfg.initializer_range;
  j["pad_token_id"] = hf::nullable_id(cfg.pad_token_id);
  j["torch_dtype"] = "float32";
  hf::write_labels(j, cfg.labels);
  hf::write_config(path, j);
}

void DistilBertForSequenceClassification::save_config(const std::string& path) const {
  save_distilbert_config(cfg_, path);
}

std::unique_ptr<DistilBertForSequenceClassification>
DistilBertForSequenceClassification::from_pretrained(const std::string& dir, TensorOptions opts) {
  auto model = std::make_unique<DistilBertForSequenceClassification>(
      distilbert_config_from_json_file(hf::config_path(dir)), nullptr, opts);
  model->fresh_keys_ = load_classifier_checkpoint(*model, hf::weights_path(dir), "distilbert.",
                                                  ignored_encoder_tensor,
                                                  {"pre_classifier.", "classifier."});
  return model;
}

}  // namespace tessera::nn
