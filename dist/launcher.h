// `tessera launch`: starts one process per local rank with the torchrun
// environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS), forwards
// their output (ranks other than 0 prefixed with "[rank r] "), and takes the job
// down when one rank fails: the others are stopped within seconds and the
// launcher exits non-zero naming the rank and how it ended. SIGINT (Ctrl-C), SIGTERM or
// SIGUSR1 to the launcher is forwarded to every rank and the launcher waits for them (a
// rank of `tessera train` finishes its step and saves a checkpoint); a second signal is
// forwarded too and the ranks are killed after the stop grace.
//
// Every rank runs in its own process group and the launcher signals whole groups;
// it is also a child subreaper, so descendants that left their rank's group are
// found and killed when the job ends: nothing a rank started outlives the job, also
// when starting the ranks fails part-way.
//
// With max_restarts > 0 a failed job is stopped and started again (all ranks), up to
// that many times, each attempt seeing its number in TORCHELASTIC_RESTART_COUNT (and
// TESSERA_RESTART_COUNT); `tessera train` resumes from its newest checkpoint then.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace tessera::dist {

// Bounds for the job's shape; beyond them a value is a typo, not a job.
constexpr int kMaxProcsPerNode = 1024;
constexpr int kMaxNodes = 65536;
constexpr int kMaxRestarts = 1000;

// The exit status of a rank that stopped on a preemption signal after saving a checkpoint
// (`tessera train`; sysexits' EX_TEMPFAIL: try again later). The launcher exits with it when
// it forwarded a signal and every rank exited with it.
constexpr int kPreemptedExitStatus = 75;

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;          // 0: a free port (single node) or 29500 (several nodes)
  std::string mixed_precision;  // passed on as TESSERA_MIXED_PRECISION when set
  std::string reduce_dtype;     // passed on as TESSERA_REDUCE_DTYPE when set
  double stop_grace_s = 3;      // SIGTERM, then SIGKILL after this long
  // Once one rank has exited 0, the others must exit within this long (as torchrun's
  // --exit-barrier-timeout); then they are stopped and the job fails naming them.
  double exit_barrier_timeout_s = 300;
  int max_restarts = 0;              // restarts of the whole job after a rank fails
  // Passed on as TESSERA_WATCHDOG_TIMEOUT / TESSERA_WATCHDOG_ACTION when set (dist/watchdog.h).
  std::optional<double> watchdog_timeout_s;
  std::string watchdog_action;       // end | report
  // Accelerate's settings (`--zero_stage`, `--deepspeed_config_file`, `--fsdp_sharding_strategy`,
  // `--gradient_accumulation_steps`, `--cpu`), passed on as TESSERA_ZERO_STAGE,
  // TESSERA_DEEPSPEED_CONFIG, TESSERA_FSDP_SHARDING_STRATEGY, TESSERA_GRADIENT_ACCUMULATION_STEPS
  // and TESSERA_USE_CPU=1 when set; the Accelerator takes each one its program left unset.
  std::optional<int> zero_stage;
  std::string deepspeed_config_file;
  std::string fsdp_sharding_strategy;
  std::optional<int> gradient_accumulation_steps;
  bool use_cpu = false;
  // The Accelerator's device mesh (`--tp-size`, `--pp-size`; dist/device_mesh.h), passed on as
  // TESSERA_TP_SIZE / TESSERA_PP_SIZE when set; their product must divide the job's ranks.
  std::optional<int> tp_size, pp_size;
  // Accelerate's gpu_ids: "all" (or empty) leaves CUDA_VISIBLE_DEVICES alone, "0,2" sets it.
  std::string gpu_ids;
  std::vector<std::string> command;  // program and its arguments
};

// Throws tessera::Error naming the option and its valid range when a value is out of it.
void validate(const LaunchOptions& options);

// Takes master_addr / master_port from MASTER_ADDR / MASTER_PORT of the launcher's
// environment where no flag gave them (flags win), as torchrun does; a MASTER_PORT that is
// no port is an error naming the variable.
void take_master_from_environment(LaunchOptions& options, bool addr_flag_given,
                                  bool port_flag_given);

// Runs the job to completion and returns the launcher's exit status: 0 when every rank
// exited 0; after a forwarded signal kPreemptedExitStatus when every rank exited with it,
// else 128 + the signal; else the last attempt's first failing rank's exit code (128 + signal when it
// was killed), after printing which rank failed and how; 1 when ranks were stopped by the
// exit barrier. Throws tessera::Error when the ranks cannot be started (after stopping
// the ones that were).
int launch(const LaunchOptions& options);

}  // namespace tessera::dist
