#include "tessera/train/callbacks.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/dist/tensorboard.h"
#include "tessera/train/plot.h"
#include "tessera/train/report_to.h"

namespace tessera::train {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// ---- TrainerState ----

void TrainerState::write(std::ostream& out) const {
  // Everything but the history as JSON, then the history written where its key sits (keys
  // are sorted, so the placeholder's line is the one to replace).
  const Json rest = {{"global_step", global_step},
                     {"max_steps", max_steps},
                     {"steps_per_epoch", steps_per_epoch},
                     {"epoch", epoch},
                     {"log_history", nullptr},
                     {"best_metric", best_metric ? Json(*best_metric) : Json(nullptr)},
                     {"best_model_checkpoint",
                      best_model_checkpoint.empty() ? Json(nullptr) : Json(best_model_checkpoint)},
                     {"best_step", best_step},
                     {"schedule_total", schedule_total},
                     {"loss_since_log", loss_since_log},
                     {"steps_since_log", steps_since_log},
                     {"stateful_callbacks", stateful_callbacks}};
  const std::string text = rest.dump(2);
  const std::string placeholder = "\n  \"log_history\": null";
  const size_t at = text.find(placeholder);
  TESSERA_CHECK(at != std::string::npos, "TrainerState::write: no log_history key in ", text);
  out.write(text.data(), static_cast<std::streamsize>(at));
  out << "\n  \"log_history\": ";
  log_history.write_array(out, 4);
  out.write(text.data() + at + placeholder.size(),
            static_cast<std::streamsize>(text.size() - at - placeholder.size()));
}

std::string TrainerState::to_text() const {
  std::ostringstream out;
  write(out);
  return out.str();
}

Json TrainerState::to_json() const { return Json::parse(to_text()); }

TrainerState TrainerState::from_json(const Json& j, const std::string& where) {
  TESSERA_CHECK(j.is_object(), where, ": expected a JSON object");
  auto count = [&](const char* key, int64_t min) {
    TESSERA_CHECK(j.contains(key), where, ": \"", key, "\" is missing");
    const Json& v = j[key];
    TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= min, where, ": \"", key,
                  "\" must be an integer >= ", min, ", got ", v.dump());
    return v.get<int64_t>();
  };
  auto number = [&](const char* key) {
    TESSERA_CHECK(j.contains(key) && j[key].is_number() && std::isfinite(j[key].get<double>()),
                  where, ": \"", key, "\" must be a finite number, got ",
                  j.contains(key) ? j[key].dump() : "nothing");
    return j[key].get<double>();
  };
  TrainerState s;
  s.global_step = count("global_step", 0);
  s.max_steps = count("max_steps", 1);
  s.steps_per_epoch = count("steps_per_epoch", 1);
  s.epoch = number("epoch");
  s.best_step = count("best_step", -1);
  s.schedule_total = count("schedule_total", 1);
  s.loss_since_log = j.contains("loss_since_log") && j["loss_since_log"].is_null()
                         ? NAN
                         : number("loss_since_log");
  s.steps_since_log = count("steps_since_log", 0);
  TESSERA_CHECK(j.contains("log_history") && j["log_history"].is_array(), where,
                ": \"log_history\" must be a list");
  for (const Json& entry : j["log_history"]) {
    TESSERA_CHECK(entry.is_object() && entry.contains("step") && entry["step"].is_number_integer(),
                  where, ": every \"log_history\" entry needs an integer \"step\", got ",
                  entry.dump());
    s.log_history.push_back(entry);
  }
  if (j.contains("best_metric") && !j["best_metric"].is_null())
    s.best_metric = number("best_metric");
  if (j.contains("best_model_checkpoint") && !j["best_model_checkpoint"].is_null()) {
    TESSERA_CHECK(j["best_model_checkpoint"].is_string(), where,
                  ": \"best_model_checkpoint\" must be a string");
    s.best_model_checkpoint = j["best_model_checkpoint"].get<std::string>();
  }
  if (j.contains("stateful_callbacks")) {
    TESSERA_CHECK(j["stateful_callbacks"].is_object(), where,
                  ": \"stateful_callbacks\" must be an object");
    s.stateful_callbacks = j["stateful_callbacks"];
  }
  return s;
}

// ---- handler ----

void CallbackHandler::save_states(TrainerState& state) const {
  for (const auto& cb : callbacks_)
    if (!cb->state_name().empty()) state.stateful_callbacks[cb->state_name()] = cb->save_state();
}

void CallbackHandler::load_states(const TrainerState& state) {
  for (const auto& cb : callbacks_)
    if (!cb->state_name().empty() && state.stateful_callbacks.contains(cb->state_name()))
      cb->load_state(state.stateful_callbacks[cb->state_name()]);
}

// ---- the schedule ----

void DefaultFlowCallback::on_step_end(const TrainingArguments& args, TrainerState& state,
                                      TrainerControl& control) {
  const int64_t step = state.global_step;
  const bool last = step >= state.max_steps;
  const bool epoch_end = step % state.steps_per_epoch == 0;
  auto due = [&](const std::string& strategy, int64_t every) {
    if (strategy == "no") return false;
    if (last) return true;
    return strategy == "epoch" ? epoch_end : every > 0 && step % every == 0;
  };
  const bool log_due = args.logging_strategy == "epoch" ? epoch_end : step % args.logging_steps == 0;
  if (args.logging_strategy != "no" && (log_due || last)) control.should_log = true;
  if (due(args.eval_strategy, args.eval_steps)) control.should_evaluate = true;
  if (due(args.save_strategy, args.save_steps)) control.should_save = true;
}

// ---- early stopping ----

bool metric_improves(const TrainingArguments& args, double value, const std::optional<double>& best,
                     double threshold) {
  if (!std::isfinite(value)) return false;
  if (!best) return true;
  return args.greater_is_better ? value > *best + threshold : value < *best - threshold;
}

EarlyStoppingCallback::EarlyStoppingCallback(int64_t patience, double threshold)
    : patience_(patience), threshold_(threshold) {
  TESSERA_CHECK(patience >= 1, "EarlyStoppingCallback: patience must be at least 1, got ",
                patience);
  TESSERA_CHECK(threshold >= 0, "EarlyStoppingCallback: threshold must not be negative, got ",
                threshold);
}

void EarlyStoppingCallback::on_evaluate(const TrainingArguments& args, TrainerState& state,
                                        TrainerControl& control, const Metrics& metrics) {
  auto it = metrics.find(evaluation_metric_name(args.metric_for_best_model));
  TESSERA_CHECK(it != metrics.end(), "EarlyStoppingCallback: metric_for_best_model \"",
                args.metric_for_best_model, "\" is not among the evaluation's metrics");
  // Compared with the best before this evaluation (the Trainer records it afterwards).
  counter_ = metric_improves(args, it->second, state.best_metric, threshold_) ? 0 : counter_ + 1;
  if (counter_ >= patience_) control.should_stop = true;
}

void EarlyStoppingCallback::load_state(const Json& j) {
  TESSERA_CHECK(j.is_object() && j.contains("patience_counter") &&
                    j["patience_counter"].is_number_integer() &&
                    j["patience_counter"].get<int64_t>() >= 0,
                "trainer_state.json: EarlyStoppingCallback state is damaged: ", j.dump());
  counter_ = j["patience_counter"].get<int64_t>();
}

// ---- trackers ----

namespace {

// metrics.jsonl: one JSON object per line. A resumed run first drops the lines after its
// checkpoint's step (the interrupted run may have logged past it); lines it cannot read
// (e.g. a half-written last line) are dropped with them.
class JsonlTracker : public Tracker {
 public:
  explicit JsonlTracker(const TrackerContext& c) : path_(c.output_dir / "metrics.jsonl") {
    std::string kept;
    if (c.first_step > 0 && fs::exists(path_)) {
      std::ifstream in(path_);
      std::string line;
      while (std::getline(in, line)) {
        const Json j = Json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.is_object() && j.contains("step") &&
            j["step"].is_number_integer() && j["step"].get<int64_t>() <= c.first_step)
          kept += line + "\n";
      }
    }
    write_file_atomically(path_, kept);
    out_.open(path_, std::ios::app);
    TESSERA_CHECK(out_.good(), "metrics: cannot append to '", path_.string(), "'");
  }
  void log(const Json& record) override {
    out_ << record.dump() << "\n";
    out_.flush();
  }

 private:
  fs::path path_;
  std::ofstream out_;
};

// TensorBoard event files in output_dir/tensorboard: every number of a record as a scalar
// at its step and time; the settings as text at the first step. A resumed run writes a new
// event file beside the old ones (TensorBoard reads a folder's files as one run).
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const TrackerContext& c)
      : writer_(c.settings.value("logging_dir", std::string()).empty()
                    ? c.output_dir / "tensorboard"
                    : fs::path(c.settings["logging_dir"].get<std::string>())) {
    writer_.add_text("settings", "```\n" + c.settings.dump(2) + "\n```", c.first_step);
  }
  void log(const Json& record) override {
    writer_.add_metrics_row(record);
    writer_.flush();
  }

 private:
  dist::TensorBoardWriter writer_;
};

std::map<std::string, TrackerFactory>& tracker_factories() {
  static std::map<std::string, TrackerFactory> all = {
      {"jsonl", [](const TrackerContext& c) { return std::make_unique<JsonlTracker>(c); }},
      {"tensorboard",
       [](const TrackerContext& c) { return std::make_unique<TensorBoardTracker>(c); }},
      {"csv", general_tracker_factory("csv")},
      {"mlflow", general_tracker_factory("mlflow")}};
  return all;
}

}  // namespace

void register_tracker(const std::string& name, TrackerFactory factory) {
  tracker_factories()[name] = std::move(factory);
}
bool tracker_available(const std::string& name) { return tracker_factories().count(name) > 0; }

void TrackerCallback::on_train_begin(const TrainingArguments& args, TrainerState& state,
                                     TrainerControl&) {
  for (const std::string& name : args.report_to) {
    if (name == "none") continue;
    auto it = tracker_factories().find(name);
    TESSERA_CHECK(it != tracker_factories().end(), args.describe("report_to"), ": tracker \"", name,
                  "\" is not available in this build");
    trackers_.push_back(it->second({fs::path(args.output_dir), state.global_step, args.to_json()}));
  }
}

void TrackerCallback::on_log(const TrainingArguments&, TrainerState&, TrainerControl&,
                             const Json& logs) {
  Json record = logs;
  record["time"] = dist::unix_time_now();
  for (auto& t : trackers_) t->log(record);
}

void TrackerCallback::on_evaluate(const TrainingArguments&, TrainerState& state, TrainerControl&,
                                  const Metrics& metrics) {
  Json record = {{"step", state.global_step}};
  for (const auto& [k, v] : metrics) record[k] = v;
  record["time"] = dist::unix_time_now();
  for (auto& t : trackers_) t->log(record);
}

void TrackerCallback::on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) {
  for (auto& t : trackers_) t->close();
  trackers_.clear();
}

// ---- progress ----

void ProgressCallback::on_train_begin(const TrainingArguments&, TrainerState& state,
                                      TrainerControl&) {
  progress_ = std::make_unique<Progress>(state.max_steps, state.global_step, stdout);
}

void ProgressCallback::on_log(const TrainingArguments&, TrainerState& state, TrainerControl&,
                              const Json& logs) {
  auto number = [&](const char* key) {
    return logs[key].is_number() ? logs[key].get<double>() : NAN;
  };
  const bool tokens = logs.contains("tokens_per_s");
  if (progress_)
    progress_->update(state.global_step, number("loss"), number(tokens ? "tokens_per_s" : "samples_per_s"),
                      number("learning_rate"), tokens ? "tok" : "samples");
}

void ProgressCallback::on_evaluate(const TrainingArguments&, TrainerState& state, TrainerControl&,
                                   const Metrics& metrics) {
  std::string text = "step " + std::to_string(state.global_step) + ":";
  char value[64];
  for (const auto& [k, v] : metrics) {
    std::snprintf(value, sizeof(value), " %s %.4f", k.c_str(), v);
    text += value;
  }
  message(text);
}

void ProgressCallback::on_save(const TrainingArguments&, TrainerState&, TrainerControl&,
                               const fs::path& dir) {
  message("saved checkpoint " + dir.string());
}

void ProgressCallback::on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) {
  if (progress_) progress_->finish();
}

void ProgressCallback::message(const std::string& text) {
  if (progress_) {
    progress_->message(text);
  } else {
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  }
}

// ---- loss plot ----

void LossPlotCallback::on_train_end(const TrainingArguments& args, TrainerState& state,
                                    TrainerControl&) {
  LossCurves curves;
  state.log_history.for_each([&](const Json& j) {
    const double step = j["step"].get<double>();
    // A step whose loss was not finite is logged as null: it has no point on the curve.
    if (j.contains("loss") && j["loss"].is_number())
      curves.train.emplace_back(step, j["loss"].get<double>());
    // eval_loss; val_loss in the history of a run resumed from an older checkpoint.
    for (const char* key : {"eval_loss", "val_loss"})
      if (j.contains(key) && j[key].is_number()) curves.val.emplace_back(step, j[key].get<double>());
  });
  write_loss_curve_png((fs::path(args.output_dir) / "loss.png").string(), curves);
}

}  // namespace tessera::train
