// Trainer: one training loop, shaped like Hugging Face's Trainer, for a causal language model
// (nn::CausalLM: GPT, Llama) on token files or a sequence classifier (nn::SequenceClassifier:
// BERT, DistilBERT, GPT-2, Llama) on labelled examples (the task: task.h), built on dist::Accelerator, so one process and N processes (under `tessera launch`,
// mpirun or SLURM) run the same code: the Accelerator prepares the model (DDP), the
// optimizer, the LR schedule and the loader (this rank's share of every step), applies the
// mixed-precision policy and the fp16 loss scale, and saves/loads their state.
//
//   train::Trainer trainer(args, model, data::TokenFile("train.bin"), data::TokenFile("val.bin"));
//   trainer.add_callback(std::make_shared<train::EarlyStoppingCallback>(3));
//   trainer.train();                       // resumes from args.resume_from_checkpoint when set
//   auto metrics = trainer.evaluate();     // {"eval_loss", "eval_perplexity", "eval_accuracy", ...}
//
//   train::Trainer classifier_trainer(args, bert, train_set, eval_set,
//                                     data::DataCollatorWithPadding(tokenizer, {}));
//   classifier_trainer.train();
//   auto m = classifier_trainer.evaluate();  // {"eval_loss", "eval_accuracy", "eval_f1", ...,
//                                            //  "eval_runtime", "eval_samples_per_second", ...}
//   train::PredictionOutput out = classifier_trainer.predict(test_set);  // logits [N, num_labels]
//
// Logs use transformers' names: {"loss", "learning_rate", "grad_norm", "epoch", "step"} per
// logging step and eval_<metric> per evaluation (old checkpoints' "lr" / "val_*" keys are
// still read).
//
// The loop only steps; logging, evaluation, checkpoints and stopping are decided by
// callbacks through TrainerControl (see callbacks.h). Checkpoints: checkpoint_files.h.
#pragma once
#include <filesystem>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "tessera/core/host_readback.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/optim/optim.h"
#include "tessera/train/callbacks.h"
#include "tessera/train/evaluate.h"
#include "tessera/train/preemption.h"
#include "tessera/train/run_folder.h"
#include "tessera/train/step_graph.h"
#include "tessera/train/task.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// Refuses a metric_for_best_model (eval_ prefixed as transformers does) that is not among
// `metric_names` (as a task's metric_names() gives them, without the prefix), naming those
// there are, so that a misspelt name fails before any work.
void check_metric_for_best_model(const TrainingArguments& args,
                                 const std::vector<std::string>& metric_names);
// The same for a language model's compute_metrics, called once on empty totals.
void check_metric_for_best_model(const TrainingArguments& args, const ComputeMetrics& compute_metrics);

class Trainer {
 public:
  // The model is moved to the run's device; on a mesh with tp_size or pp_size > 1 it is first
  // split over the Accelerator's mesh (TrainingTask::split_over_mesh), model() is this rank's
  // piece and `model` a shell that keeps its config only. `extra_files` (name -> contents, e.g.
  // tokenizer.json) are copied into every checkpoint. args must have passed validate().
  Trainer(TrainingArguments args, nn::CausalLM& model, data::TokenFile train_data,
          std::optional<data::TokenFile> eval_data = std::nullopt,
          ComputeMetrics compute_metrics = language_model_metrics,
          std::map<std::string, std::string> extra_files = {});
  // Sequence classification: `collator` pads the examples into batches (for instance
  // data::DataCollatorWithPadding); compute_metrics empty: classification_metrics.
  // A user compute_metrics is called once, before any work, on a small synthetic
  // EvalPrediction to learn its metric names (for metric_for_best_model).
  Trainer(TrainingArguments args, nn::SequenceClassifier& model, data::ExampleDataset train_data,
          std::optional<data::ExampleDataset> eval_data, data::Collator collator,
          ComputePredictionMetrics compute_metrics = {},
          std::map<std::string, std::string> extra_files = {});
  // Any task (task.h).
  Trainer(TrainingArguments args, std::unique_ptr<TrainingTask> task,
          std::map<std::string, std::string> extra_files = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void add_callback(std::shared_ptr<TrainerCallback> callback) {
    handler_.add(std::move(callback));
  }
  // Trains until max_steps or until a callback stops it, then (load_best_model_at_end)
  // restores the best checkpoint's weights. A preemption signal (args.preempt_signals,
  // preemption.h) stops it early at a step every process agrees on, after saving a
  // checkpoint there; preempted_by() then names the signal.
  void train();
  // The signal that stopped the last train() early (0: it was not preempted).
  int preempted_by() const { return preempted_by_; }
  // Metrics of the evaluation data, named eval_* as transformers' trainer.evaluate(): the
  // task's metrics plus eval_runtime, eval_samples_per_second and eval_steps_per_second
  // (every process scores its share; all get the same).
  Metrics evaluate();
  // Classification: logits and labels of `dataset` in its order, metrics named test_*.
  PredictionOutput predict(const data::ExampleDataset& dataset);
  // Writes output_dir/checkpoint-<global_step> (every process takes part).
  std::filesystem::path save_checkpoint();

  const TrainingArguments& args() const { return args_; }
  const TrainerState& state() const { return state_; }
  dist::Accelerator& accelerator() { return *acc_; }
  nn::Module& model() { return task_->model(); }
  TrainingTask& task() { return *task_; }
  Device device() const { return device_; }
  // Tokens (language model) or examples (classifier) of one optimizer step, every process.
  int64_t tokens_per_step() const;
  // The CUDA-graph runner of the steps (null when graphs are off: TESSERA_CUDA_GRAPHS=0).
  const StepGraphRunner* step_graphs() const { return graphs_.get(); }

 private:
  // A step's results stay on the device: the host reads them only when it logs, evaluates or
  // saves, so it can queue the next step while the GPU still runs this one.
  struct StepResult {
    Tensor loss;       // [1] f64: the mean over every process's rows of the step
    Tensor grad_norm;  // the norm before clipping (undefined when nothing was measured)
    double lr = 0;
    uint64_t collectives = 0;  // the group's issued_count() once the step was queued
  };
  // A step to log: its loss sum (f64, of `steps` steps) and gradient norm are copied to the
  // host by log_readback_, started when the step was queued and read once the next step has
  // been queued (or before evaluating or saving).
  struct PendingLog {
    int64_t steps = 0;
    bool has_grad_norm = false;
    double lr = 0;
    uint64_t collectives = 0;  // the group's issued_count() once the step was queued
    // When the host had queued the step (on the CPU: when its work was done).
    std::chrono::steady_clock::time_point queued_at;
  };
  // A checkpoint written by another number of processes resumes only with the same global
  // batch; otherwise the error names the world size change (before anything is loaded).
  void check_world_size_of(const std::filesystem::path& checkpoint) const;
  void resume_from(const std::filesystem::path& checkpoint);
  StepResult training_step();
  // With CUDA graphs (on a GPU unless TESSERA_CUDA_GRAPHS=0): the step through graphs_, whose
  // device work is device_step's.
  StepResult graphed_training_step();
  StepOutputs device_step(const std::vector<data::Batch>& micro_batches);
  // The micro-batch loop of a step, written once for the eager and the recorded step: the
  // loss of micro-batch k comes from `loss_of(k)`; backward under the Accelerator's
  // accumulation; returns the mean of the micro-batches' losses (f64, on the device).
  Tensor accumulate_micro_batches(int64_t count, const std::function<Tensor(int64_t)>& loss_of);
  // The prefixed metrics of an evaluation with its wall-clock figures.
  Metrics evaluate_with_prefix(const std::string& prefix);
  // Global-norm clipping on the device: the norm now, the scaling in the optimizer's step.
  Tensor device_clip(const std::vector<Tensor>& params);
  void add_step_loss(const Tensor& loss);
  // The device sum of the losses since the last log, folded into state_.loss_since_log
  // (checked finite: no checkpoint is written after a non-finite loss).
  void read_loss_since_log();
  void flush_pending_log();
  void log_step(const PendingLog& step);
  void evaluate_and_track_best();
  void load_best_model();
  // The signal every process has agreed to stop for at this step boundary, or 0. Collective
  // when distributed; on a GPU it answers for the previous boundary, so that the host never
  // waits for the step just queued (every rank stops at the same step all the same).
  int agreed_preemption_signal();
  // Saves the checkpoint of this step (unless `saved` says it just was) and reports it.
  void stop_for_preemption(int signal, bool saved, PreemptionSignals& signals);

  TrainingArguments args_;
  std::unique_ptr<TrainingTask> task_;
  std::unique_ptr<dist::Accelerator> acc_;
  Device device_ = Device::cpu();
  std::map<std::string, std::string> extra_files_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<optim::LRSchedule> schedule_;
  std::unique_ptr<StepGraphRunner> graphs_;  // null unless CUDA graphs are on
  std::string graphs_status_;                // the last status printed
  std::optional<TrainerState> resumed_;  // read before the schedule is built
  TrainerState state_;
  Tensor loss_since_log_;  // on the device; state_.loss_since_log holds it once read
  std::optional<PendingLog> pending_log_;
  HostReadback log_readback_;  // the pending log's loss sum and gradient norm
  std::chrono::steady_clock::time_point last_log_time_;  // for the logged ms per step
  // Evaluation and checkpoint time since the last log: not part of any step's own time.
  double seconds_outside_steps_ = 0;
  int64_t last_log_step_ = 0;
  TrainerControl control_;
  CallbackHandler handler_;
  std::shared_ptr<RunFolderLock> folder_lock_;  // the main process's claim on output_dir
  HostReadback preemption_readback_;             // the agreed flag of the previous boundary
  uint64_t preemption_mark_ = 0;                 // issued_count() once it was queued
  int preempted_by_ = 0;
};

}  // namespace tessera::train
