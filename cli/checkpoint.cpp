// `tessera checkpoint consolidate CKPT --out MODEL_DIR`: a (sharded) training checkpoint as
// a Hugging Face model directory, offline on the CPU (train/consolidate.h).
#include <iostream>
#include <memory>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/train/consolidate.h"

namespace tessera::cli {
namespace {

struct ConsolidateArgs {
  std::string checkpoint, out;
  bool stored_weights = false;
};

const RegisterCommand reg(
    "checkpoint", "Work with training checkpoints (consolidate)", [](CLI::App& sub) {
      // An unknown word is named rather than reported as a missing subcommand.
      sub.require_subcommand(0, 1);
      sub.allow_extras();
      CLI::App* self = &sub;
      sub.callback([self] {
        if (!self->get_subcommands().empty()) return;
        const std::vector<std::string> extras = self->remaining();
        TESSERA_CHECK(!extras.empty(), "tessera checkpoint: a subcommand is required: consolidate");
        TESSERA_FAIL("tessera checkpoint: unknown subcommand '", extras.front(),
                     "' (valid: consolidate)");
      });
      auto args = std::make_shared<ConsolidateArgs>();
      CLI::App* consolidate =
          sub.add_subcommand("consolidate",
                             "Write a Hugging Face model directory from a checkpoint, whatever "
                             "number of ranks and ZeRO stage wrote it");
      consolidate->add_option("checkpoint", args->checkpoint, "a checkpoint-N folder")->required();
      consolidate
          ->add_option("--out", args->out, "the model directory to write (must not exist yet)")
          ->required();
      consolidate->add_flag(
          "--stored-weights", args->stored_weights,
          "copy the parameters as stored (bf16/fp16 under mixed precision) instead of "
          "assembling the f32 masters from the optimizer shards");
      consolidate->callback([args] {
        const train::ConsolidateReport r = train::consolidate_checkpoint(
            args->checkpoint, args->out, {.from_masters = !args->stored_weights});
        std::cout << "consolidated " << args->checkpoint << " (" << r.strategy << ", "
                  << r.saved_world_size << " process(es)) into " << args->out << ": " << r.tensors
                  << " tensors";
        if (r.from_masters > 0)
          std::cout << ", " << r.from_masters << " of them from the f32 master shards";
        std::cout << "\n";
      });
    });

}  // namespace
}  // namespace tessera::cli
