// The training run behind `tessera train`: builds or loads the model, trains it with
// AdamW and an LR schedule on the DataLoader's stream, evaluates, samples, checkpoints,
// and resumes from a checkpoint bit-for-bit.
#pragma once
#include "tessera/cli/train_config.h"

namespace tessera::cli {

// Runs training as configured (cfg must have passed validate()).
void run_training(const TrainConfig& cfg);

}  // namespace tessera::cli
