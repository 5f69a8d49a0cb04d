// `tessera launch`: starts one process per local rank with the torchrun
// environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), forwards their output (ranks other than 0 prefixed with
// "[rank r] "), and takes the job down when one rank fails: the others are
// stopped within seconds and the launcher exits non-zero naming the rank and
// how it ended. Ctrl-C (SIGINT/SIGTERM to the launcher) stops every rank.
#pragma once
#include <string>
#include <vector>

namespace tessera::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;             // 0: a free port (single node) or 29500 (several nodes)
  std::string mixed_precision;     // passed on as TESSERA_MIXED_PRECISION when set
  double stop_grace_s = 3;         // SIGTERM, then SIGKILL after this long
  std::vector<std::string> command;  // program and its arguments
};

// Runs the job to completion and returns the launcher's exit status: 0 when every rank
// exited 0; else the first failing rank's exit code (128 + signal when it was killed),
// after printing which rank failed and how.
int launch(const LaunchOptions& options);

}  // namespace tessera::dist
