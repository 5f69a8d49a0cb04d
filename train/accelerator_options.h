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
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// "bf16", "fp16" or "no": the Accelerator's name for the run's precision.
std::string mixed_precision_of(const TrainingArguments& args);

// The Accelerator's options for a run with these (validated) arguments. equal_batch_shapes:
// whether every batch of the task has one shape (DDP's row-gathered embedding gradients need it).
dist::AcceleratorOptions accelerator_options(const TrainingArguments& args,
                                             bool equal_batch_shapes);

// The pipeline's micro-batches and schedule (pipeline_micro_batches, pipeline_schedule).
dist::PipelineOptions pipeline_options(const TrainingArguments& args);

// The run's device mesh on `world_size` ranks, as its Accelerator will resolve it (the launch's
// TESSERA_TP_SIZE/TESSERA_PP_SIZE are in `args` already: arguments_for_run puts them in front of
// the config and the flags). Refuses a mesh that does not multiply to the world size.
dist::MeshShape mesh_shape(const TrainingArguments& args, int world_size);

// What a mesh that splits the model cannot run with, refused before the model is built,
// naming the settings and the numbers: a mesh that is not the world, tp and pp at once, a tp or
// pp size the launch environment contradicts, any ZeRO stage (a split model is clipped and
// checkpointed under DDP only), offload and hybrid sharding, dropout, samples during training;
// on a pipeline fp16, gradient accumulation (the micro-batches are the pipeline's), gradient
// checkpointing and micro-batches that do not divide the batch. A mesh of data parallelism
// alone passes.
void check_mesh_settings(const TrainingArguments& args, int world_size);

}  // namespace tessera::train
