// TrainingArguments: every setting of a training run, named as in Hugging Face's
// TrainingArguments where one exists there (output_dir, per_device_train_batch_size,
// learning_rate, eval_strategy, save_total_limit, ...), plus the GPT model and token-data
// settings `tessera train` has always had.
//
// Settings come from a config file (JSON or YAML) and from
// command-line flags. Both accept the Hugging Face names and the short names of the
// `tessera train` flags ("lr" = "learning_rate", "steps" = "max_steps", ...); '-' and '_'
// are interchangeable. Everything is checked before any work: unknown keys, values of
// the wrong type, numbers out of range, duplicate keys; errors name the key as the user
// wrote it and where it came from (the file or the command line).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/dist/deepspeed_config.h"
#include "tessera/nn/checkpoint_policy.h"
#include "tessera/optim/schedule.h"

namespace tessera::train {

// Optimizer steps of a run that sets neither max_steps nor num_train_epochs (`--help` says it).
inline constexpr int64_t kDefaultMaxSteps = 200;

struct TrainingArguments {
  // ---- Hugging Face names ----
  std::string output_dir = "runs/train";
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 0;  // 0 = per_device_train_batch_size
  int64_t gradient_accumulation_steps = 1;
  int64_t max_steps = -1;       // > 0 wins over num_train_epochs; -1 = epochs, else kDefaultMaxSteps
  double num_train_epochs = 0;  // passes over the training tokens when max_steps <= 0
  double learning_rate = 1e-3;
  double weight_decay = 0.1;
  double adam_beta1 = 0.9, adam_beta2 = 0.99, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;                // 0 = no clipping
  // transformers' schedule names (optim/transformers_schedules.h: linear, cosine,
  // cosine_with_min_lr, polynomial, constant_with_warmup, ...) with their meaning: warmup
  // from lr 0, decay to 0 (or to lr_scheduler_kwargs' min_lr). "" = Tessera's `schedule`.
  std::string lr_scheduler_type;
  nlohmann::json lr_scheduler_kwargs = nlohmann::json::object();  // num_cycles, min_lr, power, ...
  int64_t warmup_steps = 0;
  double warmup_ratio = 0;  // used when warmup_steps is 0: ceil(warmup_ratio * steps)
  int64_t logging_steps = 1;
  std::string logging_strategy = "steps";  // steps | epoch | no (train-loss log entries)
  std::string logging_dir;                 // TensorBoard's folder; "" = output_dir/tensorboard
  std::string eval_strategy = "steps";  // no | steps | epoch (steps/epoch also evaluate at the end)
  int64_t eval_steps = 0;               // 0 = at the end only
  std::string save_strategy = "steps";  // no | steps | epoch (steps/epoch also save at the end)
  int64_t save_steps = 0;               // 0 = at the end only
  int64_t save_total_limit = 3;         // never removes the best checkpoint
  bool load_best_model_at_end = false;
  std::string metric_for_best_model = "eval_loss";  // "loss" reads as eval_loss (HF)
  bool greater_is_better = false;
  int64_t seed = 1337;
  bool bf16 = false, fp16 = false;
  bool gradient_checkpointing = false;
  // Hugging Face's dict for gradient checkpointing: Tessera's "policy" (none | full |
  // every_k:K | attention | mlp, nn/checkpoint_policy.h; full when absent) and torch's
  // "use_reentrant" (accepted and ignored: Tessera has one implementation).
  nlohmann::json gradient_checkpointing_kwargs = nlohmann::json::object();
  // "" = fresh; "latest" (or true) = newest valid under output_dir; else a checkpoint folder.
  std::string resume_from_checkpoint;
  // jsonl, tensorboard, csv, mlflow ("all": every one), none (train/report_to.h)
  std::vector<std::string> report_to = {"jsonl"};
  bool save_only_model = false;  // checkpoints hold the model only (they cannot be resumed)
  // Accepted for Hugging Face configs: batches are cut from the memory-mapped token file on
  // the training thread, so there are no loader workers to start (docs/python.md).
  int64_t dataloader_num_workers = 0;
  bool push_to_hub = false;  // true is refused: Tessera does not reach the network
  // Train into an output_dir that holds another run (or later checkpoints than the one
  // resumed) by removing those files first; otherwise that is refused (run_folder.h).
  bool overwrite_output_dir = false;
  // ---- the model (GPT-2 or Llama) and token data ----
  std::string data;           // training token file
  std::string val_data;       // validation token file ("" = val.bin beside `data` when present)
  std::string init;           // start from this model directory
  std::string arch = "gpt2";  // gpt2 | llama (a fresh model's architecture)
  int64_t n_layer = 4, n_head = 4, n_embd = 128;
  // Llama only: key/value heads (0 = n_head; fewer = grouped-query attention), the SwiGLU
  // width (0 = 8/3 n_embd rounded up to a multiple of 64) and the rotary base.
  int64_t n_kv_head = 0, intermediate_size = 0;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = true;  // the output projection shares the token embeddings
  int64_t block_size = 0;           // 0 = seq
  int64_t vocab_size = 0;           // 0 = the tokenizer's beside the data, else the data's
  int64_t seq = 64;
  bool shuffle = false;
  std::string sampling =
      "windows";       // windows (sequential or shuffled) | random (nanoGPT's get_batch)
  double dropout = 0;  // embedding, attention and residual dropout (nanoGPT's)
  // Tessera's own schedule (`--schedule`), used when lr_scheduler_type is "": warmup from
  // lr/warmup, then constant | cosine | linear decay to min_lr (< 0: learning_rate / 10).
  std::string schedule = "cosine";
  double min_lr = -1;
  int64_t eval_batches = 8;
  int64_t sample_every = 0;             // 0 = never
  int64_t early_stopping_patience = 0;  // 0 = no early stopping
  double early_stopping_threshold = 0;
  std::string device = "cpu";
  // ---- data-parallel sharding (dist/deepspeed_config.h) ----
  int64_t zero_stage = -1;         // 0 = DDP, 1-3 = ZeRO; -1 = TESSERA_ZERO_STAGE or 0
  std::string offload = "none";    // none | optimizer | param (ZeRO-Offload)
  // ZeRO-2/3 accumulation micro-steps (dist/zero.h): reduce_every_micro_batch (DeepSpeed's: no
  // full gradient kept) | no_sync (FSDP's: full local gradients, DDP's arithmetic exactly).
  std::string zero_accumulation = "reduce_every_micro_batch";
  std::string deepspeed;           // a DeepSpeed JSON file (Hugging Face's `deepspeed`)
  // That file as apply_sharding_config parsed it (once), handed to the Accelerator by
  // accelerator_options() (train/accelerator_options.h); not a setting of its own.
  std::optional<dist::DeepSpeedConfig> deepspeed_config;
  std::string fsdp;  // Hugging Face's `fsdp`: full_shard|shard_grad_op|hybrid_shard|... [offload]
                     // [auto_wrap]
  // Hybrid sharding (dist/zero.h): ZeRO-2/3 within groups of this many ranks, replicated across
  // them; -1 = off, or with fsdp hybrid_shard / _hybrid_shard_zero2 the ranks per node.
  int64_t hybrid_shard_size = -1;
  // The dtype gradients are averaged in across ranks: fp32, or bf16/fp16 = the parameters'
  // own (half the bytes, no cast passes); "" = bf16 in a bf16 run, else fp32.
  std::string reduce_dtype;
  bool memory_report = false;      // print each rank's bytes by category next to ZeRO's formula
  // ---- the device mesh (dist/device_mesh.h, dist/parallelize.h; Accelerate's ParallelismConfig)
  // ---- world = dp_size x pp_size x tp_size; the model is split over the tp group (tensor
  // parallelism) or the pp group (a pipeline of pp_size stages), DDP on the
  // dp axis. tp_size/pp_size not given: what `tessera launch --tp-size/--pp-size` passed on
  // (TESSERA_TP_SIZE, TESSERA_PP_SIZE), else 1. Accelerate's nested `parallelism_config:
  // {tp_size, dp_replicate_size, dp_shard_size, cp_size}` sets the same fields.
  int64_t dp_size = -1;  // -1 = the world over tp_size x pp_size
  int64_t tp_size = 1;
  int64_t pp_size = 1;
  // pp_size > 1: each dp rank's rows of a step cut into this many micro-batches, run down the
  // pipeline in pipeline_schedule's order (1f1b | afab); they are the step's accumulation.
  int64_t pipeline_micro_batches = 1;
  std::string pipeline_schedule = "1f1b";
  // ---- preemption (preemption.h) ----
  // Signals that make train() save a checkpoint and stop ("none" or empty: none).
  std::vector<std::string> preempt_signals = {"TERM", "INT", "USR1"};
  double preempt_grace = 0;  // seconds from the signal the save may take; 0 = no bound

  // The name each setting was given under ("steps" for max_steps) and where
  // ("command line" or "config 'f.yaml'"), for messages; only keys the user set.
  std::map<std::string, std::pair<std::string, std::string>> given;

  int64_t eval_batch_size() const {
    return per_device_eval_batch_size > 0 ? per_device_eval_batch_size
                                          : per_device_train_batch_size;
  }
  std::string dtype() const { return bf16 ? "bf16" : fp16 ? "fp16" : "fp32"; }
  // Optimizer steps of the run, given the steps one pass over the data takes.
  int64_t total_steps(int64_t steps_per_epoch) const;
  int64_t llama_intermediate_size() const {
    return intermediate_size > 0 ? intermediate_size : (8 * n_embd / 3 + 63) / 64 * 64;
  }
  // The settings under their canonical names (what config.train.json holds).
  nlohmann::json to_json() const;
  // One setting's value, by any name canonical_key knows (or "dtype"); `tessera train --help`
  // prints TrainingArguments{}.value(key) as the flag's default.
  nlohmann::json value(const std::string& key) const;
  // `key "steps" (command line)` for a key the user set, `key "max_steps"` otherwise.
  std::string describe(const std::string& canonical) const;
};

// metric_for_best_model as transformers reads it: "eval_" before a name without it; the old
// val_loss / val_perplexity / val_token_accuracy as eval_loss / eval_perplexity / eval_accuracy.
std::string evaluation_metric_name(const std::string& name);

// Canonical names of every setting.
const std::vector<std::string>& training_argument_keys();
// The canonical name of `key` (an alias, dashes or underscores); "" when unknown.
std::string canonical_key(const std::string& key);
// Model-shape settings: fixed by the run's first checkpoint (an error to change on resume).
const std::vector<std::string>& model_shape_keys();

// Reads a config file (.json, or .yaml/.yml through yaml-cpp) into a JSON
// object. Refuses duplicate keys, numbers out of double range and malformed text, naming
// the file, the key and (JSON) the byte offset or (YAML) the line.
nlohmann::json read_config_file(const std::string& path);

// Sets the keys of `values` (flags may arrive as text and are converted to the key's
// type). Unknown keys, values of the wrong type and a key given twice under two names are
// errors naming the key and `source`.
void apply_config_values(TrainingArguments& args, const nlohmann::json& values,
                         const std::string& source);

// Folds the `deepspeed` file and the `fsdp` words into zero_stage, offload, precision,
// accumulation and clipping. A value set both there and elsewhere must agree: the error
// (dist::refuse_contradiction) names the file's key and the other setting. The file is
// parsed here, once, into deepspeed_config (kept when it already holds this file).
void apply_sharding_config(TrainingArguments& args);

// The run's learning-rate schedule over `total` optimizer steps: transformers'
// get_scheduler(lr_scheduler_type, ...) when that is set, else Tessera's `schedule`. Warmup
// is warmup_steps, or ceil(warmup_ratio * total) when warmup_steps is 0.
int64_t warmup_steps_for(const TrainingArguments& args, int64_t total);
std::unique_ptr<optim::LRSchedule> make_lr_schedule(const TrainingArguments& args,
                                                    optim::Optimizer& optimizer, int64_t total);
// Whether the schedule's shape depends on the total step count (else a run may be extended).
bool schedule_uses_total(const TrainingArguments& args);
// The name of the schedule for messages ("cosine (transformers')", "--schedule cosine").
std::string schedule_name(const TrainingArguments& args);

// What the run recomputes in backward: gradient_checkpointing_kwargs' policy when
// gradient_checkpointing is on, else none. A bad policy is refused naming the key and the value.
nn::CheckpointPolicy gradient_checkpointing_policy(const TrainingArguments& args);

// Checks ranges and consistency (positive sizes, heads dividing channels, finite numbers,
// known schedule/strategy/device/precision, ...); errors name the key.
// needs_token_file false: `data` may be empty (a task whose data is not a token file).
void validate(const TrainingArguments& args, bool needs_token_file = true);

}  // namespace tessera::train
