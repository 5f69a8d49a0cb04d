// `tessera train`: a thin mapping of a config file (JSON or YAML, Hugging Face
// TrainingArguments names or the flag names) and of the flags onto train::TrainingArguments;
// train::run_training does the rest.
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>

#include "tessera/cli/command.h"
#include "tessera/cli/train_classification.h"
#include "tessera/core/error.h"
#include "tessera/dist/env.h"
#include "tessera/train/run.h"

namespace tessera::cli {
namespace {

enum class FlagType { Int, Real, Text };

struct FlagSpec {
  const char* flag;
  const char* key;  // a TrainingArguments key (or alias)
  FlagType type;
  const char* help;  // "{}" stands for the setting's default, TrainingArguments{}'s value
};

constexpr FlagSpec kValueFlags[] = {
    {"--task", "task", FlagType::Text,
     "causal_lm (a GPT-2/Llama language model on token files; the default) | classification "
     "(fine-tune --init's sequence classifier on labelled texts: JSONL/CSV/TSV)"},
    {"--data", "data", FlagType::Text,
     "training token file (llm.c layout, e.g. from `tessera prepare`); classification: the "
     "labelled examples (.jsonl, .csv, .tsv)"},
    {"--val-data", "val_data", FlagType::Text,
     "validation token file (default: val.bin beside --data); classification: labelled examples"},
    {"--text-column", "text_column", FlagType::Text,
     "classification: the text's column (default text)"},
    {"--text-pair-column", "text_pair_column", FlagType::Text,
     "classification: the second text of a pair (BERT's sentence B; default none)"},
    {"--label-column", "label_column", FlagType::Text,
     "classification: the class column, ids or names of id2label (default label)"},
    {"--max-length", "max_length", FlagType::Int,
     "classification: tokens per example with the special tokens (default: the model's positions)"},
    {"--pad-token-id", "pad_token_id", FlagType::Int,
     "classification: the pad id of a model whose config.json and tokenizer name none (a GPT-2 "
     "language model trained here; no text may hold it)"},
    {"--truncation", "truncation", FlagType::Text,
     "classification: true (cut longer texts to --max-length; the default) | false (refuse them)"},
    {"--init", "init", FlagType::Text, "start from this model directory instead of a fresh model"},
    {"--arch", "arch", FlagType::Text,
     "model architecture: gpt2 (GPT-2: LayerNorm, GELU MLP, learned positions) | llama "
     "(RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention) (default {})"},
    {"--n-layer", "n_layer", FlagType::Int, "transformer blocks (default {})"},
    {"--n-head", "n_head", FlagType::Int, "attention heads (default {})"},
    {"--n-embd", "n_embd", FlagType::Int, "channels (default {})"},
    {"--n-kv-head", "n_kv_head", FlagType::Int,
     "llama: key/value heads, dividing --n-head (fewer = grouped-query attention; default "
     "--n-head)"},
    {"--intermediate-size", "intermediate_size", FlagType::Int,
     "llama: SwiGLU MLP width (default 8/3 n_embd rounded up to a multiple of 64)"},
    {"--rope-theta", "rope_theta", FlagType::Real, "llama: rotary embedding base (default {})"},
    {"--block-size", "block_size", FlagType::Int, "context length of the model (default: --seq)"},
    {"--vocab-size", "vocab_size", FlagType::Int,
     "vocabulary size (default: the tokenizer's, else the data's)"},
    {"--batch", "batch", FlagType::Int, "rows per micro-batch and process (default {})"},
    {"--seq", "seq", FlagType::Int, "tokens per row (default {})"},
    {"--grad-accum", "grad_accum", FlagType::Int, "micro-batches per optimizer step (default {})"},
    {"--steps", "steps", FlagType::Int, nullptr},  // steps_help(): the default is a constant
    {"--lr", "lr", FlagType::Real, "peak learning rate (default {})"},
    {"--min-lr", "min_lr", FlagType::Real, "floor of the decay (default lr/10)"},
    {"--warmup", "warmup", FlagType::Int, "linear warmup steps (default {})"},
    {"--schedule", "schedule", FlagType::Text, "constant|cosine|linear (default {})"},
    {"--weight-decay", "weight_decay", FlagType::Real,
     "AdamW decoupled weight decay on matrices (default {})"},
    {"--beta1", "beta1", FlagType::Real, "AdamW beta1 (default {})"},
    {"--beta2", "beta2", FlagType::Real, "AdamW beta2 (default {})"},
    {"--eps", "eps", FlagType::Real, "AdamW epsilon (default {})"},
    {"--grad-clip", "grad_clip", FlagType::Real,
     "clip the global gradient norm to this; 0 = off (default {})"},
    {"--seed", "seed", FlagType::Int, "seed for init, shuffling and sampling (default {})"},
    {"--device", "device", FlagType::Text, "cpu|cuda|cuda:N (default {})"},
    {"--dtype", "dtype", FlagType::Text, "fp32|bf16|fp16 (default {})"},
    {"--eval-every", "eval_every", FlagType::Int, "validate every N steps; 0 = at the end only"},
    {"--eval-batches", "eval_batches", FlagType::Int,
     "validation micro-batches per evaluation (default {})"},
    {"--sample-every", "sample_every", FlagType::Int, "print a sample every N steps; 0 = never"},
    {"--save-every", "save_every", FlagType::Int, "checkpoint every N steps; 0 = at the end only"},
    {"--keep-last", "keep_last", FlagType::Int,
     "checkpoints to keep, besides the best one (default {})"},
    {"--out", "out", FlagType::Text, "run directory (default {})"},
    {"--dropout", "dropout", FlagType::Real,
     "embedding, attention and residual dropout probability (nanoGPT's; default {})"},
    {"--sampling", "sampling", FlagType::Text,
     "windows (sequential or --shuffle) | random (a random offset per row, nanoGPT's get_batch)"},
    {"--report-to", "report_to", FlagType::Text,
     "comma-separated trackers: jsonl, tensorboard, csv, mlflow, all, none (default {})"},
    {"--reduce-dtype", "reduce_dtype", FlagType::Text,
     "dtype gradients are averaged in across ranks: fp32 | the --dtype (half the bytes on the "
     "wire, no cast passes); default bf16 for --dtype bf16, else fp32"},
    {"--zero-stage", "zero_stage", FlagType::Int,
     "0 = DDP; ZeRO 1 = optimizer state sharded, 2 = and gradients, 3 = and parameters"},
    {"--offload", "offload", FlagType::Text,
     "ZeRO-Offload: optimizer (optimizer state in host memory) | param (and parameters; stage 3)"},
    {"--zero-accumulation", "zero_accumulation", FlagType::Text,
     "ZeRO-2/3 with --grad-accum: reduce_every_micro_batch (DeepSpeed's, default: no full "
     "gradient kept) | no_sync (FSDP's: full local gradients until the last micro-batch)"},
    {"--deepspeed", "deepspeed", FlagType::Text,
     "DeepSpeed JSON: zero_optimization.stage, offload_*.device, bucket sizes, bf16/fp16, ..."},
    {"--preempt-signals", "preempt_signals", FlagType::Text,
     "comma-separated signals that make training finish its step, save a checkpoint and exit "
     "with status 75 (a second signal exits at once); none = off (default {})"},
    {"--preempt-grace", "preempt_grace", FlagType::Real,
     "seconds from a preemption signal within which the checkpoint must be saved, else exit "
     "without it (128 + signal); 0 = no bound (default {})"},
    {"--fsdp", "fsdp", FlagType::Text,
     "FSDP sharding strategy: FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP (ZeRO-2) | HYBRID_SHARD "
     "(ZeRO-3 within groups of --hybrid-shard-size ranks, replicated across them) | "
     "_HYBRID_SHARD_ZERO2 (ZeRO-2 likewise) | NO_SHARD (DDP) [offload]"},
    {"--tp-size", "tp_size", FlagType::Int,
     "device mesh: ranks per tensor-parallel group, the model's heads, MLP and vocabulary split "
     "over them (default: tessera launch --tp-size, else {})"},
    {"--pp-size", "pp_size", FlagType::Int,
     "device mesh: pipeline stages, the model's blocks cut over them (default: tessera launch "
     "--pp-size, else {})"},
    {"--dp-size", "dp_size", FlagType::Int,
     "device mesh: data-parallel replicas; -1 = the world over tp-size x pp-size (default {})"},
    {"--micro-batches", "pipeline_micro_batches", FlagType::Int,
     "--pp-size > 1: micro-batches each step's rows are cut into down the pipeline (default {})"},
    {"--pipeline-schedule", "pipeline_schedule", FlagType::Text,
     "--pp-size > 1: 1f1b (one forward, one backward: activations of at most pp-size "
     "micro-batches) | afab (all forwards, then all backwards) (default {})"},
    {"--hybrid-shard-size", "hybrid_shard_size", FlagType::Int,
     "hybrid sharding (ZeRO-2/3): ranks per shard group, a divisor of the world size (default with "
     "--fsdp hybrid_shard: the ranks per node, LOCAL_WORLD_SIZE)"},
};

std::string steps_help() {
  return "optimizer steps (default: num_train_epochs' worth when set, else " +
         std::to_string(train::kDefaultMaxSteps) + "); -1 = train for num_train_epochs";
}

// A setting's default as `--help` shows it: the struct's own value, so that there is one.
std::string default_text(const char* key) {
  const nlohmann::json v = train::TrainingArguments{}.value(key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) {
    std::ostringstream text;
    text << v.get<double>();  // 0.001, 1e-08, 10000
    return text.str();
  }
  if (!v.is_array()) return v.dump();
  std::string joined;
  for (const nlohmann::json& item : v)
    joined += (joined.empty() ? "" : ",") + item.get<std::string>();
  return joined;
}

// CLI11 keeps each flag's text and documents it by its type; flag_value reads it as that type,
// straight into the JSON the settings are applied from (no storage of its own in between).
CLI::Option* add_flag_option(CLI::App& sub, const FlagSpec& f) {
  std::string help = f.help ? std::string(f.help) : steps_help();
  if (const size_t at = help.find("{}"); at != std::string::npos)
    help.replace(at, 2, default_text(f.key));
  const char* type_name = f.type == FlagType::Int    ? "INT"
                          : f.type == FlagType::Real ? "FLOAT"
                                                     : "TEXT";
  const std::string& description = help;  // const: CLI11 would bind a mutable string as the value
  return sub.add_option(f.flag, description)->type_name(type_name);
}

int64_t integer_flag(const FlagSpec& f, const std::string& text) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  TESSERA_CHECK(error != std::errc::result_out_of_range, "command line: ", f.flag, " ", text,
                " is out of range (an integer from ", INT64_MIN, " to ", INT64_MAX, ")");
  TESSERA_CHECK(error == std::errc() && end == text.data() + text.size(), "command line: ",
                f.flag, " must be an integer, got '", text, "'");
  return value;
}

// Integers are read as text: CLI11 would saturate one beyond int64 (99999999999999999999 ->
// 2^63-1). A real that is not a number fails as CLI11's own conversion error.
nlohmann::json flag_value(const CLI::Option& option, const FlagSpec& f) {
  switch (f.type) {
    case FlagType::Int:
      return integer_flag(f, option.as<std::string>());
    case FlagType::Real:
      return option.as<double>();
    case FlagType::Text:
      break;
  }
  return option.as<std::string>();
}

const RegisterCommand reg(
    "train",
    "Train a GPT-2 or Llama model on a token file, or fine-tune a classifier on labelled texts "
    "(config file and/or flags)",
    [](CLI::App& sub) {
      auto config_path = std::make_shared<std::string>();
      auto resume = std::make_shared<std::string>();
      sub.add_option("--config", *config_path,
                     "settings file: JSON or YAML, with Hugging Face "
                     "TrainingArguments names "
                     "or the flag names; flags override it");
      std::vector<CLI::Option*> options;
      // A flag given twice takes its last value (scripts append overrides).
      for (const FlagSpec& f : kValueFlags)
        options.push_back(
            add_flag_option(sub, f)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast));
      auto* shuffle =
          sub.add_flag("--shuffle")->description("draw training windows in a seeded random order");
      auto* sequential = sub.add_flag("--sequential")
                             ->description("read the training data in order (the default)");
      shuffle->excludes(sequential);
      auto* tie = sub.add_flag("--tie-word-embeddings")
                      ->description("the output projection shares the token embeddings (default)");
      auto* untie = sub.add_flag("--no-tie-word-embeddings")
                        ->description("a separate output projection (lm_head.weight)");
      tie->excludes(untie);
      auto* memory_report =
          sub.add_flag("--memory-report")
              ->description("print each rank's bytes by category next to ZeRO's formula after the first step");
      auto* overwrite =
          sub.add_flag("--overwrite-output-dir")
              ->description("train into an --out that holds another run (or checkpoints later "
                            "than the one resumed) by removing those files first");
      auto checkpoint_policy = std::make_shared<std::string>();
      auto* checkpointing =
          sub.add_option("--gradient-checkpointing", *checkpoint_policy,
                         "recompute activations in backward by a policy: full (every block; the "
                         "default when no value is given) | every_k:K (blocks 0, K, 2K, ...) | "
                         "attention | mlp (that sub-layer of every block) | none")
              ->expected(0, 1);
      auto* resume_opt =
          sub.add_option("--resume", *resume,
                         "continue a run: a checkpoint-N folder, a run folder (its newest valid "
                         "checkpoint), or (no value) the newest under --out; its settings and data "
                         "paths come with it")
              ->expected(0, 1);
      sub.callback([=] {
        // The flags first: a value of the wrong type fails as a command-line error.
        nlohmann::json flags = nlohmann::json::object();
        for (size_t i = 0; i < options.size(); ++i)
          if (options[i]->count() > 0)
            flags[kValueFlags[i].key] = flag_value(*options[i], kValueFlags[i]);
        std::vector<train::ArgumentLayer> layers;
        // A folder would read as an empty stream ("basic_filebuf::underflow").
        TESSERA_CHECK(config_path->empty() || !std::filesystem::is_directory(*config_path),
                      "tessera train: --config '", *config_path,
                      "' is a directory; name the settings file (.json, .yaml)");
        if (!config_path->empty())
          layers.push_back(
              {train::read_config_file(*config_path), "config '" + *config_path + "'"});
        if (shuffle->count() > 0) flags["shuffle"] = true;
        if (sequential->count() > 0) flags["shuffle"] = false;
        if (tie->count() > 0) flags["tie_word_embeddings"] = true;
        if (untie->count() > 0) flags["tie_word_embeddings"] = false;
        // Hugging Face's switch, and the policy in its gradient_checkpointing_kwargs (read and
        // checked there, with the other settings, before any work).
        if (checkpointing->count() > 0) {
          flags["gradient_checkpointing"] = true;
          if (!checkpoint_policy->empty())
            flags["gradient_checkpointing_kwargs"] = {{"policy", *checkpoint_policy}};
        }
        if (memory_report->count() > 0) flags["memory_report"] = true;
        if (overwrite->count() > 0) flags["overwrite_output_dir"] = true;
        if (resume_opt->count() > 0)
          flags["resume"] = resume->empty() ? std::string("latest") : *resume;
        // A job restarted after a failure (`tessera launch --max-restarts`, torchrun) resumes
        // from its newest checkpoint by itself.
        if (resume_opt->count() == 0 && dist::env_int("TORCHELASTIC_RESTART_COUNT", 0, 0) > 0)
          flags["resume"] = "latest";
        if (flags.contains("truncation")) {
          const std::string t = flags["truncation"];
          TESSERA_CHECK(t == "true" || t == "false", "command line: --truncation must be true or false, got '", t, "'");
          flags["truncation"] = t == "true";
        }
        layers.push_back({flags, "command line"});
        const TaskSettings requested = take_task_settings(layers);
        const train::TrainingArguments args = train::arguments_for_run(layers);
        const TaskSettings task = settings_for_run(requested, args);  // resumed: the checkpoint's
        const int status = task.task == Task::Classification ? run_classification_training(args, task)
                                                             : train::run_training(args);
        if (status != 0) std::exit(status);
      });
      sub.footer(
          "Exit status: 0 = trained to the end; 1 = an error (named on stderr, e.g. an --out in "
          "use by another job or holding another run); 75 = stopped by a preemption signal "
          "after saving a checkpoint (resume with --resume OUT); 128+N = killed by signal N "
          "(a second signal, or --preempt-grace ran out).");
    });

}  // namespace
}  // namespace tessera::cli
