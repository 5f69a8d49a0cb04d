// SequenceClassificationTask (task.h): a SequenceClassifier on labelled examples.
#include <cmath>
#include <variant>

#include "tessera/autograd/autograd.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/classification.h"
#include "tessera/nn/distilbert.h"
#include "tessera/train/task.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {

// The positions the classifier can see (0: unknown). SequenceClassifier does not declare it,
// so the four classifiers are asked one by one.
int64_t max_positions_of(const nn::SequenceClassifier& model) {
  if (auto* m = dynamic_cast<const nn::BertForSequenceClassification*>(&model))
    return m->config().max_position_embeddings;
  if (auto* m = dynamic_cast<const nn::DistilBertForSequenceClassification*>(&model))
    return m->config().max_position_embeddings;
  if (auto* m = dynamic_cast<const nn::GPT2ForSequenceClassification*>(&model)) return m->config().block_size;
  if (auto* m = dynamic_cast<const nn::LlamaForSequenceClassification*>(&model))
    return m->config().max_position_embeddings;
  return 0;
}

// A small EvalPrediction of `classes` labels (every class true and predicted at least
// once): what a user compute_metrics is called on to learn its names.
EvalPrediction synthetic_prediction(int64_t classes) {
  const int64_t rows = 2 * classes;
  std::vector<float> logits(static_cast<size_t>(rows * classes), 0.0f);
  std::vector<int64_t> labels(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    labels[i] = i % classes;
    logits[i * classes + (i / 2) % classes] = 1.0f;
  }
  return {from_vector(logits, {rows, classes}), from_vector(labels, {rows}, {.dtype = DType::i64})};
}

class SequenceClassificationTask : public TrainingTask {
 public:
  SequenceClassificationTask(nn::SequenceClassifier& model, data::ExampleDataset train_data,
                             std::optional<data::ExampleDataset> eval_data, data::Collator collator,
                             ComputePredictionMetrics compute_metrics)
      : model_(model),
        train_data_(std::move(train_data)),
        eval_data_(std::move(eval_data)),
        collator_(std::move(collator)),
        compute_metrics_(std::move(compute_metrics)) {
    TESSERA_CHECK(collator_ != nullptr, "Trainer: no collator for the classification data");
    if (!compute_metrics_) {
      compute_metrics_ = classification_metrics;
      builtin_metrics_ = true;
    }
  }
  nn::Module& model() override { return model_; }
  std::string name() const override { return "sequence_classification"; }

  void check_data(const TrainingArguments& args) const override {
    TESSERA_CHECK(!args.gradient_checkpointing, args.describe("gradient_checkpointing"),
                  " is for causal language models; the sequence classifiers do not support it");
    check_dataset(train_data_, "training");
    TESSERA_CHECK(train_data_.label_kind() != data::LabelKind::None, "Trainer: the training data '",
                  train_data_.source().string(), "' has no labels (its label column is empty)");
    if (eval_data_) check_dataset(*eval_data_, "evaluation");
  }

  void prepare(dist::Accelerator& acc, const TrainingArguments& args, Device device) override {
    args_ = &args;
    device_ = device;
    // transformers' Trainer seeds the generator (dropout) with args.seed when it starts.
    default_generator().manual_seed(static_cast<uint64_t>(args.seed));
    // transformers' training sampler always shuffles, seeded by args.seed.
    loader_.emplace(train_data_, collator_,
                    data::ExampleLoaderOptions{.batch_size = args.per_device_train_batch_size,
                                               .shuffle = true,
                                               .seed = static_cast<uint64_t>(args.seed),
                                               .rank = acc.process_index(),
                                               .world_size = acc.num_processes()});
  }
  int64_t steps_per_epoch(const TrainingArguments& args, int) const override {
    const int64_t len = loader_->size(), accumulation = args.gradient_accumulation_steps;
    return std::max<int64_t>(1, (len + accumulation - 1) / accumulation);
  }
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override { position_ = position; }
  Tensor next_loss() override {
    const auto len = static_cast<uint64_t>(loader_->size());
    const uint64_t epoch = position_ / len;
    if (loader_->epoch() != epoch) loader_->set_epoch(epoch);
    const data::ExampleBatch batch = loader_->batch(static_cast<int64_t>(position_ % len));
    ++position_;
    const Tensor logits = logits_of(batch);
    return model_.loss(logits, batch.labels.to(device_));
  }
  int64_t units_per_micro_batch() const override { return args_->per_device_train_batch_size; }
  std::string unit_name() const override { return "samples"; }
  bool equal_batch_shapes() const override { return false; }  // padded to each batch's longest

  bool has_eval_data() const override { return eval_data_.has_value(); }
  TaskEvaluation evaluate(dist::Accelerator& acc, const TrainingArguments& args) override {
    TESSERA_CHECK(eval_data_.has_value(), "Trainer::evaluate: no evaluation data");
    TaskEvaluation out;
    const PredictionOutput p = run_predictions(acc, args, *eval_data_, out.batches);
    out.metrics = p.metrics;
    out.samples = eval_data_->size();
    return out;
  }
  PredictionOutput predict(dist::Accelerator& acc, const TrainingArguments& args,
                           const data::ExampleDataset& dataset) override {
    check_dataset(dataset, "prediction");
    int64_t batches = 0;
    return run_predictions(acc, args, dataset, batches);
  }
  std::vector<std::string> metric_names() const override {
    std::vector<std::string> names = {"loss"};
    if (builtin_metrics_) {
      for (const std::string& n : classification_metric_names()) names.push_back(n);
      return names;
    }
    Metrics metrics;
    try {
      metrics = compute_metrics_(synthetic_prediction(std::max<int64_t>(2, model_.labels_config().num_labels)));
    } catch (const std::exception& e) {
      TESSERA_FAIL("Trainer: compute_metrics failed on a small synthetic EvalPrediction (called once "
                   "before training to learn its metric names): ", e.what());
    }
    for (const auto& [name, value] : metrics)
      if (name != "loss") names.push_back(name);
    return names;
  }

  void save_config(const fs::path& dir) const override {
    // The config alone: the checkpoint's weights are the Accelerator's (under ZeRO-3 no
    // process holds them whole).
    model_.save_config((dir / "config.json").string());
  }
  void load_weights(const fs::path& safetensors) override {
    model_.load_state_dict(load_safetensors(safetensors.string()).tensors);
  }

 private:
  Tensor logits_of(const data::ExampleBatch& batch) {
    const auto on_device = [&](const Tensor& t) { return t.defined() ? t.to(device_) : t; };
    return model_.batch_logits(on_device(batch.input_ids), on_device(batch.attention_mask),
                                on_device(batch.token_type_ids));
  }

  // Labels within the model's classes, texts within its positions: refused before any work,
  // naming the file, the line and the key.
  void check_dataset(const data::ExampleDataset& d, const char* role) const {
    const nn::SequenceClassificationConfig& labels = model_.labels_config();
    const int64_t positions = max_positions_of(model_);
    const std::string file = d.source().string();
    if (d.label_kind() == data::LabelKind::Regression)
      TESSERA_CHECK(labels.num_labels == 1, "Trainer: the ", role, " data '", file,
                    "' holds regression targets but the model has num_labels ", labels.num_labels);
    for (int64_t i = 0; i < d.size(); ++i) {
      const data::Example e = d[i];
      if (const auto* id = std::get_if<int64_t>(&e.label))
        TESSERA_CHECK(*id >= 0 && *id < labels.num_labels, "Trainer: ", file, " line ", d.source_line(i),
                      ": key \"label\" is class ", *id, ", outside the model's num_labels ",
                      labels.num_labels, " (classes 0 .. ", labels.num_labels - 1, ")");
      TESSERA_CHECK(positions <= 0 || d.length(i) <= positions, "Trainer: ", file, " line ",
                    d.source_line(i), ": key \"text\" is ", d.length(i),
                    " tokens, more than the model's ", positions,
                    " positions (tokenise with truncation and max_length <= ", positions, ")");
    }
  }

  // Logits and labels of `dataset` in its order from every process's EvalSampler share, the
  // padding of the last round dropped; metrics named without prefix (loss among them).
  PredictionOutput run_predictions(dist::Accelerator& acc, const TrainingArguments& args,
                                   const data::ExampleDataset& dataset, int64_t& batches) {
    const data::ExampleLoader loader(dataset, collator_,
                                     data::ExampleLoaderOptions{.batch_size = args.eval_batch_size(),
                                                                .rank = acc.process_index(),
                                                                .world_size = acc.num_processes(),
                                                                .evaluation = true});
    autograd::NoGradGuard no_grad;
    const bool was_training = model_.is_training();
    model_.eval();
    std::vector<Tensor> logits;
    std::vector<double> where;  // (dataset index, real) per row
    for (const data::ExampleBatch& batch : loader) {
      logits.push_back(logits_of(batch).to(DType::f32));
      for (size_t r = 0; r < batch.indices.size(); ++r)
        where.insert(where.end(), {double(batch.indices[r]), double(int64_t(r) < batch.real_examples)});
    }
    model_.train(was_training);
    batches = loader.size();
    const int64_t rows = static_cast<int64_t>(where.size() / 2), n = dataset.size();
    const int64_t classes = model_.labels_config().num_labels;
    Tensor local = rows > 0 ? ops::cat(logits, 0) : zeros({0, classes}, {.device = device_});
    Tensor local_where = from_vector(where, {rows, 2}, {.dtype = DType::f64}).to(device_);
    const bool distributed = acc.num_processes() > 1;
    const std::vector<float> all = (distributed ? acc.gather(local) : local).to(Device::cpu()).contiguous().to_vector<float>();
    const std::vector<double> all_where = (distributed ? acc.gather(local_where) : local_where).to(Device::cpu()).to_vector<double>();
    std::vector<float> ordered(static_cast<size_t>(n * classes));
    std::vector<char> seen(static_cast<size_t>(n), 0);
    for (size_t r = 0; 2 * r < all_where.size(); ++r) {
      if (all_where[2 * r + 1] == 0) continue;  // the padding of the last round
      const auto i = static_cast<int64_t>(all_where[2 * r]);
      TESSERA_CHECK(!seen[i], "Trainer: example ", i, " was scored twice in one evaluation");
      seen[i] = 1;
      std::copy_n(all.begin() + r * classes, classes, ordered.begin() + i * classes);
    }
    for (int64_t i = 0; i < n; ++i) TESSERA_CHECK(seen[i], "Trainer: example ", i, " was not scored");
    PredictionOutput out;
    out.predictions = from_vector(ordered, {n, classes});
    if (dataset.label_kind() == data::LabelKind::None) return out;
    out.label_ids = labels_of(dataset);
    out.metrics = compute_metrics_(EvalPrediction{out.predictions, out.label_ids});
    out.metrics["loss"] = model_.loss(out.predictions, out.label_ids).to(DType::f64).item();
    return out;
  }

  static Tensor labels_of(const data::ExampleDataset& d) {
    if (d.label_kind() == data::LabelKind::Regression) {
      std::vector<float> targets;
      for (int64_t i = 0; i < d.size(); ++i) targets.push_back(static_cast<float>(std::get<double>(d[i].label)));
      return from_vector(targets, {d.size()});
    }
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < d.size(); ++i) ids.push_back(std::get<int64_t>(d[i].label));
    return from_vector(ids, {d.size()}, {.dtype = DType::i64});
  }

  nn::SequenceClassifier& model_;
  data::ExampleDataset train_data_;
  std::optional<data::ExampleDataset> eval_data_;
  data::Collator collator_;
  ComputePredictionMetrics compute_metrics_;
  bool builtin_metrics_ = false;
  std::optional<data::ExampleLoader> loader_;
  uint64_t position_ = 0;
  const TrainingArguments* args_ = nullptr;
  Device device_ = Device::cpu();
};

}  // namespace

std::unique_ptr<TrainingTask> make_sequence_classification_task(
    nn::SequenceClassifier& model, data::ExampleDataset train_data,
    std::optional<data::ExampleDataset> eval_data, data::Collator collator,
    ComputePredictionMetrics compute_metrics) {
  return std::make_unique<SequenceClassificationTask>(model, std::move(train_data), std::move(eval_data),
                                                      std::move(collator), std::move(compute_metrics));
}

}  // namespace tessera::train
