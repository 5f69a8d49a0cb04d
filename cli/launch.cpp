// `tessera launch`: the flags of Tessera, Accelerate (`accelerate launch`) and torchrun, over
// an Accelerate config file (--config_file, else Accelerate's default file when it exists).
#include <filesystem>
#include <iostream>
#include <map>

#include "tessera/cli/command.h"
#include "tessera/cli/launch_config.h"
#include "tessera/dist/launcher.h"

namespace tessera::cli {
namespace {

enum class FlagType { Int, Real, Text, Switch };

struct LaunchFlag {
  const char* names;  // CLI11 names: Tessera's first, then Accelerate's and torchrun's
  const char* key;    // the setting (cli/launch_config.h)
  FlagType type;
  std::string help;
};

const std::vector<LaunchFlag>& launch_flags() {
  static const std::vector<LaunchFlag> flags = {
      {"--nproc-per-node,--nproc_per_node", "nproc_per_node", FlagType::Int,
       "processes on this node (1 to " + std::to_string(dist::kMaxProcsPerNode) + ")"},
      {"--num-processes,--num_processes", "num_processes", FlagType::Int,
       "Accelerate's: processes of all machines together (each runs num_processes / nnodes)"},
      {"--nnodes,--num-machines,--num_machines", "nnodes", FlagType::Int, "number of nodes"},
      {"--node-rank,--node_rank,--machine-rank,--machine_rank", "node_rank", FlagType::Int,
       "this node's index"},
      {"--master-addr,--master_addr,--main-process-ip,--main_process_ip", "master_addr",
       FlagType::Text, "address of rank 0's node (default: MASTER_ADDR, else 127.0.0.1)"},
      {"--master-port,--master_port,--main-process-port,--main_process_port", "master_port",
       FlagType::Int,
       "rendezvous port (default: MASTER_PORT, else a free port on one node, 29500 on several)"},
      {"--rdzv-endpoint,--rdzv_endpoint", "rdzv_endpoint", FlagType::Text,
       "torchrun's HOST:PORT of the rendezvous (the master address and port)"},
      {"--mixed-precision,--mixed_precision", "mixed_precision", FlagType::Text,
       "no | fp16 | bf16, passed to the Accelerator as TESSERA_MIXED_PRECISION"},
      {"--reduce-dtype,--reduce_dtype", "reduce_dtype", FlagType::Text,
       "fp32 | bf16 | fp16: the dtype gradients are averaged in, passed to the Accelerator as "
       "TESSERA_REDUCE_DTYPE"},
      {"--use-deepspeed,--use_deepspeed", "use_deepspeed", FlagType::Switch,
       "shard with DeepSpeed's settings (--deepspeed_config_file, --zero_stage)"},
      {"--deepspeed-config-file,--deepspeed_config_file", "deepspeed_config_file", FlagType::Text,
       "DeepSpeed JSON, passed to the Accelerator as TESSERA_DEEPSPEED_CONFIG"},
      {"--zero-stage,--zero_stage", "zero_stage", FlagType::Int,
       "0 = DDP; ZeRO 1, 2 or 3, passed to the Accelerator as TESSERA_ZERO_STAGE"},
      {"--use-fsdp,--use_fsdp", "use_fsdp", FlagType::Switch,
       "shard with FSDP (default strategy FULL_SHARD)"},
      {"--fsdp-sharding-strategy,--fsdp_sharding_strategy", "fsdp_sharding_strategy",
       FlagType::Text,
       "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD, passed as TESSERA_FSDP_SHARDING_STRATEGY"},
      {"--gradient-accumulation-steps,--gradient_accumulation_steps",
       "gradient_accumulation_steps", FlagType::Int,
       "passed to the Accelerator as TESSERA_GRADIENT_ACCUMULATION_STEPS"},
      {"--tp-size,--tp_size,--parallelism_config_tp_size", "tp_size", FlagType::Int,
       "ranks per tensor-parallel group of the Accelerator's device mesh, passed on as "
       "TESSERA_TP_SIZE"},
      {"--pp-size,--pp_size", "pp_size", FlagType::Int,
       "pipeline stages of the Accelerator's device mesh, passed on as TESSERA_PP_SIZE"},
      {"--gpu-ids,--gpu_ids", "gpu_ids", FlagType::Text,
       "all | 0,1,...: the GPUs the ranks see (CUDA_VISIBLE_DEVICES)"},
      {"--cpu", "use_cpu", FlagType::Switch,
       "ranks stay on the CPU even where a GPU is visible (TESSERA_USE_CPU=1)"},
      {"--max-restarts,--max_restarts", "max_restarts", FlagType::Int,
       "restart all ranks up to N times after a rank fails (the ranks see "
       "TORCHELASTIC_RESTART_COUNT; `tessera train` resumes its newest checkpoint; default 0)"},
      {"--exit-barrier-timeout,--exit_barrier_timeout", "exit_barrier_timeout", FlagType::Real,
       "seconds the other ranks may take to exit after one exited 0; then they are stopped and "
       "the job fails naming them (default 300)"},
      {"--watchdog-timeout", "watchdog_timeout", FlagType::Real,
       "seconds ranks may wait in one collective before the watchdog names the ranks they wait "
       "for and ends the job (default 60, TESSERA_WATCHDOG_TIMEOUT; 0: off)"},
      {"--watchdog-action", "watchdog_action", FlagType::Text,
       "end | report: end the job on a hang (default), or only print the report and keep "
       "waiting (TESSERA_WATCHDOG_ACTION)"},
  };
  return flags;
}

// Typed storage, so CLI11 parses and documents numbers as numbers.
struct FlagValues {
  std::map<std::string, int> ints;
  std::map<std::string, double> reals;
  std::map<std::string, std::string> texts;
};

CLI::Option* add_launch_flag(CLI::App& sub, FlagValues& v, const LaunchFlag& f) {
  switch (f.type) {
    case FlagType::Int:
      return sub.add_option(f.names, v.ints[f.key], f.help);
    case FlagType::Real:
      return sub.add_option(f.names, v.reals[f.key], f.help);
    case FlagType::Text:
      return sub.add_option(f.names, v.texts[f.key], f.help);
    case FlagType::Switch:
      break;
  }
  return sub.add_flag(f.names)->description(f.help);
}

nlohmann::json flag_value(const FlagValues& v, const LaunchFlag& f) {
  switch (f.type) {
    case FlagType::Int:
      return v.ints.at(f.key);
    case FlagType::Real:
      return v.reals.at(f.key);
    case FlagType::Text:
      return v.texts.at(f.key);
    case FlagType::Switch:
      break;
  }
  return true;
}

// The config file's settings: --config_file, else Accelerate's default file when it exists.
LaunchSettings config_settings(const std::string& config_file) {
  if (!config_file.empty()) return read_launch_config(config_file);
  const std::string fallback = default_config_path();
  if (!std::filesystem::exists(fallback)) return {};
  std::cerr << "tessera launch: using the config file " << fallback
            << " (`tessera config` wrote it; --config_file picks another)\n";
  return read_launch_config(fallback);
}

const RegisterCommand reg(
    "launch", "Run PROGRAM as a distributed job (one process per rank, torchrun environment)",
    [](CLI::App& sub) {
      auto values = std::make_shared<FlagValues>();
      auto config_file = std::make_shared<std::string>();
      sub.add_option("--config-file,--config_file", *config_file,
                     "launch settings (YAML or JSON) as `accelerate config` / `tessera config` "
                     "write them; flags override it (default: " + default_config_path() +
                         " when it exists)");
      std::vector<CLI::Option*> options;
      for (const LaunchFlag& f : launch_flags()) options.push_back(add_launch_flag(sub, *values, f));
      // PROGRAM and everything after it belong to the program, even options that look like
      // ours: they arrive in remaining().
      sub.prefix_command();
      sub.footer(
          "PROGRAM ARGS...   the program each rank runs, with its arguments\n\n"
          "SIGINT, SIGTERM or SIGUSR1 to the launcher is forwarded to every rank and the launcher "
          "waits for them (`tessera train` finishes its step, saves a checkpoint and exits 75); "
          "a second signal stops them at once. Exit status: 0 = every rank exited 0; 75 = "
          "interrupted and every rank saved and exited 75; 128+N = interrupted by signal N "
          "otherwise; else the first failing rank's status.");
      sub.callback([values, config_file, options, &sub] {
        LaunchSettings settings = config_settings(*config_file);
        for (size_t i = 0; i < options.size(); ++i)
          if (options[i]->count() > 0)
            settings.set(launch_flags()[i].key, flag_value(*values, launch_flags()[i]),
                         "command line");
        dist::LaunchOptions launch_options;
        launch_options.command = sub.remaining();
        apply_launch_settings(settings, launch_options);
        dist::validate(launch_options);
        int status = dist::launch(launch_options);
        if (status != 0) std::exit(status);
      });
    });

}  // namespace
}  // namespace tessera::cli
