#include "tessera/cli/command.h"
#include "tessera/dist/launcher.h"

namespace tessera::cli {
namespace {

const RegisterCommand reg(
    "launch", "Run PROGRAM as a distributed job (one process per rank, torchrun environment)",
    [](CLI::App& sub) {
      auto options = std::make_shared<dist::LaunchOptions>();
      sub.add_option("--nproc-per-node", options->nproc_per_node, "processes on this node")
          ->check(CLI::PositiveNumber);
      sub.add_option("--nnodes", options->nnodes, "number of nodes")->check(CLI::PositiveNumber);
      sub.add_option("--node-rank", options->node_rank, "this node's index")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--master-addr", options->master_addr, "address of rank 0's node");
      sub.add_option("--master-port", options->master_port,
                     "rendezvous port (default: a free port on one node, 29500 on several)")
          ->check(CLI::Range(0, 65535));
      sub.add_option("--mixed-precision", options->mixed_precision,
                     "no | fp16 | bf16, passed to the Accelerator as TESSERA_MIXED_PRECISION")
          ->check(CLI::IsMember({"no", "fp16", "bf16"}));
      // PROGRAM and everything after it belong to the program, even options that look like
      // ours: they arrive in remaining().
      sub.prefix_command();
      sub.footer("PROGRAM ARGS...   the program each rank runs, with its arguments");
      sub.callback([options, &sub] {
        options->command = sub.remaining();
        int status = dist::launch(*options);
        if (status != 0) std::exit(status);
      });
    });

}  // namespace
}  // namespace tessera::cli
