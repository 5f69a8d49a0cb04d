// What the Trainer trains: a TrainingTask owns the model's batch source, its loss and its
// evaluation, so that one training loop (trainer.h) serves every kind of model.
//
//   CausalLMTask: nn::CausalLM on a data::TokenFile through the DataLoader (random windows or
//     sequential rows of [batch, seq]); evaluation scores the first eval_batches micro-batches
//     of the evaluation file and hands compute_metrics the totals (EvalTotals).
//   SequenceClassificationTask: nn::SequenceClassifier on a data::ExampleDataset through an
//     ExampleLoader and a collator. Training: a DistributedSampler (shuffle with args.seed
//     when args.shuffle, set_epoch each epoch); evaluation and prediction: an EvalSampler,
//     the logits and labels gathered in dataset order (gather_for_metrics) and handed to
//     compute_metrics as an EvalPrediction (metrics.h).
//
// The Trainer's constructors build the task; a task of one's own can be passed to
// Trainer(args, std::unique_ptr<TrainingTask>, extra_files).
//
// The training stream is counted in micro-batches from the start of training (for a
// classifier micro-batch m is batch m % len of epoch m / len, len = len(train_dataloader)),
// so a resumed run seeks to global_step × gradient_accumulation_steps and continues with the
// same batches: the position is the loader's whole state (the model's RNG is the
// Accelerator's).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/data/collator.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/example_dataset.h"
#include "tessera/data/example_loader.h"
#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/nn/encoder.h"
#include "tessera/train/evaluate.h"
#include "tessera/train/metrics.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// What an evaluation pass gives, before the Trainer prefixes the names.
struct TaskEvaluation {
  Metrics metrics;            // compute_metrics' names plus "loss"
  int64_t samples = 0;        // examples (sequences) scored over every process
  int64_t batches = 0;        // batches this process ran (for eval_steps_per_second)
};

// HF's PredictionOutput: predictions [N, num_labels] (f32 logits, on the host), label_ids [N]
// (undefined when the dataset has no labels) and metrics named test_* (test_loss, ...; only
// when there are labels).
struct PredictionOutput {
  Tensor predictions;
  Tensor label_ids;
  Metrics metrics;
};

class TrainingTask {
 public:
  virtual ~TrainingTask() = default;
  virtual nn::Module& model() = 0;
  // "causal_lm", "sequence_classification" (for messages).
  virtual std::string name() const = 0;
  // Checks the data against the model before any work (ids within the vocabulary or the
  // positions, labels within num_labels), errors naming the file, row and key.
  virtual void check_data(const TrainingArguments& args) const = 0;
  // Called once, right after the Accelerator exists (before the model moves to the device):
  // on a mesh that splits models (tp_size or pp_size > 1) the task splits its model over it
  // (dist::split_over_mesh: the one decision of which split) and model() is this rank's piece
  // from then on; the model it was given is left a shell of shapes and configuration (its
  // parameters' memory released), which only its config may be read from. A task that cannot
  // be split refuses a mesh that would split it. Collective over the model's group.
  virtual void split_over_mesh(dist::Accelerator& acc, const TrainingArguments& args);
  // Whether next_loss() ran the micro-batch's backward itself (a pipeline's train_step, under
  // Accelerator::train_step): the Trainer then calls no backward on its loss.
  virtual bool runs_own_backward() const { return false; }
  // Called once, after the Accelerator exists and the model is on `device`: builds this
  // process's training loader (and prepares it with `acc` where the loader needs it).
  virtual void prepare(dist::Accelerator& acc, const TrainingArguments& args, Device device) = 0;
  // Optimizer steps of one epoch (prepared): a language model's whole windows per step;
  // a classifier's ceil(len(train_dataloader) / gradient_accumulation_steps), as transformers.
  virtual int64_t steps_per_epoch(const TrainingArguments& args, int world_size) const = 0;
  // The training stream's position in micro-batches since the start, and a seek to one.
  virtual uint64_t position() const = 0;
  virtual void seek(uint64_t position) = 0;
  // The mean loss of the next training micro-batch (with its autograd graph).
  virtual Tensor next_loss() = 0;
  // What one micro-batch of this process holds (tokens for a language model, examples for a
  // classifier), for the logged throughput, and the name of the unit ("tokens", "samples").
  virtual int64_t units_per_micro_batch() const = 0;
  virtual std::string unit_name() const = 0;

  virtual bool has_eval_data() const = 0;
  // Every process takes part; every process gets the same result.
  virtual TaskEvaluation evaluate(dist::Accelerator& acc, const TrainingArguments& args) = 0;
  // The metric names an evaluation returns, without the eval_ prefix ("loss" among them),
  // learnt before any training step (a classifier's user compute_metrics is called once on a
  // small synthetic EvalPrediction). Empty: not known before the first evaluation (a
  // language model's own compute_metrics, which may count its calls), checked there.
  virtual std::vector<std::string> metric_names() const = 0;
  // Prediction over `dataset` (classification only; other tasks refuse it, naming the task).
  virtual PredictionOutput predict(dist::Accelerator& acc, const TrainingArguments& args,
                                   const data::ExampleDataset& dataset);

  // config.json of a checkpoint, and the reload of a checkpoint's weights (load_best_model).
  virtual void save_config(const std::filesystem::path& dir) const = 0;
  virtual void load_weights(const std::filesystem::path& safetensors) = 0;
  // Whether every process's micro-batches have the same shape at every step (token windows do;
  // padded examples do not). DDP's sparse embedding-gradient sync needs it
  // (dist/sparse_embedding.h: the ranks must meet the same lookup sizes), so it is off otherwise.
  virtual bool equal_batch_shapes() const { return true; }
  // The causal LM whose steps CUDA graphs may record (null: the steps run eagerly).
  virtual nn::CausalLM* graphable_model() { return nullptr; }
  virtual data::DataLoader* token_loader() { return nullptr; }
};

std::unique_ptr<TrainingTask> make_causal_lm_task(nn::CausalLM& model, data::TokenFile train_data,
                                                  std::optional<data::TokenFile> eval_data,
                                                  ComputeMetrics compute_metrics);

// compute_metrics empty: classification_metrics (metrics.h).
std::unique_ptr<TrainingTask> make_sequence_classification_task(
    nn::SequenceClassifier& model, data::ExampleDataset train_data,
    std::optional<data::ExampleDataset> eval_data, data::Collator collator,
    ComputePredictionMetrics compute_metrics);

}  // namespace tessera::train
