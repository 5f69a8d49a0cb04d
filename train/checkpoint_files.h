// The checkpoint layout of a training run (Hugging Face Trainer's naming):
//
//   output_dir/checkpoint-N/
//     config.json, model.safetensors    the model as a Hugging Face GPT-2 directory
//     optimizer.safetensors             AdamW moments and steps
//     accelerator_state.json            every process's RNG and loader position, the LR
//                                       schedule, the fp16 loss scale, the micro-step
//     trainer_state.json                global_step, log_history, best_metric,
//                                       best_model_checkpoint, callback state
//     training_args.json                the run's settings (paths absolute)
//     tokenizer.json                    when the data has one
//     checksums.json                    size and CRC-32 of each file, written last
//
// A checkpoint is written as checkpoint-N.partial/ and renamed when complete, so an
// interrupted write never looks like a checkpoint; loading verifies every checksum first.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/train/callbacks.h"

namespace tessera::train {

inline constexpr const char* kTrainerStateFile = "trainer_state.json";
inline constexpr const char* kTrainingArgsFile = "training_args.json";

std::string checkpoint_name(int64_t step);  // "checkpoint-N"
// The step of a checkpoint folder name, or nullopt when it is not one.
std::optional<int64_t> checkpoint_step(const std::filesystem::path& dir);

// Complete-looking checkpoint folders of a run (not *.partial), by step.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& output_dir);

// Verifies every checksum and that every file of the layout is there; error names the
// checkpoint and the damaged file.
void verify_checkpoint(const std::filesystem::path& dir);
// save_only_model: removes the training state (optimizer, accelerator_state.json) from a
// checkpoint being written, leaving a model directory that cannot be resumed.
void drop_training_state(const std::filesystem::path& dir);

// The newest checkpoint of a run below `before_step` that verifies; damaged newer ones
// are reported to `warnings`.
std::optional<std::filesystem::path> latest_valid_checkpoint(
    const std::filesystem::path& output_dir, std::vector<std::string>& warnings,
    int64_t before_step = INT64_MAX);

// What --resume names: a checkpoint folder, or a run folder (its newest valid
// checkpoint). A damaged checkpoint falls back to the newest valid one before it, with a
// warning saying so; no valid checkpoint at all is an error.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& target,
                                         std::vector<std::string>& warnings);

// How many processes wrote a checkpoint and the rows of one micro-step of them all
// (accelerator_state.json); {0, 0} where it does not say.
std::pair<int64_t, int64_t> saved_world_and_global_batch(const std::filesystem::path& checkpoint);

// Removes the oldest checkpoints beyond `limit`, never `keep` (the best checkpoint's name).
void rotate_checkpoints(const std::filesystem::path& output_dir, int64_t limit,
                        const std::string& keep);

// trainer_state.json of a checkpoint; error names the checkpoint when it is not valid JSON.
TrainerState read_trainer_state(const std::filesystem::path& checkpoint);
// Streams `state` to `path` (trainer_state.json grows with the log history) and flushes it
// to disk like the checkpoint's other files.
void write_trainer_state(const std::filesystem::path& path, const TrainerState& state);

}  // namespace tessera::train
