// Training checkpoints: a model directory (config.json + model.safetensors, loadable by
// `transformers` and `tessera sample/eval`) plus training_state.safetensors (optimizer
// moments; step, schedule, RNG, data position and loss scale in its metadata) and
// checksums.json (size and CRC-32 of every file).
//
// A checkpoint is written into `step_XXXXXXXX.partial/` and renamed to `step_XXXXXXXX/`
// only when complete, so an interrupted write never looks like a checkpoint. Loading
// verifies every checksum before anything is read into the model: a damaged checkpoint
// is refused with the file named, never half-loaded.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessera/nn/gpt.h"
#include "tessera/optim/optimizer.h"

namespace tessera::cli {

struct TrainingState {
  int64_t step = 0;              // optimizer steps completed
  uint64_t data_position = 0;    // micro-batches taken from the training loader
  uint64_t rng_seed = 0, rng_offset = 0;  // the default generator
  optim::OptimizerStateDict optimizer;
  std::map<std::string, double> schedule;
  std::map<std::string, double> loss_scaler;
  nlohmann::json config;  // the run's settings, for reference and checks on resume
};

// Saves into checkpoints_dir/step_XXXXXXXX (replacing one of that step) and then removes
// the oldest complete checkpoints beyond keep_last. `extra_files` (name -> contents, e.g.
// tokenizer.json) are copied in too. Returns the checkpoint's directory.
std::filesystem::path save_checkpoint(const std::filesystem::path& checkpoints_dir,
                                      const nn::GPT& model, const TrainingState& state,
                                      const std::map<std::string, std::string>& extra_files,
                                      int64_t keep_last);

// Checks checksums.json against every file; error naming the checkpoint and the damaged file.
void verify_checkpoint(const std::filesystem::path& dir);

// Verifies, then reads the training state (the model weights are read by load_model_weights).
TrainingState load_training_state(const std::filesystem::path& dir);

// Complete checkpoint directories under checkpoints_dir, oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& checkpoints_dir);

// The newest checkpoint that verifies; damaged newer ones are reported to `warnings`.
std::optional<std::filesystem::path> latest_valid_checkpoint(const std::filesystem::path& checkpoints_dir,
                                                             std::vector<std::string>& warnings);

}  // namespace tessera::cli
