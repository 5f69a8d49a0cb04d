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
};
TaskSettings take_task_settings(std::vector<train::ArgumentLayer>& layers);

}  // namespace tessera::cli
