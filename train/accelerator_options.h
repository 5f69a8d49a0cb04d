// The one mapping from a training run's settings to the Accelerator's. A setting reaches the
// data-parallel strategy through three structs (docs/settings.md):
//
//   TrainingArguments   (config file, then flags; the DeepSpeed file and FSDP words folded in
//                        by apply_sharding_config, which parses the file once)
//     -> dist::AcceleratorOptions   (accelerator_options below; the parsed file rides along)
//       -> dist::ZeroOptions / dist::DDPOptions   (Accelerator::prepare)
#pragma once
#include <string>

#include "tessera/dist/accelerator.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// "bf16", "fp16" or "no": the Accelerator's name for the run's precision.
std::string mixed_precision_of(const TrainingArguments& args);

// The Accelerator's options for a run with these (validated) arguments. equal_batch_shapes:
// whether every batch of the task has one shape (DDP's row-gathered embedding gradients need it).
dist::AcceleratorOptions accelerator_options(const TrainingArguments& args,
                                             bool equal_batch_shapes);

}  // namespace tessera::train
