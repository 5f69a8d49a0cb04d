// `tessera train`: settings from --config (JSON or flat YAML) overridden by flags.
#include <map>

#include "tessera/cli/command.h"
#include "tessera/cli/train_config.h"
#include "tessera/cli/trainer.h"

namespace tessera::cli {
namespace {

struct FlagSpec {
  const char* flag;
  const char* key;
  const char* help;
};

constexpr FlagSpec kValueFlags[] = {
    {"--data", "data", "training token file (llm.c layout, e.g. from `tessera prepare`)"},
    {"--val-data", "val_data", "validation token file (default: val.bin beside --data)"},
    {"--init", "init", "start from this model directory instead of a fresh model"},
    {"--n-layer", "n_layer", "transformer blocks (default 4)"},
    {"--n-head", "n_head", "attention heads (default 4)"},
    {"--n-embd", "n_embd", "channels (default 128)"},
    {"--block-size", "block_size", "context length of the model (default: --seq)"},
    {"--vocab-size", "vocab_size", "vocabulary size (default: the tokenizer's, else the data's)"},
    {"--batch", "batch", "rows per micro-batch (default 8)"},
    {"--seq", "seq", "tokens per row (default 64)"},
    {"--grad-accum", "grad_accum", "micro-batches per optimizer step (default 1)"},
    {"--steps", "steps", "optimizer steps (default 200)"},
    {"--lr", "lr", "peak learning rate (default 1e-3)"},
    {"--min-lr", "min_lr", "floor of the decay (default lr/10)"},
    {"--warmup", "warmup", "linear warmup steps (default 0)"},
    {"--schedule", "schedule", "constant|cosine|linear (default cosine)"},
    {"--weight-decay", "weight_decay", "AdamW decoupled weight decay on matrices (default 0.1)"},
    {"--beta1", "beta1", "AdamW beta1 (default 0.9)"},
    {"--beta2", "beta2", "AdamW beta2 (default 0.99)"},
    {"--eps", "eps", "AdamW epsilon (default 1e-8)"},
    {"--grad-clip", "grad_clip", "clip the global gradient norm to this; 0 = off (default 1.0)"},
    {"--seed", "seed", "seed for init, shuffling and sampling (default 1337)"},
    {"--device", "device", "cpu|cuda|cuda:N (default cpu)"},
    {"--dtype", "dtype", "fp32|bf16|fp16 (default fp32)"},
    {"--eval-every", "eval_every", "validate every N steps; 0 = at the end only"},
    {"--eval-batches", "eval_batches", "validation micro-batches per evaluation (default 8)"},
    {"--sample-every", "sample_every", "print a sample every N steps; 0 = never"},
    {"--save-every", "save_every", "checkpoint every N steps; 0 = at the end only"},
    {"--keep-last", "keep_last", "checkpoints to keep (default 3)"},
    {"--out", "out", "run directory (default runs/train)"},
};

const RegisterCommand reg("train", "Train a GPT on a token file (config file and/or flags)", [](CLI::App& sub) {
  auto config_path = std::make_shared<std::string>();
  auto values = std::make_shared<std::map<std::string, std::string>>();
  auto resume = std::make_shared<std::string>();
  sub.add_option("--config", *config_path, "settings file: JSON, or flat YAML (key: value); flags override it");
  std::vector<CLI::Option*> options;
  // A flag given twice takes its last value (scripts append overrides).
  for (const FlagSpec& f : kValueFlags)
    options.push_back(sub.add_option(f.flag, (*values)[f.key], f.help)
                          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast));
  auto* shuffle = sub.add_flag("--shuffle")->description("draw training windows in a seeded random order");
  auto* sequential = sub.add_flag("--sequential")->description("read the training data in order (the default)");
  shuffle->excludes(sequential);
  auto* resume_opt = sub.add_option("--resume", *resume,
                                    "continue from a checkpoint directory, a run directory, or (no value) "
                                    "the newest valid checkpoint under --out")
                         ->expected(0, 1);
  sub.callback([=] {
    TrainConfig cfg;
    if (!config_path->empty()) apply_config_values(cfg, read_config_file(*config_path), "config '" + *config_path + "'");
    nlohmann::json flags = nlohmann::json::object();
    for (size_t i = 0; i < options.size(); ++i)
      if (options[i]->count() > 0) flags[kValueFlags[i].key] = values->at(kValueFlags[i].key);
    if (shuffle->count() > 0) flags["shuffle"] = true;
    if (sequential->count() > 0) flags["shuffle"] = false;
    if (resume_opt->count() > 0) flags["resume"] = resume->empty() ? std::string("latest") : *resume;
    apply_config_values(cfg, flags, "command line");
    validate(cfg);
    run_training(cfg);
  });
});

}  // namespace
}  // namespace tessera::cli
