// What `tessera train --task classification`, `tessera eval` and `tessera predict` share for
// sequence classification: a model directory's facts (config.json) and tokenizer, the checks
// that refuse a dataset before any work (naming the file, the line, the column or the key),
// the forward pass over a dataset in its order on one or several processes, and the metrics.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessera/data/example_dataset.h"
#include "tessera/data/tokenizer.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/encoder.h"

namespace tessera::cli {

// The `--task` values: today's language modelling, and sequence classification.
enum class Task { CausalLM, Classification };
Task parse_task(const std::string& name, const std::string& command);

// The columns and tokenisation options (HF names where there are some).
struct ClassificationColumns {
  std::string text_column = "text";
  std::string text_pair_column;  // empty: single texts
  std::string label_column = "label";
  int64_t max_length = 0;  // 0: the model's positions (and the tokenizer's model_max_length)
  bool truncation = true;
};

// What a model directory's config.json says that the checks need.
struct ModelFacts {
  std::string dir, model_type;
  int64_t vocab_size = 0;
  int64_t max_positions = 0;  // max_position_embeddings (BERT, Llama) or n_positions (GPT-2)
  std::optional<int64_t> pad_token_id;
  // num_labels and id2label when the config names them (a classification config).
  std::optional<int64_t> num_labels;
  std::vector<std::string> id2label;
};
ModelFacts read_model_facts(const std::string& dir);

// The tokenizer saved with the model (tokenizer.json, vocab.txt, ...); refuses a directory
// without one and a tokenizer that does not fit the model (ids beyond vocab_size, a pad
// token out of range).
std::unique_ptr<data::Tokenizer> load_model_tokenizer(const ModelFacts& facts);
// The id batches are padded with: the tokenizer's pad token, else the config's pad_token_id.
uint32_t padding_id(const data::Tokenizer& tokenizer, const ModelFacts& facts);

// Reads and tokenises `path`, refusing (before any model work) a missing column, a label
// outside num_labels (when given) and, without truncation, a text longer than the model's
// positions. `with_labels` false reads texts only (prediction).
data::ExampleDataset load_classification_data(const std::string& path, const data::Tokenizer& tokenizer,
                                              const ModelFacts& facts, const ClassificationColumns& columns,
                                              bool with_labels, int64_t num_labels,
                                              const std::vector<std::string>& label_names);

// The logits [N, num_labels] of every example in dataset order, gathered from every process
// when `acc` is given (each scores its share of the batches). Row-major, on every process.
std::vector<float> predict_logits(nn::SequenceClassifier& model, const data::ExampleDataset& dataset,
                                  uint32_t pad_id, int64_t batch_size, Device device,
                                  dist::Accelerator* acc);

// eval_loss (mean cross-entropy) and train::classification_metrics under HF's eval_ names
// (eval_accuracy, macro eval_precision / eval_recall / eval_f1, eval_f1_micro, eval_f1_weighted),
// the same figures the Trainer logs when it evaluates.
nlohmann::json classification_metrics(const std::vector<float>& logits, const std::vector<int64_t>& labels,
                                      int64_t num_labels);
std::vector<int64_t> dataset_labels(const data::ExampleDataset& dataset);

}  // namespace tessera::cli

namespace tessera::cli {

// --text-column, --text-pair-column, --label-column, --max-length, --truncation on `sub`.
void add_column_options(CLI::App& sub, ClassificationColumns& columns, bool with_labels);

struct ClassifyRunArgs {
  std::string model, data, out, device = "cpu";
  int64_t batch = 32;
  ClassificationColumns columns;
};
// `tessera eval --task classification`: one JSON line of eval_loss and the metrics.
void run_classification_eval(const ClassifyRunArgs& args);

}  // namespace tessera::cli
