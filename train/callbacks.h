// What happens around the training loop, as Hugging Face's Trainer does it: the loop
// itself only steps, and callbacks steered by a small TrainerControl decide when to log,
// evaluate, save and stop. Logging (metrics.jsonl, TensorBoard, the progress line, the
// loss plot), early stopping and the evaluation/save schedule are all callbacks.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/train/log_history.h"
#include "tessera/train/metrics.h"
#include "tessera/train/progress.h"
#include "tessera/train/training_args.h"

namespace tessera::train {

// What trainer_state.json holds (Hugging Face's names); saved with every checkpoint and
// restored on resume, so a resumed run continues the same history.
struct TrainerState {
  int64_t global_step = 0;
  int64_t max_steps = 0;
  int64_t steps_per_epoch = 1;
  double epoch = 0;
  // Every log and evaluation, without wall-clock figures (so a resumed run's history is
  // bit-identical to an uninterrupted one); kept on disk, not in memory (log_history.h).
  LogHistory log_history;
  std::optional<double> best_metric;
  std::string best_model_checkpoint;  // a checkpoint folder name under output_dir
  int64_t best_step = -1;             // the step of best_metric
  // The LR schedule's length: max_steps of the run's first segment for a constant schedule
  // (so a run may be extended), max_steps otherwise.
  int64_t schedule_total = 0;
  // Train loss accumulated since the last log (logged as its mean every logging_steps).
  double loss_since_log = 0;
  int64_t steps_since_log = 0;
  nlohmann::json stateful_callbacks = nlohmann::json::object();  // name -> state
  bool is_world_process_zero = true;

  // What trainer_state.json holds. write() streams it (the log history is never held as
  // JSON objects or as one string); to_text() and to_json() are the same, for short
  // histories (tests, tools).
  void write(std::ostream& out) const;
  std::string to_text() const;
  nlohmann::json to_json() const;
  // Checks every field (types and ranges); errors name `where` and the key.
  static TrainerState from_json(const nlohmann::json& j, const std::string& where);
};

// Set by callbacks (and reset by the Trainer after it acted on them).
struct TrainerControl {
  bool should_stop = false;
  bool should_save = false;
  bool should_evaluate = false;
  bool should_log = false;
};

class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  virtual void on_train_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_step_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  // `logs`: {"step", "epoch", "loss", "learning_rate", "grad_norm", "ms", "tokens_per_s"}.
  virtual void on_log(const TrainingArguments&, TrainerState&, TrainerControl&,
                      const nlohmann::json& logs) {}
  virtual void on_evaluate(const TrainingArguments&, TrainerState&, TrainerControl&,
                           const Metrics& metrics) {}
  virtual void on_save(const TrainingArguments&, TrainerState&, TrainerControl&,
                       const std::filesystem::path& checkpoint) {}
  virtual void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  // Callbacks with state that must survive a resume name themselves and (de)serialise it
  // into trainer_state.json's "stateful_callbacks".
  virtual std::string state_name() const { return ""; }
  virtual nlohmann::json save_state() const { return nullptr; }
  virtual void load_state(const nlohmann::json&) {}
};

// Calls every callback in the order added.
class CallbackHandler {
 public:
  void add(std::shared_ptr<TrainerCallback> callback) { callbacks_.push_back(std::move(callback)); }
  const std::vector<std::shared_ptr<TrainerCallback>>& callbacks() const { return callbacks_; }
  template <class Method, class... Extra>
  void call(Method method, const TrainingArguments& args, TrainerState& state,
            TrainerControl& control, const Extra&... extra) {
    for (const auto& cb : callbacks_) ((*cb).*method)(args, state, control, extra...);
  }
  void save_states(TrainerState& state) const;
  void load_states(const TrainerState& state);

 private:
  std::vector<std::shared_ptr<TrainerCallback>> callbacks_;
};

// The schedule of logs, evaluations and saves from the arguments (Hugging Face's
// DefaultFlowCallback): every logging_steps / eval_steps / save_steps steps or every
// epoch, and always an evaluation and a save at the last step unless the strategy is "no".
class DefaultFlowCallback : public TrainerCallback {
 public:
  void on_step_end(const TrainingArguments& args, TrainerState& state,
                   TrainerControl& control) override;
};

// Stops training when metric_for_best_model has not improved on the best so far by more
// than `threshold` for `patience` evaluations in a row.
class EarlyStoppingCallback : public TrainerCallback {
 public:
  explicit EarlyStoppingCallback(int64_t patience, double threshold = 0.0);
  void on_evaluate(const TrainingArguments& args, TrainerState& state, TrainerControl& control,
                   const Metrics& metrics) override;
  std::string state_name() const override { return "EarlyStoppingCallback"; }
  nlohmann::json save_state() const override { return {{"patience_counter", counter_}}; }
  void load_state(const nlohmann::json& j) override;
  int64_t patience_counter() const { return counter_; }

 private:
  int64_t patience_;
  double threshold_;
  int64_t counter_ = 0;
};

// Whether `value` improves on `best` for metric_for_best_model's direction.
bool metric_improves(const TrainingArguments& args, double value, const std::optional<double>& best,
                     double threshold = 0.0);

// ---- trackers (report_to) ----
// A tracker receives every log line and evaluation as one JSON object with a "step".
// Every record carries "time" (wall clock, seconds since the Unix epoch). Built in:
// "jsonl" (output_dir/metrics.jsonl) and "tensorboard" (event files in output_dir/tensorboard,
// the run's settings as text); others plug in by name:
//   register_tracker("mine", [](const TrackerContext& c) { return std::make_unique<Mine>(c); });
class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual void log(const nlohmann::json& record) = 0;
  virtual void close() {}
};
struct TrackerContext {
  std::filesystem::path output_dir;
  int64_t first_step = 0;   // > 0 when resuming: records after it are replaced
  nlohmann::json settings;  // the run's TrainingArguments
};
using TrackerFactory = std::function<std::unique_ptr<Tracker>(const TrackerContext&)>;
void register_tracker(const std::string& name, TrackerFactory factory);
bool tracker_available(const std::string& name);

// Sends logs and evaluations to the trackers named in report_to (main process only).
class TrackerCallback : public TrainerCallback {
 public:
  void on_train_begin(const TrainingArguments& args, TrainerState& state,
                      TrainerControl& control) override;
  void on_log(const TrainingArguments&, TrainerState&, TrainerControl&,
              const nlohmann::json& logs) override;
  void on_evaluate(const TrainingArguments&, TrainerState& state, TrainerControl&,
                   const Metrics& metrics) override;
  void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) override;

 private:
  std::vector<std::unique_ptr<Tracker>> trackers_;
};

// The live progress bar / plain progress lines, and one-line notes (evaluations, saves).
class ProgressCallback : public TrainerCallback {
 public:
  void on_train_begin(const TrainingArguments& args, TrainerState& state,
                      TrainerControl& control) override;
  void on_log(const TrainingArguments&, TrainerState& state, TrainerControl&,
              const nlohmann::json& logs) override;
  void on_evaluate(const TrainingArguments&, TrainerState& state, TrainerControl&,
                   const Metrics& metrics) override;
  void on_save(const TrainingArguments&, TrainerState&, TrainerControl&,
               const std::filesystem::path& dir) override;
  void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) override;
  // Prints a line (above the bar on a terminal).
  void message(const std::string& text);

 private:
  std::unique_ptr<Progress> progress_;
};

// loss.png in output_dir from the log history, at the end of training.
class LossPlotCallback : public TrainerCallback {
 public:
  void on_train_end(const TrainingArguments& args, TrainerState& state, TrainerControl&) override;
};

}  // namespace tessera::train
