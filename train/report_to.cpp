#include "tessera/train/report_to.h"

#include "tessera/core/error.h"

namespace tessera::train {

namespace fs = std::filesystem;
using Json = nlohmann::json;

GeneralTrackerAdapter::GeneralTrackerAdapter(std::unique_ptr<dist::GeneralTracker> tracker)
    : tracker_(std::move(tracker)) {}

void GeneralTrackerAdapter::log(const Json& record) {
  TESSERA_CHECK(record.is_object() && record.contains("step") && record["step"].is_number_integer(),
                tracker_->name(), " tracker: record ", record.dump().substr(0, 120),
                " has no integer \"step\"");
  Json values = record;
  values.erase("step");
  values.erase("time");
  tracker_->log(values, record["step"].get<int64_t>());
}

void GeneralTrackerAdapter::close() { tracker_->finish(); }

namespace {

std::unique_ptr<dist::GeneralTracker> make_for_run(const std::string& name, const TrackerContext& c) {
  if (name == "csv")
    return std::make_unique<dist::CsvTracker>(c.output_dir / "metrics.csv",
                                              c.first_step > 0 ? c.first_step : -1);
  std::string experiment = fs::absolute(c.output_dir).lexically_normal().filename().string();
  if (experiment.empty()) experiment = "tessera";
  const std::string run =
      c.first_step > 0 ? experiment + "-resumed-at-" + std::to_string(c.first_step) : experiment;
  // make_builtin_tracker puts MLflow's store in <logging dir>/mlruns: output_dir/mlruns here.
  return dist::make_builtin_tracker(name, experiment, c.output_dir, Json{{"run_name", run}});
}

}  // namespace

TrackerFactory general_tracker_factory(const std::string& name) {
  TESSERA_CHECK(name == "csv" || name == "mlflow", "general_tracker_factory: no tracker \"", name, "\"");
  return [name](const TrackerContext& c) -> std::unique_ptr<Tracker> {
    auto tracker = make_for_run(name, c);
    tracker->store_init_configuration(c.settings);
    return std::make_unique<GeneralTrackerAdapter>(std::move(tracker));
  };
}

}  // namespace tessera::train
