#include "tessera/cli/command.h"
#include "tessera/dist/launcher.h"

namespace tessera::cli {
namespace {

const RegisterCommand reg(
    "launch", "Run PROGRAM as a distributed job (one process per rank, torchrun environment)",
    [](CLI::App& sub) {
      auto options = std::make_shared<dist::LaunchOptions>();
      // Ranges are checked by dist::validate, whose message names the option, the valid
      // range and the value.
      sub.add_option(
          "--nproc-per-node", options->nproc_per_node,
          "processes on this node (1 to " + std::to_string(dist::kMaxProcsPerNode) + ")");
      sub.add_option("--nnodes", options->nnodes, "number of nodes");
      sub.add_option("--node-rank", options->node_rank, "this node's index");
      sub.add_option("--master-addr", options->master_addr,
                     "address of rank 0's node (default: MASTER_ADDR, else 127.0.0.1)");
      sub.add_option("--master-port", options->master_port,
                     "rendezvous port (default: MASTER_PORT, else a free port on one node, 29500 "
                     "on several)");
      sub.add_option("--mixed-precision", options->mixed_precision,
                     "no | fp16 | bf16, passed to the Accelerator as TESSERA_MIXED_PRECISION")
          ->check(CLI::IsMember({"no", "fp16", "bf16"}));
      sub.add_option("--reduce-dtype", options->reduce_dtype,
                     "fp32 | bf16 | fp16: the dtype gradients are averaged in, passed to the "
                     "Accelerator as TESSERA_REDUCE_DTYPE")
          ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
      sub.add_option("--max-restarts", options->max_restarts,
                     "restart all ranks up to N times after a rank fails (the ranks see "
                     "TORCHELASTIC_RESTART_COUNT; `tessera train` resumes its newest checkpoint)")
          ->capture_default_str();
      sub.add_option("--exit-barrier-timeout", options->exit_barrier_timeout_s,
                     "seconds the other ranks may take to exit after one exited 0; then they "
                     "are stopped and the job fails naming them")
          ->capture_default_str();
      sub.add_option_function<double>(
             "--watchdog-timeout", [options](double s) { options->watchdog_timeout_s = s; },
             "seconds ranks may wait in one collective before the watchdog names the ranks "
             "they wait for and ends the job (default 60, TESSERA_WATCHDOG_TIMEOUT; 0: off)");
      sub.add_option("--watchdog-action", options->watchdog_action,
                     "end | report: end the job on a hang (default), or only print the report "
                     "and keep waiting (TESSERA_WATCHDOG_ACTION)")
          ->check(CLI::IsMember({"end", "report"}));
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
      sub.callback([options, &sub] {
        options->command = sub.remaining();
        dist::take_master_from_environment(*options, sub.count("--master-addr") > 0,
                                           sub.count("--master-port") > 0);
        dist::validate(*options);
        int status = dist::launch(*options);
        if (status != 0) std::exit(status);
      });
    });

}  // namespace
}  // namespace tessera::cli
