#include "tessera/train/accelerator_options.h"

#include <tuple>

#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/dist/env.h"
#include "tessera/dist/parallelize.h"

namespace tessera::train {

std::string mixed_precision_of(const TrainingArguments& a) {
  return a.bf16 ? "bf16" : a.fp16 ? "fp16" : "no";
}

dist::AcceleratorOptions accelerator_options(const TrainingArguments& args,
                                             bool equal_batch_shapes) {
  dist::AcceleratorOptions options;
  options.mixed_precision = mixed_precision_of(args);
  options.reduce_dtype = args.reduce_dtype;
  options.gradient_accumulation_steps = static_cast<int>(args.gradient_accumulation_steps);
  options.cpu = Device::parse(args.device).is_cpu();
  options.zero_stage = static_cast<int>(args.zero_stage);
  options.hybrid_shard_size = static_cast<int>(args.hybrid_shard_size);
  options.offload_optimizer = args.offload != "none";
  options.offload_param = args.offload == "param";
  options.zero_accumulation = dist::gradient_accumulation_from_name(args.zero_accumulation);
  options.sparse_embedding_gradients = equal_batch_shapes;
  options.dp_size = static_cast<int>(args.dp_size);
  options.tp_size = static_cast<int>(args.tp_size);
  options.pp_size = static_cast<int>(args.pp_size);
  // What the DeepSpeed file sets beyond TrainingArguments (bucket sizes, prefetch, the fp16
  // scaler) reaches the Accelerator from the file as apply_sharding_config parsed it; the
  // rest is in `args` already, so applying it again agrees. Arguments that were never
  // folded (apply_sharding_config not called) leave the Accelerator to read the file.
  options.deepspeed_config = args.deepspeed;
  if (args.deepspeed_config && args.deepspeed_config->path == args.deepspeed)
    options.deepspeed = args.deepspeed_config;
  return options;
}

dist::PipelineOptions pipeline_options(const TrainingArguments& args) {
  return {.micro_batches = static_cast<int>(args.pipeline_micro_batches),
          .schedule = dist::parse_pipeline_schedule(args.pipeline_schedule)};
}

dist::MeshShape mesh_shape(const TrainingArguments& args, int world_size) {
  try {
    return dist::resolve_mesh_shape({.dp = static_cast<int>(args.dp_size),
                                     .tp = static_cast<int>(args.tp_size),
                                     .pp = static_cast<int>(args.pp_size)},
                                    world_size);
  } catch (const Error& e) {
    TESSERA_FAIL("tessera train: ", e.what(), " (", args.describe("tp_size"), ", ",
                 args.describe("pp_size"), ", ", args.describe("dp_size"), ")");
  }
}

void check_mesh_settings(const TrainingArguments& args, int world_size) {
  // The launch's sizes were put in front of the flags; a flag that says otherwise would be
  // overridden by the Accelerator, which takes the launch's for a size of 1.
  for (const auto& [key, variable, value] :
       {std::tuple{"tp_size", "TESSERA_TP_SIZE", args.tp_size},
        std::tuple{"pp_size", "TESSERA_PP_SIZE", args.pp_size}}) {
    const std::string launched = dist::env_string(variable);
    TESSERA_CHECK(launched.empty() || launched == std::to_string(value),
                  "tessera train: ", args.describe(key), " is ", value,
                  " but the launch environment (", variable, ", tessera launch --", key[0],
                  "p-size) asks for ", launched, "; give the size in one place");
  }
  const dist::MeshShape shape = mesh_shape(args, world_size);
  const dist::MeshSplit split = dist::mesh_split_of(shape);
  if (split == dist::MeshSplit::none) return;
  const std::string mesh =
      "tessera train: the device mesh " + shape.str() + " (" + dist::mesh_split_name(split) + ")";
  const int stage = dist::resolved_zero_stage(accelerator_options(args, true));
  TESSERA_CHECK(stage != 3, mesh, " runs DDP or ZeRO-1/2 on the dp axis, but ",
                args.describe("zero_stage"),
                " resolves to 3 (ZeRO-3); it needs tp_size = pp_size = 1");
  TESSERA_CHECK(args.offload == "none", mesh, " does not support offload, but ",
                args.describe("offload"), " is ", args.offload);
  TESSERA_CHECK(args.hybrid_shard_size == -1, mesh, " does not support hybrid sharding, but ",
                args.describe("hybrid_shard_size"), " is ", args.hybrid_shard_size);
  TESSERA_CHECK(args.sample_every == 0, mesh,
                " splits the model over ranks, so the main process "
                "alone cannot sample from it; ",
                args.describe("sample_every"), " must be 0 (got ", args.sample_every, ")");
  TESSERA_CHECK(args.dropout == 0, mesh,
                " runs the split model without dropout (the ranks' "
                "draws could not be one process's); ",
                args.describe("dropout"), " is ", args.dropout);
  if (shape.pp == 1) return;
  TESSERA_CHECK(!args.fp16, mesh, " does not support fp16 loss scaling (", args.describe("fp16"),
                "); use bf16 or fp32");
  TESSERA_CHECK(args.gradient_accumulation_steps == 1, mesh, ": ",
                args.describe("gradient_accumulation_steps"), " is ",
                args.gradient_accumulation_steps,
                ", but a pipeline's micro-batches are its "
                "accumulation: set pipeline_micro_batches (--micro-batches) instead");
  TESSERA_CHECK(!args.gradient_checkpointing, mesh, " does not support ",
                args.describe("gradient_checkpointing"));
  TESSERA_CHECK(args.per_device_train_batch_size % args.pipeline_micro_batches == 0, mesh, ": ",
                args.describe("pipeline_micro_batches"), " ", args.pipeline_micro_batches,
                " does not divide ", args.describe("per_device_train_batch_size"), " ",
                args.per_device_train_batch_size, " (each dp rank's rows of a step)");
}

}  // namespace tessera::train
