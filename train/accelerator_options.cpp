#include "tessera/train/accelerator_options.h"

#include "tessera/core/device.h"

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
  // What the DeepSpeed file sets beyond TrainingArguments (bucket sizes, prefetch, the fp16
  // scaler) reaches the Accelerator from the file as apply_sharding_config parsed it; the
  // rest is in `args` already, so applying it again agrees. Arguments that were never
  // folded (apply_sharding_config not called) leave the Accelerator to read the file.
  options.deepspeed_config = args.deepspeed;
  if (args.deepspeed_config && args.deepspeed_config->path == args.deepspeed)
    options.deepspeed = args.deepspeed_config;
  return options;
}

}  // namespace tessera::train
