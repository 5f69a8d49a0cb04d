// `tessera checkpoint consolidate`: a training checkpoint (checkpoint-N, possibly written by
// many ZeRO ranks) turned into a Hugging Face model directory (config.json +
// model.safetensors + checksums.json, tokenizer.json when the run has one), offline and on
// the CPU: nothing is gathered onto a GPU.
//
// Under mixed precision the checkpoint's model.safetensors holds the bf16/fp16 parameters
// while the optimizer shards hold their f32 masters (DeepSpeed's zero_to_fp32 reads the
// same): with `from_masters` the weights are assembled from every rank's master slices and
// written in f32, else they are copied as stored.
#pragma once
#include <filesystem>
#include <string>

namespace tessera::train {

struct ConsolidateOptions {
  bool from_masters = true;
};

struct ConsolidateReport {
  int64_t tensors = 0;       // written to model.safetensors
  int64_t from_masters = 0;  // of which assembled from f32 master slices
  int saved_world_size = 1;  // processes that wrote the checkpoint
  std::string strategy;      // "DDP", "ZeRO-3", ...
};

// Writes `out` (which must not exist or be empty) from `checkpoint`, verified first; the
// folder appears whole or not at all (written beside it, then renamed).
ConsolidateReport consolidate_checkpoint(const std::filesystem::path& checkpoint,
                                         const std::filesystem::path& out,
                                         ConsolidateOptions options = {});

}  // namespace tessera::train
