// The Accelerator's experiment trackers (Accelerate's log_with, init_trackers, log,
// get_tracker): kept apart from accelerator.cpp, which is about training.
#include <algorithm>

#include "tessera/core/error.h"
#include "tessera/dist/accelerator.h"

namespace tessera::dist {

using Json = nlohmann::json;

namespace {

// What get_tracker returns off the main process: Accelerate's GeneralTracker(_blank=True).
class BlankTracker : public GeneralTracker {
 public:
  std::string name() const override { return ""; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const Json&) override {}
  void log(const Json&, int64_t) override {}
};

}  // namespace

std::string Accelerator::logging_dir() const {
  return options_.logging_dir.empty() ? options_.project_dir : options_.logging_dir;
}

void Accelerator::check_tracker_options() {
  log_with_names_ = resolve_tracker_names(options_.log_with, "Accelerator: log_with");
  for (const std::string& name : log_with_names_)
    TESSERA_CHECK(!builtin_tracker_requires_logging_directory(name) || !logging_dir().empty(),
                  "Accelerator: logging with \"", name,
                  "\" needs a logging_dir (or project_dir) to write into");
  for (const auto& tracker : options_.log_with_trackers)
    TESSERA_CHECK(tracker != nullptr, "Accelerator: log_with_trackers holds a null tracker");
}

void Accelerator::init_trackers(const std::string& project_name, const Json& config,
                                const Json& init_kwargs) {
  TESSERA_CHECK(init_kwargs.is_null() || init_kwargs.is_object(),
                "Accelerator.init_trackers: init_kwargs must be an object of {tracker name: "
                "settings}, got ", init_kwargs.dump());
  TESSERA_CHECK(config.is_null() || config.is_object(),
                "Accelerator.init_trackers: config must be an object, got ", config.dump());
  if (init_kwargs.is_object())
    for (const auto& [name, kwargs] : init_kwargs.items())
      TESSERA_CHECK(std::find(log_with_names_.begin(), log_with_names_.end(), name) !=
                        log_with_names_.end(),
                    "Accelerator.init_trackers: init_kwargs names \"", name,
                    "\", which is not among log_with");
  if (!is_main_process()) return;
  finish_trackers();  // a second init_trackers starts over, as Accelerate's
  for (const std::string& name : log_with_names_) {
    const Json kwargs = init_kwargs.is_object() ? init_kwargs.value(name, Json()) : Json();
    trackers_.push_back(make_builtin_tracker(name, project_name, logging_dir(), kwargs));
  }
  for (const auto& tracker : options_.log_with_trackers) trackers_.push_back(tracker);
  if (!config.is_null())
    for (const auto& tracker : trackers_) tracker->store_init_configuration(config);
}

void Accelerator::log(const Json& values, std::optional<int64_t> step) {
  TESSERA_CHECK(values.is_object(), "Accelerator.log: values must be an object of {name: value}, got ",
                values.dump().substr(0, 120));
  if (!is_main_process()) return;
  for (const auto& tracker : trackers_) tracker->log(values, step.value_or(0));
}

GeneralTracker& Accelerator::get_tracker(const std::string& name) {
  static BlankTracker blank;
  if (!is_main_process()) return blank;
  std::string there;
  for (const auto& tracker : trackers_) {
    if (tracker->name() == name) return *tracker;
    there += (there.empty() ? "" : ", ") + tracker->name();
  }
  TESSERA_FAIL("Accelerator.get_tracker: no tracker \"", name, "\" (the trackers are: ",
               there.empty() ? "none; init_trackers creates them" : there, ")");
}

void Accelerator::finish_trackers() {
  for (const auto& tracker : trackers_) tracker->finish();
  trackers_.clear();
}

}  // namespace tessera::dist
