// A GPT training run as `tessera train` performs it, on top of the Trainer: settings from
// config layers (a file, then flags), the data and its tokenizer, the model (fresh, from
// --init, or from the checkpoint being resumed), the logging callbacks, and the final
// model directory.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/train/training_args.h"

namespace tessera::train {

// Settings from one source: its values (key -> JSON value or text) and its name for
// messages ("config 'run.yaml'", "command line").
struct ArgumentLayer {
  nlohmann::json values;
  std::string source;
};

// The run's arguments: the defaults, then the layers in order. When they ask to resume,
// the saved settings of the checkpoint come first (so `--resume RUN` alone continues
// that run, from any folder), the run folder is the output_dir unless one is given, and a
// model-shape setting that disagrees with the checkpoint is an error. Paths come back
// absolute; resume_from_checkpoint names the verified checkpoint (a damaged newest one
// falls back to the previous valid one, with a warning on stderr). Validated.
TrainingArguments arguments_for_run(const std::vector<ArgumentLayer>& layers);

// Trains as configured and writes output_dir/{metrics.jsonl, loss.png, config.train.json,
// checkpoint-N/, model/}; output_dir is claimed first (run_folder.h). Returns the process's
// exit status: 0, or kPreemptedExitStatus when a preemption signal stopped the run after its
// checkpoint was saved (no model/ is written then: the run is not finished).
int run_training(const TrainingArguments& args);

}  // namespace tessera::train
