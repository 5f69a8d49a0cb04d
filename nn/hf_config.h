// Internal to nn/ (the encoder and classification models' I/O): Hugging Face config.json
// files read with errors that name the file and the key, the label keys every
// *ForSequenceClassification config carries, and model directories written in one place.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "tessera/nn/encoder.h"

namespace tessera::nn::hf {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kWeightsFile = "model.safetensors";
std::string config_path(const std::string& dir);
std::string weights_path(const std::string& dir);

// A parsed config.json. Absent and null keys read as the fallback (HF's class default: a
// config it saved may leave defaults out); a value of the wrong type
// raises naming `model`, the file and the key.
class ConfigFile {
 public:
  ConfigFile(const std::string& path, const char* model);
  // Raises unless "model_type" is `type`.
  void require_model_type(const char* type) const;
  bool has(const char* key) const;
  int64_t integer(const char* key, int64_t fallback) const;
  // A token id that may be null (-1): explicit null -> -1, absent -> fallback.
  int64_t optional_id(const char* key, int64_t fallback) const;
  double number(const char* key, double fallback) const;
  bool boolean(const char* key, bool fallback) const;
  std::string string(const char* key, const std::string& fallback) const;
  // num_labels from "id2label" (keys "0" .. "n-1") or "num_labels" (2 when neither is given),
  // and "problem_type".
  SequenceClassificationConfig labels() const;
  // Raises naming the key when `ok` is false: "<model> config: '<path>': \"key\" = <value> ...".
  void refuse_unless(bool ok, const char* key, const char* why) const;
  const std::string& path() const { return path_; }

 private:
  const nlohmann::json& at(const char* key) const { return json_[key]; }
  std::string path_;
  const char* model_;
  nlohmann::json json_;
};

// A token id, or null for -1.
inline nlohmann::ordered_json nullable_id(int64_t id) {
  return id >= 0 ? nlohmann::ordered_json(id) : nlohmann::ordered_json();
}
// id2label, label2id and problem_type (null when unspecified) as HF writes them.
void write_labels(nlohmann::ordered_json& j, const SequenceClassificationConfig& labels);
// j as a config.json at path (written atomically).
void write_config(const std::string& path, const nlohmann::ordered_json& j);
// dir (created) with model.safetensors from the model's state dict and config.json written by
// write_config_to(its path).
void save_model_directory(const std::string& dir, const Module& model,
                          const std::function<void(const std::string&)>& write_config_to);
// A config.json of another writer (save_gpt_config, save_llama_config) with `extra`'s keys set.
void merge_into_config(const std::string& path, const nlohmann::ordered_json& extra);

}  // namespace tessera::nn::hf
