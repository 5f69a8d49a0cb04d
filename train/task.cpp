#include "tessera/train/task.h"

#include "tessera/core/error.h"
#include "tessera/dist/parallelize.h"
#include "tessera/train/accelerator_options.h"

namespace tessera::train {

namespace fs = std::filesystem;

PredictionOutput TrainingTask::predict(dist::Accelerator&, const TrainingArguments&,
                                       const data::ExampleDataset&) {
  TESSERA_FAIL("Trainer::predict: the ", name(), " task has no predict() (it is for sequence classification)");
}

void TrainingTask::split_over_mesh(dist::Accelerator& acc, const TrainingArguments&) {
  TESSERA_CHECK(acc.mesh().data_parallel_only(), "Trainer: the device mesh ",
                acc.mesh().shape().str(), " splits the model over ranks, which the ", name(),
                " task does not support (tp_size and pp_size > 1 need a causal language model)");
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
  nn::Module& model() override { return split_ ? *split_ : static_cast<nn::Module&>(model_); }
  std::string name() const override { return "causal_lm"; }
  void check_data(const TrainingArguments&) const override {}  // run.cpp checks ids vs vocabulary

  void split_over_mesh(dist::Accelerator& acc, const TrainingArguments& args) override {
    const dist::PipelineOptions pipeline = pipeline_options(args);
    dist::check_mesh_split(model_, acc.mesh().shape(), pipeline, args.per_device_train_batch_size);
    split_ = dist::split_over_mesh(model_, acc.mesh(), {.pipeline = pipeline});
    if (!split_) return;
    pipeline_ = dynamic_cast<dist::PipelineParallelCausalLM*>(split_.get());
    tensor_parallel_ = dynamic_cast<nn::CausalLM*>(split_.get());
    dist::release_parameter_memory(model_, *split_);
  }
  bool runs_own_backward() const override { return pipeline_ != nullptr; }

  void prepare(dist::Accelerator& acc, const TrainingArguments& args, Device device) override {
    args_ = &args;
    acc_ = &acc;
    if (!pipeline_)  // check_mesh_settings refused checkpointing on a pipeline
      language_model().gradient_checkpointing_enable(gradient_checkpointing_policy(args));
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
    // A pipeline runs the micro-batch's forwards and backwards on its stages itself.
    if (pipeline_)
      return acc_->train_step(*pipeline_, [&] { return pipeline_->train_step(batch.x, batch.y); });
    return language_model().loss(batch.x, batch.y);
  }
  int64_t units_per_micro_batch() const override { return args_->per_device_train_batch_size * args_->seq; }
  std::string unit_name() const override { return "tokens"; }

  bool has_eval_data() const override { return eval_data_.has_value(); }
  TaskEvaluation evaluate(dist::Accelerator& acc, const TrainingArguments& args) override {
    TESSERA_CHECK(eval_data_.has_value(), "Trainer::evaluate: no evaluation data");
    EvalTotals totals;
    if (!split_) {
      totals = evaluate_tokens(model_, *eval_data_, args.eval_batch_size(), args.seq,
                               args.eval_batches, device_, &acc);
    } else {
      // A split model's forward is collective over its group, whose ranks must score the same
      // rows: every rank scores every batch (each dp replica gets the same totals). A pipeline
      // is gathered whole for it (collective), as its stages run training steps only.
      std::unique_ptr<nn::CausalLM> whole;
      if (pipeline_) whole = pipeline_->gather_full_model();
      if (whole) whole->to(device_);
      totals = evaluate_tokens(whole ? *whole : *tensor_parallel_, *eval_data_,
                               args.eval_batch_size(), args.seq, args.eval_batches, device_);
    }
    TaskEvaluation out;
    out.metrics = compute_metrics_(totals);
    if (!out.metrics.count("loss") && !out.metrics.count("eval_loss")) out.metrics["loss"] = totals.loss();
    out.samples = args.eval_batches * args.eval_batch_size();
    const int64_t scorers = split_ ? 1 : acc.num_processes();
    out.batches = (args.eval_batches + scorers - 1) / scorers;
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
  void load_weights(const fs::path& safetensors) override {
    if (pipeline_) {  // every stage reads the full file into a whole model and keeps its part
      const std::unique_ptr<nn::CausalLM> whole = pipeline_->gather_full_model();
      whole->load_safetensors_weights(safetensors.string());
      pipeline_->load_full_state_dict(*whole);
      return;
    }
    language_model().load_safetensors_weights(safetensors.string());
  }
  // A split model's step runs its group's collectives: eager.
  nn::CausalLM* graphable_model() override { return split_ ? nullptr : &model_; }
  data::DataLoader* token_loader() override { return loader_.get(); }

 private:
  // The model that trains: the given one, or the tensor-parallel split of it (a pipeline is no
  // nn::CausalLM: next_loss, evaluate and load_weights take its own routes).
  nn::CausalLM& language_model() { return tensor_parallel_ ? *tensor_parallel_ : model_; }

  nn::CausalLM& model_;
  std::unique_ptr<nn::Module> split_;  // this rank's piece on a mesh that splits models
  dist::PipelineParallelCausalLM* pipeline_ = nullptr;  // split_ as a pipeline stage
  nn::CausalLM* tensor_parallel_ = nullptr;             // split_ as a tensor-parallel model
  dist::Accelerator* acc_ = nullptr;
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
