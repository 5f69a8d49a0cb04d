#include "tessera/train/task.h"

#include "tessera/core/error.h"

namespace tessera::train {

namespace fs = std::filesystem;

PredictionOutput TrainingTask::predict(dist::Accelerator&, const TrainingArguments&,
                                       const data::ExampleDataset&) {
  TESSERA_FAIL("Trainer::predict: the ", name(), " task has no predict() (it is for sequence classification)");
}

namespace {

// Today's language-model training: windows of the token file through the DataLoader,
// evaluation of the first eval_batches micro-batches of the evaluation file.
class CausalLMTask : public TrainingTask {
 public:
  CausalLMTask(nn::CausalLM& model, data::TokenFile train_data, std::optional<data::TokenFile> eval_data,
               ComputeMetrics compute_metrics)
      : model_(model),
        train_data_(std::move(train_data)),
        eval_data_(std::move(eval_data)),
        compute_metrics_(std::move(compute_metrics)) {
    TESSERA_CHECK(compute_metrics_ != nullptr, "Trainer: compute_metrics is empty (pass language_model_metrics)");
  }
  nn::Module& model() override { return model_; }
  std::string name() const override { return "causal_lm"; }
  void check_data(const TrainingArguments&) const override {}  // run.cpp checks ids vs vocabulary

  void prepare(dist::Accelerator& acc, const TrainingArguments& args, Device device) override {
    args_ = &args;
    model_.gradient_checkpointing_enable(gradient_checkpointing_policy(args));
    loader_ = std::make_unique<data::DataLoader>(
        train_data_, data::DataLoaderOptions{.batch = args.per_device_train_batch_size,
                                             .seq = args.seq,
                                             .sampling = data::parse_sampling(args.sampling),
                                             .shuffle = args.shuffle,
                                             .seed = static_cast<uint64_t>(args.seed),
                                             .device = device});
    acc.prepare(*loader_);
    device_ = device;
  }
  int64_t steps_per_epoch(const TrainingArguments& args, int world_size) const override {
    const int64_t tokens = args.per_device_train_batch_size * args.seq * args.gradient_accumulation_steps * world_size;
    return std::max<int64_t>(1, (train_data_.size() - 1) / tokens);
  }
  uint64_t position() const override { return loader_->position(); }
  void seek(uint64_t position) override { loader_->set_position(position); }
  Tensor next_loss() override {
    const data::Batch batch = loader_->next();
    return model_.loss(batch.x, batch.y);
  }
  int64_t units_per_micro_batch() const override { return args_->per_device_train_batch_size * args_->seq; }
  std::string unit_name() const override { return "tokens"; }

  bool has_eval_data() const override { return eval_data_.has_value(); }
  TaskEvaluation evaluate(dist::Accelerator& acc, const TrainingArguments& args) override {
    TESSERA_CHECK(eval_data_.has_value(), "Trainer::evaluate: no evaluation data");
    const EvalTotals totals = evaluate_tokens(model_, *eval_data_, args.eval_batch_size(), args.seq,
                                              args.eval_batches, device_, &acc);
    TaskEvaluation out;
    out.metrics = compute_metrics_(totals);
    if (!out.metrics.count("loss") && !out.metrics.count("eval_loss")) out.metrics["loss"] = totals.loss();
    out.samples = args.eval_batches * args.eval_batch_size();
    out.batches = (args.eval_batches + acc.num_processes() - 1) / acc.num_processes();
    return out;
  }
  std::vector<std::string> metric_names() const override {
    using Builtin = std::map<std::string, double> (*)(const EvalTotals&);
    const Builtin* builtin = compute_metrics_.target<Builtin>();
    if (!builtin || *builtin != &language_model_metrics) return {};
    std::vector<std::string> names = {"loss"};
    for (const auto& [name, value] : compute_metrics_(EvalTotals{}))  // only the names matter
      if (name != "loss") names.push_back(name);
    return names;
  }

  void save_config(const fs::path& dir) const override { model_.save_config((dir / "config.json").string()); }
  void load_weights(const fs::path& safetensors) override { model_.load_safetensors_weights(safetensors.string()); }
  nn::CausalLM* graphable_model() override { return &model_; }
  data::DataLoader* token_loader() override { return loader_.get(); }

 private:
  nn::CausalLM& model_;
  data::TokenFile train_data_;
  std::optional<data::TokenFile> eval_data_;
  ComputeMetrics compute_metrics_;
  std::unique_ptr<data::DataLoader> loader_;
  const TrainingArguments* args_ = nullptr;
  Device device_ = Device::cpu();
};

}  // namespace

std::unique_ptr<TrainingTask> make_causal_lm_task(nn::CausalLM& model, data::TokenFile train_data,
                                                  std::optional<data::TokenFile> eval_data,
                                                  ComputeMetrics compute_metrics) {
  return std::make_unique<CausalLMTask>(model, std::move(train_data), std::move(eval_data),
                                        std::move(compute_metrics));
}

}  // namespace tessera::train
