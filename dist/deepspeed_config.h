// Sharding configured as users already write it: a DeepSpeed JSON file and FSDP's
// sharding-strategy names, mapped onto Tessera's ZeRO strategies.
//
// Every key DeepSpeed documents for these blocks is either honoured or refused with the
// reason; docs/distributed.md has the whole table. In short:
//
//   zero_optimization.stage                       0 (DDP), 1, 2 or 3
//   zero_optimization.offload_optimizer/_param    device "cpu" | "none" (ZeRO-Offload); nvme refused
//   zero_optimization.reduce_bucket_size          elements per gradient bucket (f32: ×4 bytes);
//     allgather_bucket_size                       the same buckets (Tessera gathers what it reduces)
//   zero_optimization.stage3_prefetch_bucket_size elements gathered ahead under stage 3, at most
//     stage3_max_live_parameters
//   zero_optimization.overlap_comm                true: 2 gradient buckets in flight (one filling,
//                                                 one reduced); false: 1 (max_buckets_in_flight)
//   zero_optimization.contiguous_gradients, ...   what Tessera always does: true
//   fp16.enabled, loss_scale (0 = dynamic), initial_scale_power, loss_scale_window, hysteresis,
//     consecutive_hysteresis, min_loss_scale      the fp16 loss scaler (optim/loss_scaler.h)
//   bf16.enabled; optimizer {type Adam/AdamW, params}; gradient_clipping;
//   train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world
//
// Memory-tuning keys with no counterpart in Tessera (stage3_max_reuse_distance, a positive
// stage3_param_persistence_threshold, a sub_group_size below DeepSpeed's default) change no
// result; they are accepted and listed in `notes`, which the Accelerator prints.
// "auto" (the Hugging Face integration's placeholder) leaves a value to the other settings.
// A key Tessera does not know, a value of the wrong type and settings that contradict each
// other (bf16 and fp16 both on, parameter offload below stage 3, offload under DDP, a value
// that differs from one given elsewhere) fail before any work, naming the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>
#include <vector>

#include "tessera/optim/loss_scaler.h"

namespace tessera::dist {

struct AcceleratorOptions;

struct DeepSpeedConfig {
  std::string source;  // the file (or "DeepSpeed config"), for messages
  std::string path;    // the file read() parsed; "" for from_json
  std::optional<int> zero_stage;
  std::optional<bool> offload_optimizer, offload_param;
  std::optional<int64_t> reduce_bucket_size, stage3_prefetch_bucket_size;  // elements
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<bool> overlap_comm;
  std::optional<double> gradient_clipping;
  std::optional<std::string> mixed_precision;  // "bf16" | "fp16" | "no" from bf16/fp16.enabled
  std::optional<int64_t> train_micro_batch_size_per_gpu, train_batch_size;
  std::optional<int> hybrid_shard_size;                     // zero_optimization.mics_shard_size > 0
  std::optional<int64_t> stage3_max_live_parameters;        // caps the stage-3 prefetch
  std::optional<bool> ignore_unused_parameters;             // = find_unused_parameters
  std::optional<std::string> communication_data_type;       // fp32 | fp16 | bf16 (reduce dtype)
  // fp16's loss scaler as DeepSpeed configures it (its defaults: 2^16, window 1000,
  // hysteresis 2, min scale 1), whenever the file has an fp16 block.
  std::optional<optim::LossScalerOptions> loss_scaler;
  // optimizer.params (type Adam or AdamW).
  std::optional<double> optimizer_lr, optimizer_beta1, optimizer_beta2, optimizer_eps,
      optimizer_weight_decay;
  // Accepted keys that change memory or speed in DeepSpeed but nothing in Tessera, each with
  // what Tessera does instead.
  std::vector<std::string> notes;

  static DeepSpeedConfig from_json(const nlohmann::json& config, const std::string& source);
  // Reads and checks a DeepSpeed JSON file; errors name the file and the key. The one
  // function that parses the file: a training run reads it once (train::apply_sharding_config)
  // and hands the result on (AcceleratorOptions::deepspeed).
  static DeepSpeedConfig read(const std::string& path);

  // Sets what the file sets on `options`. A setting the options already give explicitly
  // (zero_stage >= 0, a non-empty mixed_precision, accumulation > 1, an offload switch, a
  // bucket size other than the default) must agree with the file's, else an error names both.
  void apply_to(AcceleratorOptions& options) const;
};

// The one refusal of two sources that set one value differently, naming both with their
// values: "<one> is <one_value> but <other> is <other_value>; they contradict each other".
// Does nothing when they agree.
void refuse_contradiction(bool agree, const std::string& one, const std::string& one_value,
                          const std::string& other, const std::string& other_value);

// FSDP's ShardingStrategy names (either case, '-' or '_'): FULL_SHARD = 3, SHARD_GRAD_OP = 2,
// NO_SHARD = 0 (DDP), and hybrid sharding's HYBRID_SHARD = 3, _HYBRID_SHARD_ZERO2 = 2 (within
// shard groups: fsdp_sharding_is_hybrid). Anything else is an error naming the value.
int fsdp_sharding_stage(const std::string& name);
bool fsdp_sharding_is_hybrid(const std::string& name);

}  // namespace tessera::dist
