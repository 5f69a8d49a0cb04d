// Sharding configured as users already write it: a DeepSpeed JSON file and FSDP's
// sharding-strategy names, mapped onto Tessera's ZeRO strategies.
//
//   zero_optimization.stage                       0 (DDP), 1, 2 or 3
//   zero_optimization.offload_optimizer.device    "cpu" | "none"  (ZeRO-Offload)
//   zero_optimization.offload_param.device        "cpu" | "none"  (stage 3 only)
//   zero_optimization.reduce_bucket_size          elements per gradient bucket (f32: ×4 bytes)
//   zero_optimization.stage3_prefetch_bucket_size elements gathered ahead under stage 3
//   zero_optimization.overlap_comm                true: 2 gradient buckets in flight (one filling,
//                                                 one reduced); false: 1 (max_buckets_in_flight)
//   gradient_accumulation_steps, gradient_clipping, bf16.enabled, fp16.enabled
//
// "auto" (the Hugging Face integration's placeholder) leaves a value to the other settings.
// A key Tessera does not know, a value of the wrong type and settings that contradict each
// other (bf16 and fp16 both on, parameter offload below stage 3, offload under DDP, a value
// that differs from one given elsewhere) fail before any work, naming the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace tessera::dist {

struct AcceleratorOptions;

struct DeepSpeedConfig {
  std::string source;  // the file (or "DeepSpeed config"), for messages
  std::optional<int> zero_stage;
  std::optional<bool> offload_optimizer, offload_param;
  std::optional<int64_t> reduce_bucket_size, stage3_prefetch_bucket_size;  // elements
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<bool> overlap_comm;
  std::optional<double> gradient_clipping;
  std::optional<std::string> mixed_precision;  // "bf16" | "fp16" | "no" from bf16/fp16.enabled
  std::optional<int64_t> train_micro_batch_size_per_gpu, train_batch_size;

  static DeepSpeedConfig from_json(const nlohmann::json& config, const std::string& source);
  // Reads and checks a DeepSpeed JSON file; errors name the file and the key.
  static DeepSpeedConfig read(const std::string& path);

  // Sets what the file sets on `options`. A setting the options already give explicitly
  // (zero_stage >= 0, a non-empty mixed_precision, accumulation > 1, an offload switch, a
  // bucket size other than the default) must agree with the file's, else an error names both.
  void apply_to(AcceleratorOptions& options) const;
};

// FSDP's ShardingStrategy names (either case, '-' or '_'): FULL_SHARD = 3, SHARD_GRAD_OP = 2,
// NO_SHARD = 0 (DDP). Anything else is an error naming the value.
int fsdp_sharding_stage(const std::string& name);

}  // namespace tessera::dist
