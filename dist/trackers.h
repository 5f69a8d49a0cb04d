// Experiment trackers, as Accelerate's (accelerate.tracking): every tracker is a
// GeneralTracker, and the Accelerator (log_with, init_trackers, log, get_tracker,
// end_training) drives them on the main process only. Built in, all written by Tessera
// itself (no tracking library is needed, and nothing reaches the network):
//   "tensorboard": event files in <logging_dir>/<project_name> (dist/tensorboard.h);
//   "csv":         <logging_dir>/<project_name>/metrics.csv, a header of step and metric
//                  names and one row per log;
//   "mlflow":      an MLflow file store, <logging_dir>/mlruns (./mlruns without a
//                  logging_dir), that `mlflow ui` and MlflowClient read (dist/mlflow_store.h).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::dist {

// Accelerate's GeneralTracker: the interface a tracker of one's own implements too.
class GeneralTracker {
 public:
  virtual ~GeneralTracker() = default;
  virtual std::string name() const = 0;
  // Whether the tracker writes under the Accelerator's logging_dir (so one is needed).
  virtual bool requires_logging_directory() const = 0;
  // The run's configuration (hyperparameters): a JSON object.
  virtual void store_init_configuration(const nlohmann::json& values) = 0;
  // One log: a JSON object of name -> value (numbers; some trackers take text too) at `step`.
  virtual void log(const nlohmann::json& values, int64_t step) = 0;
  virtual void finish() {}
};

// The names log_with accepts ("all" means every one of them).
const std::vector<std::string>& builtin_tracker_names();
// The names with "all" expanded and repeats dropped; an error naming `where`, the unknown
// name and the known ones before anything is created.
std::vector<std::string> resolve_tracker_names(const std::vector<std::string>& names,
                                               const std::string& where);
// Whether a built-in tracker writes under logging_dir (tensorboard, csv).
bool builtin_tracker_requires_logging_directory(const std::string& name);

// One built-in tracker for `project_name`. `init_kwargs` (a JSON object, may be null) holds
// that tracker's own settings: mlflow takes run_name and tags (an object of strings); the
// others take none. Unknown keys are refused, naming them.
std::unique_ptr<GeneralTracker> make_builtin_tracker(const std::string& name,
                                                     const std::string& project_name,
                                                     const std::filesystem::path& logging_dir,
                                                     const nlohmann::json& init_kwargs);

// CSV: `file` gets a header (step, then metric names in the order they first appear) and
// one row per log; a value the log did not have is an empty cell. A name that appears after
// the first rows adds a column: the file is rewritten with the wider header and empty cells
// in the earlier rows (so it is one valid table at every moment). With keep_through_step
// >= 0 (a resumed run) the rows of an existing file up to that step are kept, later ones
// dropped; otherwise the file starts empty.
class CsvTracker : public GeneralTracker {
 public:
  explicit CsvTracker(std::filesystem::path file, int64_t keep_through_step = -1);
  std::string name() const override { return "csv"; }
  bool requires_logging_directory() const override { return true; }
  // Written beside the table as <stem>.config.json.
  void store_init_configuration(const nlohmann::json& values) override;
  void log(const nlohmann::json& values, int64_t step) override;
  const std::filesystem::path& path() const { return file_; }

 private:
  void add_columns(const std::vector<std::string>& names);
  std::filesystem::path file_;
  std::vector<std::string> columns_;  // without "step"
};

// A number as the shortest text that reads back as the same double ("nan", "inf" too).
std::string shortest_number_text(double value);

}  // namespace tessera::dist
