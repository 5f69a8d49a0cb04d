// The settings of `tessera train`: read from a config file (JSON, or a flat YAML subset
// of `key: value` lines), overridden by command-line flags, checked before training.
// Keys are the flag names without the dashes, with '-' or '_' ("n-layer" = "n_layer").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::train {

struct TrainConfig {
  // data
  std::string data;      // training token file
  std::string val_data;  // validation token file ("" = val.bin beside `data` when present)
  // model: shape, or a model directory to start from
  std::string init;
  int64_t n_layer = 4, n_head = 4, n_embd = 128;
  int64_t block_size = 0;  // 0 = seq
  int64_t vocab_size = 0;  // 0 = from the tokenizer beside the data, else the data itself
  // batches
  int64_t batch = 8, seq = 64, grad_accum = 1;
  bool shuffle = false;
  std::string sampling = "windows";  // windows | random (nanoGPT's random-offset windows)
  // regularisation and memory
  double dropout = 0;                   // embedding, attention and residual dropout
  bool gradient_checkpointing = false;  // recompute each block in backward
  // optimisation
  int64_t steps = 200;
  double lr = 1e-3;
  double min_lr = -1;  // < 0: lr / 10
  int64_t warmup = 0;
  std::string schedule = "cosine";
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.99, eps = 1e-8, grad_clip = 1.0;
  int64_t seed = 1337;
  std::string device = "cpu";
  std::string dtype = "fp32";
  // monitoring and checkpoints
  int64_t eval_every = 0;  // 0 = only at the end
  int64_t eval_batches = 8;
  int64_t sample_every = 0;  // 0 = never
  int64_t save_every = 0;    // 0 = only at the end
  int64_t keep_last = 3;
  std::string out = "runs/train";
  std::string resume;  // "" = fresh run; "latest" = newest valid checkpoint under out/

  nlohmann::json to_json() const;
};

// The names of every setting (as config keys, underscored).
const std::vector<std::string>& train_config_keys();

// Reads a config file (.json, or .yaml/.yml as flat `key: value` lines) into a JSON object;
// errors name the file and line.
nlohmann::json read_config_file(const std::string& path);

// Builds a config from `values` (key -> JSON value; flags arrive as strings and are
// converted to the key's type). Unknown keys and values of the wrong type are errors
// naming the key and `source` (the file or "command line").
void apply_config_values(TrainConfig& cfg, const nlohmann::json& values, const std::string& source);

// Checks ranges and consistency (positive sizes, heads dividing channels, sequence within
// the context, known schedule/device/dtype); errors name the key.
void validate(const TrainConfig& cfg);

}  // namespace tessera::train
