// MLflow's file store, written without MLflow: the folder layout its FileStore reads, so
// `mlflow ui --backend-store-uri <root>` and MlflowClient(tracking_uri=<root>) show the run
// (MLflow 3 reads a file store only with MLFLOW_ALLOW_FILE_STORE=true).
//   <root>/<experiment id>/meta.yaml         name, artifact_location, times, lifecycle_stage
//   <root>/<experiment id>/<run id>/meta.yaml run_id, run_name, status, start/end time, ...
//   .../<run id>/params/<key>                 the value as text
//   .../<run id>/metrics/<key>                a line "timestamp_ms value step" per value
//   .../<run id>/tags/<key>                   the value as text (mlflow.runName, mlflow.user, ...)
//   .../<run id>/artifacts/                   (empty)
// A new root also gets experiment 0 ("Default") and .trash, as MLflow makes them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace tessera::dist {

class MlflowFileStoreRun {
 public:
  // Opens (or creates) experiment `experiment_name` under `root` (found by the name in the
  // experiments' meta.yaml) and starts a new run in it, RUNNING.
  MlflowFileStoreRun(const std::filesystem::path& root, const std::string& experiment_name,
                     const std::string& run_name);
  // Keys: letters, digits, '_', '-', '.', ' ', ':' and '/' (MLflow's rule); otherwise an error
  // naming the key. A param, as in MLflow, cannot change its value once logged.
  void log_param(const std::string& key, const std::string& value);
  void log_metric(const std::string& key, double value, int64_t step, int64_t timestamp_ms);
  void set_tag(const std::string& key, const std::string& value);
  // Marks the run FINISHED with its end time (idempotent).
  void end_run();

  const std::string& experiment_id() const { return experiment_id_; }
  const std::string& run_id() const { return run_id_; }
  const std::filesystem::path& run_dir() const { return run_dir_; }

 private:
  void write_run_meta(int status, int64_t end_time_ms);
  std::filesystem::path root_, run_dir_;
  std::string experiment_id_, run_id_, run_name_;
  int64_t start_time_ms_ = 0;
  bool ended_ = false;
};

int64_t unix_time_millis_now();

}  // namespace tessera::dist
