// report_to's Accelerate-style trackers for the Trainer: "csv" and "mlflow" (dist/trackers.h)
// behind the Trainer's Tracker interface (callbacks.h), so TrackerCallback hands them every
// log and evaluation as it does metrics.jsonl and TensorBoard. In output_dir:
//   csv:    metrics.csv (and the run's settings in metrics.config.json); a resumed run keeps
//           the rows up to its checkpoint's step, as metrics.jsonl does;
//   mlflow: an MLflow file store, mlruns/, with one experiment named after output_dir and a
//           new run for each start or resume (the settings as params).
#pragma once
#include <memory>
#include <string>

#include "tessera/dist/trackers.h"
#include "tessera/train/callbacks.h"

namespace tessera::train {

// A Trainer Tracker that forwards each record ({"step", "time", metrics...}) to a
// GeneralTracker as log(metrics, step); "time" stays behind (the tracker stamps its own).
class GeneralTrackerAdapter : public Tracker {
 public:
  explicit GeneralTrackerAdapter(std::unique_ptr<dist::GeneralTracker> tracker);
  void log(const nlohmann::json& record) override;
  void close() override;
  dist::GeneralTracker& tracker() { return *tracker_; }

 private:
  std::unique_ptr<dist::GeneralTracker> tracker_;
};

// The factory TrackerCallback uses for "csv" or "mlflow".
TrackerFactory general_tracker_factory(const std::string& name);

}  // namespace tessera::train
