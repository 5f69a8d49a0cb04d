// `tessera eval --task classification` and `tessera predict`: a sequence-classification model
// directory (config.json, model.safetensors and its tokenizer) over a JSONL/CSV/TSV file. Under
// `tessera launch` every process scores its share of the batches; the rows are gathered back
// in dataset order, so the output is the same as one process's.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include "tessera/cli/classification.h"
#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/dist/env.h"

namespace tessera::cli {

void add_column_options(CLI::App& sub, ClassificationColumns& columns, bool with_labels) {
  sub.add_option("--text-column", columns.text_column, "column holding the text (default text)");
  sub.add_option("--text-pair-column", columns.text_pair_column,
                 "column holding the second text of a pair (BERT's sentence B; default none)");
  if (with_labels)
    sub.add_option("--label-column", columns.label_column,
                   "column holding the class: an id, or a name of the model's id2label (default label)");
  sub.add_option("--max-length", columns.max_length,
                 "tokens per example with the special tokens (default: the model's positions)");
  sub.add_option("--truncation", columns.truncation,
                 "cut longer texts to --max-length (default true); false refuses them, naming the line");
}

namespace {

// The model, its tokenizer and the data, each checked against the others before any forward.
struct Loaded {
  ModelFacts facts;
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::optional<data::ExampleDataset> dataset;
  std::unique_ptr<nn::SequenceClassifier> model;
  std::optional<dist::Accelerator> acc;
  Device device = Device::cpu();
};

std::unique_ptr<Loaded> load_all(const ClassifyRunArgs& a, bool with_labels, const char* command) {
  TESSERA_CHECK(a.batch > 0, command, ": --batch must be positive, got ", a.batch);
  auto l = std::make_unique<Loaded>();
  l->facts = read_model_facts(a.model);
  l->tokenizer = load_model_tokenizer(l->facts);
  const int64_t num_labels = l->facts.num_labels.value_or(0);
  TESSERA_CHECK(num_labels > 0, command, ": '", a.model,
                "/config.json' names no num_labels or id2label: not a classification model");
  l->dataset = load_classification_data(a.data, *l->tokenizer, l->facts, a.columns, with_labels, num_labels,
                                        l->facts.id2label);
  TESSERA_CHECK(l->dataset->size() > 0, command, ": data file '", a.data, "' holds no examples");
  l->device = Device::parse(a.device);
  if (dist::read_dist_env().world_size > 1) {
    l->acc.emplace(dist::AcceleratorOptions{.cpu = l->device.is_cpu()});
    if (l->device.is_cuda()) l->device = l->acc->device();
  }
  l->model = nn::load_sequence_classifier(a.model, {.device = l->device});
  TESSERA_CHECK(l->model->newly_initialized_keys().empty(), command, ": '", a.model,
                "' has no trained classification head (", l->model->newly_initialized_keys().front(),
                " is missing from its weights); fine-tune it with `tessera train --task classification`");
  return l;
}

std::vector<float> all_logits(Loaded& l, const ClassifyRunArgs& a) {
  return predict_logits(*l.model, *l.dataset, padding_id(*l.tokenizer, l.facts), a.batch, l.device,
                        l.acc ? &*l.acc : nullptr);
}

bool is_main(const Loaded& l) { return !l.acc || l.acc->is_main_process(); }

}  // namespace

void run_classification_eval(const ClassifyRunArgs& a) {
  auto l = load_all(a, /*with_labels=*/true, "tessera eval");
  const std::vector<float> logits = all_logits(*l, a);
  const nlohmann::json metrics =
      classification_metrics(logits, dataset_labels(*l->dataset), l->model->labels_config().num_labels);
  if (is_main(*l)) std::cout << metrics.dump() << "\n";
  if (l->acc) l->acc->end_training();
}

namespace {

// One JSON object per example: its index, the predicted id and name, the logits and the
// softmax probabilities.
void write_predictions(const Loaded& l, const std::vector<float>& logits, std::ostream& out) {
  const nn::SequenceClassificationConfig& labels = l.model->labels_config();
  const int64_t classes = labels.num_labels;
  for (int64_t i = 0; i < l.dataset->size(); ++i) {
    const std::vector<float> row(logits.begin() + i * classes, logits.begin() + (i + 1) * classes);
    const int64_t best = std::max_element(row.begin(), row.end()) - row.begin();
    std::vector<double> probabilities(classes);
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += probabilities[c] = std::exp(double(row[c]) - row[best]);
    for (double& p : probabilities) p /= sum;
    out << nlohmann::json{{"index", i},
                          {"label", best},
                          {"label_name", labels.label_name(best)},
                          {"logits", row},
                          {"probabilities", probabilities}}
               .dump()
        << "\n";
  }
}

void run_predict(const ClassifyRunArgs& a) {
  auto l = load_all(a, /*with_labels=*/false, "tessera predict");
  std::optional<std::ofstream> file;
  if (!a.out.empty() && is_main(*l)) {
    file.emplace(a.out);
    TESSERA_CHECK(file->good(), "tessera predict: cannot write --out '", a.out, "'");
  }
  const std::vector<float> logits = all_logits(*l, a);
  if (is_main(*l)) {
    write_predictions(*l, logits, file ? *file : std::cout);
    if (file) {
      file->close();
      TESSERA_CHECK(!file->fail(), "tessera predict: writing '", a.out, "' failed");
    }
  }
  if (l->acc) l->acc->end_training();
}

const RegisterCommand reg(
    "predict", "Write a classification model's predictions for a JSONL/CSV/TSV file, one JSON line each",
    [](CLI::App& sub) {
      auto args = std::make_shared<ClassifyRunArgs>();
      auto task = std::make_shared<std::string>("classification");
      sub.add_option("--task", *task, "classification (the only task predict serves)")
          ->check(CLI::IsMember({"classification"}));
      sub.add_option("--model", args->model, "model directory (config.json, model.safetensors, tokenizer)")
          ->required();
      sub.add_option("--data", args->data, "examples to classify (.jsonl, .csv, .tsv)")->required();
      sub.add_option("--out", args->out, "write the rows here (default: standard output)");
      sub.add_option("--batch", args->batch, "examples per forward and process (default 32)");
      sub.add_option("--device", args->device, "cpu|cuda|cuda:N (default cpu)");
      add_column_options(sub, args->columns, /*with_labels=*/false);
      sub.callback([args] { run_predict(*args); });
    });

}  // namespace
}  // namespace tessera::cli
