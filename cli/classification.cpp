#include "tessera/cli/classification.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "tessera/autograd/autograd.h"
#include "tessera/core/error.h"
#include "tessera/data/collator.h"
#include "tessera/data/example_loader.h"
#include "tessera/data/wordpiece.h"
#include "tessera/train/metrics.h"

namespace tessera::cli {

namespace fs = std::filesystem;

Task parse_task(const std::string& name, const std::string& command) {
  if (name == "causal_lm") return Task::CausalLM;
  if (name == "classification" || name == "sequence_classification") return Task::Classification;
  TESSERA_FAIL(command, ": --task '", name, "' is not causal_lm or classification");
}

namespace {

std::optional<int64_t> integer_key(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  return it->get<int64_t>();
}

}  // namespace

ModelFacts read_model_facts(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  TESSERA_CHECK(fs::is_directory(dir), "model directory '", dir, "' does not exist");
  TESSERA_CHECK(fs::exists(path), "model directory '", dir, "' holds no config.json");
  std::ifstream in(path);
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("'", path.string(), "' is not JSON: ", e.what());
  }
  ModelFacts f;
  f.dir = dir;
  f.model_type = config.value("model_type", "");
  f.vocab_size = integer_key(config, "vocab_size").value_or(0);
  TESSERA_CHECK(f.vocab_size > 0, "'", path.string(), "': key vocab_size is missing or not positive");
  f.max_positions = integer_key(config, "max_position_embeddings")
                        .value_or(integer_key(config, "n_positions").value_or(0));
  f.pad_token_id = integer_key(config, "pad_token_id");
  if (auto labels = config.find("id2label"); labels != config.end() && labels->is_object()) {
    f.id2label.resize(labels->size());
    for (const auto& [key, name] : labels->items()) {
      const int64_t id = std::stoll(key);
      TESSERA_CHECK(id >= 0 && id < static_cast<int64_t>(labels->size()), "'", path.string(),
                    "': id2label key '", key, "' is not an id below ", labels->size());
      f.id2label[id] = name.get<std::string>();
    }
    f.num_labels = static_cast<int64_t>(f.id2label.size());
  }
  if (auto n = integer_key(config, "num_labels")) f.num_labels = n;
  return f;
}

std::unique_ptr<data::Tokenizer> load_model_tokenizer(const ModelFacts& facts) {
  auto tok = data::load_tokenizer_from(facts.dir);
  TESSERA_CHECK(tok != nullptr, "model directory '", facts.dir,
                "' holds no tokenizer (tokenizer.json, vocab.txt, vocab.json + merges.txt); save "
                "the tokenizer beside the model");
  TESSERA_CHECK(tok->vocab_size() <= facts.vocab_size, "the tokenizer of '", facts.dir, "' has ",
                tok->vocab_size(), " tokens but config.json's vocab_size is ", facts.vocab_size,
                ": its ids would index past the model's embeddings (not this model's tokenizer?)");
  const int64_t pad = padding_id(*tok, facts);
  TESSERA_CHECK(pad >= 0 && pad < facts.vocab_size, "model directory '", facts.dir,
                "': the pad token id ", pad, " is outside the model's vocab_size ", facts.vocab_size);
  return tok;
}

uint32_t padding_id(const data::Tokenizer& tokenizer, const ModelFacts& facts) {
  if (auto id = data::pad_token_id_of(tokenizer)) return *id;
  TESSERA_CHECK(facts.pad_token_id.has_value(), "model directory '", facts.dir,
                "': the tokenizer has no pad token and config.json no pad_token_id; batches "
                "cannot be padded (set pad_token_id in config.json)");
  TESSERA_CHECK(*facts.pad_token_id >= 0 && *facts.pad_token_id < facts.vocab_size, "model directory '",
                facts.dir, "': config.json's pad_token_id ", *facts.pad_token_id,
                " is outside the model's vocab_size ", facts.vocab_size);
  return static_cast<uint32_t>(*facts.pad_token_id);
}

data::ExampleDataset load_classification_data(const std::string& path, const data::Tokenizer& tokenizer,
                                              const ModelFacts& facts, const ClassificationColumns& columns,
                                              bool with_labels, int64_t num_labels,
                                              const std::vector<std::string>& label_names) {
  TESSERA_CHECK(fs::exists(path), "data file '", path, "' does not exist");
  TESSERA_CHECK(columns.max_length >= 0, "--max-length must be positive, got ", columns.max_length);
  TESSERA_CHECK(facts.max_positions <= 0 || columns.max_length <= facts.max_positions, "--max-length ",
                columns.max_length, " is more than the model's ", facts.max_positions, " positions ('",
                facts.dir, "/config.json')");
  data::ExampleDatasetOptions o;
  o.text_column = columns.text_column;
  o.text_pair_column = columns.text_pair_column;
  o.label_column = with_labels ? columns.label_column : "";
  o.num_labels = num_labels;
  o.truncation = columns.truncation;
  o.max_length = static_cast<size_t>(columns.max_length > 0 ? columns.max_length
                                                            : std::max<int64_t>(facts.max_positions, 0));
  data::ExampleDataset dataset = data::ExampleDataset::load(path, tokenizer, o);
  // String labels are names of the model's id2label (by default they would be numbered in
  // sorted order, which need not be the model's).
  if (with_labels && !dataset.label_names().empty() && !label_names.empty() &&
      dataset.label_names() != label_names) {
    o.label_list = label_names;
    dataset = data::ExampleDataset::load(path, tokenizer, o);
  }
  if (with_labels)
    TESSERA_CHECK(dataset.label_kind() == data::LabelKind::Class, "data file '", path, "': column '",
                  columns.label_column, "' holds regression targets, not class labels");
  if (!columns.truncation && facts.max_positions > 0)
    for (int64_t i = 0; i < dataset.size(); ++i)
      TESSERA_CHECK(dataset.length(i) <= facts.max_positions, "data file '", path, "' line ",
                    dataset.source_line(i), ": the text is ", dataset.length(i),
                    " tokens, more than the model's ", facts.max_positions,
                    " positions, and truncation is off (--truncation true, or shorten it)");
  return dataset;
}

std::vector<int64_t> dataset_labels(const data::ExampleDataset& dataset) {
  std::vector<int64_t> labels(dataset.size());
  for (int64_t i = 0; i < dataset.size(); ++i) labels[i] = std::get<int64_t>(dataset[i].label);
  return labels;
}

namespace {

// One round of the evaluation loader: this rank's logits, and on return every rank's
// real rows appended to `all` in dataset order.
void gather_round(const Tensor& logits, const data::ExampleBatch& batch, dist::Accelerator* acc,
                  std::vector<float>& all, std::vector<int64_t>& order) {
  const Tensor mine = logits.detach().to(Device::cpu(), DType::f32).contiguous();
  std::vector<int64_t> indices(batch.indices.begin(), batch.indices.begin() + batch.real_examples);
  Tensor rows = mine.narrow(0, 0, batch.real_examples).contiguous();
  Tensor index_tensor = from_vector(indices, {static_cast<int64_t>(indices.size())});
  if (acc && acc->num_processes() > 1) {
    rows = acc->gather(rows.to(acc->device())).cpu();
    index_tensor = acc->gather(index_tensor.to(acc->device())).cpu();
  }
  const std::vector<float> values = rows.contiguous().to_vector<float>();
  const std::vector<int64_t> ids = index_tensor.contiguous().to_vector<int64_t>();
  all.insert(all.end(), values.begin(), values.end());
  order.insert(order.end(), ids.begin(), ids.end());
}

}  // namespace

std::vector<float> predict_logits(nn::SequenceClassifier& model, const data::ExampleDataset& dataset,
                                  uint32_t pad_id, int64_t batch_size, Device device,
                                  dist::Accelerator* acc) {
  data::PaddingOptions padding;
  padding.pad_token_id = pad_id;
  const data::DataCollatorWithPadding collator(padding);
  data::ExampleLoaderOptions lo;
  lo.batch_size = batch_size;
  lo.evaluation = true;
  lo.rank = acc ? acc->process_index() : 0;
  lo.world_size = acc ? acc->num_processes() : 1;
  const data::ExampleLoader loader(dataset, collator, lo);
  const bool was_training = model.is_training();
  model.eval();
  autograd::NoGradGuard no_grad;
  std::vector<float> gathered;
  std::vector<int64_t> order;
  for (const data::ExampleBatch& batch : loader) {
    const Tensor type_ids = batch.token_type_ids.defined() ? batch.token_type_ids.to(device) : Tensor();
    const Tensor logits =
        model.batch_logits(batch.input_ids.to(device), batch.attention_mask.to(device), type_ids);
    gather_round(logits, batch, acc, gathered, order);
  }
  model.train(was_training);
  const int64_t n = dataset.size();
  TESSERA_CHECK(!order.empty() || n == 0, "prediction produced no rows for ", n, " examples");
  const int64_t classes = order.empty() ? 0 : static_cast<int64_t>(gathered.size() / order.size());
  // Rows are placed by their dataset index: the loader's padding repeats examples, which land
  // on their own row again.
  std::vector<float> logits(static_cast<size_t>(n * classes));
  for (size_t r = 0; r < order.size(); ++r)
    std::copy_n(gathered.begin() + static_cast<int64_t>(r) * classes, classes,
                logits.begin() + order[r] * classes);
  return logits;
}

nlohmann::json classification_metrics(const std::vector<float>& logits, const std::vector<int64_t>& labels,
                                      int64_t num_labels) {
  const auto n = static_cast<int64_t>(labels.size());
  TESSERA_CHECK(n > 0 && static_cast<int64_t>(logits.size()) == n * num_labels,
                "classification metrics: ", logits.size(), " logits for ", n, " labels of ", num_labels,
                " classes");
  // Mean cross-entropy in float64 (what HF's eval_loss averages), then the Trainer's metrics.
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.data() + i * num_labels;
    const double top = *std::max_element(row, row + num_labels);
    double sum = 0;
    for (int64_t c = 0; c < num_labels; ++c) sum += std::exp(static_cast<double>(row[c]) - top);
    loss += std::log(sum) + top - row[labels[i]];
  }
  const train::EvalPrediction prediction{from_vector(logits, {n, num_labels}), from_vector(labels, {n})};
  nlohmann::json out = train::with_prefix(train::classification_metrics(prediction), "eval_");
  out["eval_loss"] = loss / n;
  out["eval_samples"] = n;
  return out;
}

}  // namespace tessera::cli
