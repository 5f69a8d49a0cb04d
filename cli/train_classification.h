// `tessera train --task classification` (cli/train_classification.cpp).
#pragma once
#include "tessera/cli/classification.h"
#include "tessera/train/training_args.h"

namespace tessera::cli {

// Fine-tunes args.init's sequence classifier on args.data (labelled examples) and evaluates
// on args.val_data; returns the process's exit status (0, or train::kPreemptedExitStatus).
struct TaskSettings;
int run_classification_training(const train::TrainingArguments& args, const TaskSettings& settings);

}  // namespace tessera::cli

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/train/run.h"

namespace tessera::cli {

// The task and the classification settings (task, text_column, text_pair_column, label_column,
// max_length or max_seq_length, truncation, pad_token_id) taken out of the layers, the later layer winning;
// what is left are TrainingArguments keys. Columns given for --task causal_lm are refused,
// naming the key and its source.
struct TaskSettings {
  Task task = Task::CausalLM;
  ClassificationColumns columns;
  // The pad token of a model whose config.json and tokenizer name none (a GPT-2 language model
  // trained here): batches are padded with it and the new config records it.
  std::optional<int64_t> pad_token_id;
  // The keys some layer set (max_seq_length counted as max_length): a resumed run takes the
  // others from its checkpoint and refuses these when they differ from it.
  std::set<std::string> given;
  // Resumed: the labels the checkpoint's head was trained on (the training data must name them).
  std::optional<std::vector<std::string>> id2label;
};
TaskSettings take_task_settings(std::vector<train::ArgumentLayer>& layers);

// The file a classification run's checkpoints carry its task settings and labels in, so that
// --resume needs neither the flags again nor a guess at the labels.
inline constexpr const char* kTaskSettingsFile = "task_settings.json";

// The settings the run uses: `requested` for a fresh run; for a resumed one the checkpoint's
// task_settings.json (a causal_lm checkpoint has none), each key given again checked against
// it, naming the key when it differs.
TaskSettings settings_for_run(const TaskSettings& requested, const train::TrainingArguments& args);

}  // namespace tessera::cli
