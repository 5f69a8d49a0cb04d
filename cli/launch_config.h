// `tessera launch` settings by Tessera's own names, and how they come from an Accelerate
// config file (what `accelerate config` and `tessera config` write) or from the flags of
// Tessera, Accelerate and torchrun. The file is read first and the flags override it.
#pragma once
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/dist/launcher.h"

namespace tessera::cli {

// Settings by name (nproc_per_node, num_processes, nnodes, node_rank, master_addr,
// master_port, rdzv_endpoint, mixed_precision, use_deepspeed, deepspeed_config_file,
// zero_stage, use_fsdp, fsdp_sharding_strategy, gradient_accumulation_steps, gpu_ids, use_cpu,
// ...), each with where it came from, for messages.
struct LaunchSettings {
  nlohmann::json values = nlohmann::json::object();
  std::map<std::string, std::string> sources;  // key -> "config 'f.yaml'" / "command line"
  // key -> how messages name it: `config 'f.yaml': key "main_process_port"`.
  std::map<std::string, std::string> descriptions;

  // Sets `key` from `source` (`description`: how its source names it; default the key); a
  // later source replaces what an earlier one said about the same thing (num_processes and
  // nproc_per_node are one setting, so are rdzv_endpoint and the master address and port).
  void set(const std::string& key, nlohmann::json value, const std::string& source,
           const std::string& description = "");
};

// Accelerate's default file: $HF_HOME/accelerate/default_config.yaml, HF_HOME defaulting to
// $XDG_CACHE_HOME/huggingface, then ~/.cache/huggingface (as Accelerate finds it).
std::string default_config_path();

// Reads an Accelerate config file (YAML, or JSON, which is YAML too). Keys of Accelerate's
// schema that Tessera has no use for are accepted while they hold their harmless defaults; a
// value Tessera cannot honour, and a key of no schema, are errors naming the file and the key.
LaunchSettings read_launch_config(const std::string& path);

// Fills `options` (job shape, rendezvous, precision, sharding) from the settings; a value of
// the wrong type, a num_processes the machines do not divide, and contradictions are errors
// naming the key and its source. MASTER_ADDR / MASTER_PORT fill what neither gave.
void apply_launch_settings(const LaunchSettings& settings, dist::LaunchOptions& options);

}  // namespace tessera::cli
