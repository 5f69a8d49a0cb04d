#include "tessera/dist/trackers.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <iostream>
#include <set>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/dist/mlflow_store.h"
#include "tessera/dist/tensorboard.h"

namespace tessera::dist {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// `kwargs` may only hold `allowed` keys.
void check_init_kwargs(const std::string& tracker, const Json& kwargs,
                       const std::vector<std::string>& allowed) {
  if (kwargs.is_null()) return;
  TESSERA_CHECK(kwargs.is_object(), "init_trackers: init_kwargs[\"", tracker,
                "\"] must be an object, got ", kwargs.dump());
  for (const auto& [key, value] : kwargs.items())
    TESSERA_CHECK(std::find(allowed.begin(), allowed.end(), key) != allowed.end(),
                  "init_trackers: init_kwargs[\"", tracker, "\"] has the unknown key \"", key,
                  "\" (", tracker, " takes ", allowed.empty() ? "none" : joined(allowed), ")");
}

// Accelerate's TensorBoardTracker: numbers as scalars, text through the text plugin, an
// object of numbers as scalars "<name>/<key>"; the configuration as text and hparams.yml.
class TensorBoardTracker : public GeneralTracker {
 public:
  explicit TensorBoardTracker(const fs::path& dir) : dir_(dir), writer_(dir) {}
  std::string name() const override { return "tensorboard"; }
  bool requires_logging_directory() const override { return true; }
  void store_init_configuration(const Json& values) override {
    writer_.add_text("hparams", "```\n" + values.dump(2) + "\n```", 0);
    writer_.flush();
    // JSON is YAML too (flow style), so hparams.yml reads back with any YAML reader.
    write_file_atomically(dir_ / "hparams.yml", values.dump(2) + "\n");
  }
  void log(const Json& values, int64_t step) override {
    const double now = unix_time_now();
    for (const auto& [key, value] : values.items()) {
      if (value.is_number()) {
        writer_.add_scalar(key, value.get<double>(), step, now);
      } else if (value.is_string()) {
        writer_.add_text(key, value.get<std::string>(), step, now);
      } else if (value.is_object()) {
        for (const auto& [sub, number] : value.items())
          if (number.is_number()) writer_.add_scalar(key + "/" + sub, number.get<double>(), step, now);
      }
    }
    writer_.flush();
  }
  void finish() override { writer_.flush(); }

 private:
  fs::path dir_;
  TensorBoardWriter writer_;
};

// Accelerate's MLflowTracker over Tessera's own file-store writer: the configuration as
// params (values longer than MLflow's 6000 characters are skipped, as Accelerate does),
// numbers as metrics at the step; other values are skipped.
class MlflowTracker : public GeneralTracker {
 public:
  MlflowTracker(const fs::path& root, const std::string& experiment, const Json& kwargs)
      : run_(root, experiment, run_name_of(kwargs, experiment)) {
    if (kwargs.is_object() && kwargs.contains("tags")) {
      const Json& tags = kwargs["tags"];
      TESSERA_CHECK(tags.is_object(), "init_trackers: init_kwargs[\"mlflow\"][\"tags\"] must be an "
                                      "object of strings, got ", tags.dump());
      for (const auto& [key, value] : tags.items())
        run_.set_tag(key, value.is_string() ? value.get<std::string>() : value.dump());
    }
  }
  std::string name() const override { return "mlflow"; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const Json& values) override {
    constexpr size_t kMaxParamLength = 6000;
    for (const auto& [key, value] : values.items()) {
      const std::string text = value.is_string() ? value.get<std::string>() : value.dump();
      if (text.size() > kMaxParamLength) {
        std::cerr << "mlflow tracker: param \"" << key << "\" is " << text.size()
                  << " characters, more than MLflow's " << kMaxParamLength << "; not logged\n";
        continue;
      }
      run_.log_param(key, text);
    }
  }
  void log(const Json& values, int64_t step) override {
    const int64_t now = unix_time_millis_now();
    for (const auto& [key, value] : values.items())
      if (value.is_number()) run_.log_metric(key, value.get<double>(), step, now);
  }
  void finish() override { run_.end_run(); }

 private:
  static std::string run_name_of(const Json& kwargs, const std::string& fallback) {
    if (!kwargs.is_object() || !kwargs.contains("run_name")) return fallback;
    TESSERA_CHECK(kwargs["run_name"].is_string(),
                  "init_trackers: init_kwargs[\"mlflow\"][\"run_name\"] must be text, got ",
                  kwargs["run_name"].dump());
    return kwargs["run_name"].get<std::string>();
  }
  MlflowFileStoreRun run_;
};

// CSV quoting: a cell with a comma, quote or line break is quoted, quotes doubled.
std::string csv_cell(const Json& value) {
  if (value.is_null()) return "";
  if (value.is_number()) return shortest_number_text(value.get<double>());
  const std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
  return quoted + "\"";
}

std::string csv_line(const std::vector<std::string>& cells) {
  std::string line;
  for (size_t i = 0; i < cells.size(); ++i) line += (i ? "," : "") + cells[i];
  return line + "\n";
}

// The header's names of an existing table (log() refuses names that would need quoting).
std::vector<std::string> csv_header_names(const std::string& header) {
  std::vector<std::string> names;
  std::string cell;
  for (char c : header + ",") {
    if (c == ',') {
      names.push_back(cell);
      cell.clear();
    } else if (c != '\r') {
      cell += c;
    }
  }
  return names;
}

}  // namespace

std::string shortest_number_text(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[64];
  const auto result = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, result.ptr);
}

const std::vector<std::string>& builtin_tracker_names() {
  static const std::vector<std::string> names = {"tensorboard", "csv", "mlflow"};
  return names;
}

std::vector<std::string> resolve_tracker_names(const std::vector<std::string>& names,
                                               const std::string& where) {
  const auto& known = builtin_tracker_names();
  std::vector<std::string> resolved;
  auto add = [&](const std::string& n) {
    if (std::find(resolved.begin(), resolved.end(), n) == resolved.end()) resolved.push_back(n);
  };
  for (const std::string& name : names) {
    if (name == "all") {
      for (const std::string& n : known) add(n);
      continue;
    }
    TESSERA_CHECK(std::find(known.begin(), known.end(), name) != known.end(), where,
                  ": unknown tracker \"", name, "\" (known: ", joined(known),
                  ", all; a tracker of another kind is passed as an object with the "
                  "GeneralTracker interface)");
    add(name);
  }
  return resolved;
}

bool builtin_tracker_requires_logging_directory(const std::string& name) {
  return name == "tensorboard" || name == "csv";
}

std::unique_ptr<GeneralTracker> make_builtin_tracker(const std::string& name,
                                                     const std::string& project_name,
                                                     const fs::path& logging_dir,
                                                     const Json& init_kwargs) {
  TESSERA_CHECK(!project_name.empty(), "init_trackers: project_name is empty");
  if (name == "tensorboard") {
    check_init_kwargs(name, init_kwargs, {});
    return std::make_unique<TensorBoardTracker>(logging_dir / project_name);
  }
  if (name == "csv") {
    check_init_kwargs(name, init_kwargs, {});
    return std::make_unique<CsvTracker>(logging_dir / project_name / "metrics.csv");
  }
  TESSERA_CHECK(name == "mlflow", "init_trackers: unknown tracker \"", name, "\" (known: ",
                joined(builtin_tracker_names()), ")");
  check_init_kwargs(name, init_kwargs, {"run_name", "tags"});
  return std::make_unique<MlflowTracker>(logging_dir.empty() ? fs::path("mlruns")
                                                             : logging_dir / "mlruns",
                                         project_name, init_kwargs);
}

// ---- CSV ----

CsvTracker::CsvTracker(fs::path file, int64_t keep_through_step) : file_(std::move(file)) {
  if (file_.has_parent_path()) fs::create_directories(file_.parent_path());
  std::string kept;
  if (keep_through_step >= 0 && fs::exists(file_)) {
    std::ifstream in(file_);
    std::string line;
    if (std::getline(in, line)) {
      std::vector<std::string> names = csv_header_names(line);
      if (!names.empty() && names.front() == "step") {
        columns_.assign(names.begin() + 1, names.end());
        kept = line + "\n";
        // Rows start with their step; a row that does not parse (a torn last line) goes too.
        while (std::getline(in, line)) {
          int64_t step = -1;
          const auto parsed = std::from_chars(line.data(), line.data() + line.size(), step);
          if (parsed.ec == std::errc() && parsed.ptr != line.data() + line.size() &&
              *parsed.ptr == ',' && step <= keep_through_step)
            kept += line + "\n";
        }
      }
    }
  }
  if (kept.empty()) kept = csv_line({"step"});
  write_file_atomically(file_, kept);
}

void CsvTracker::store_init_configuration(const Json& values) {
  write_file_atomically(fs::path(file_).replace_extension(".config.json"), values.dump(2) + "\n");
}

void CsvTracker::add_columns(const std::vector<std::string>& names) {
  // Rewrites the table with the wider header; earlier rows get empty cells for the new names.
  std::ifstream in(file_);
  std::string line, text;
  std::getline(in, line);
  columns_.insert(columns_.end(), names.begin(), names.end());
  std::vector<std::string> header = {"step"};
  header.insert(header.end(), columns_.begin(), columns_.end());
  text = csv_line(header);
  const std::string padding(names.size(), ',');
  while (std::getline(in, line)) text += line + padding + "\n";
  in.close();
  write_file_atomically(file_, text);
}

void CsvTracker::log(const Json& values, int64_t step) {
  TESSERA_CHECK(values.is_object(), "csv tracker: log values must be an object, got ",
                values.dump().substr(0, 120));
  std::vector<std::string> fresh;
  for (const auto& [key, value] : values.items())
    if (key != "step" && std::find(columns_.begin(), columns_.end(), key) == columns_.end()) {
      TESSERA_CHECK(key.find_first_of(",\"\n\r") == std::string::npos, "csv tracker: metric name \"",
                    key, "\" has a comma, quote or line break, which a CSV header cannot hold plainly");
      fresh.push_back(key);
    }
  if (!fresh.empty()) add_columns(fresh);
  std::vector<std::string> cells = {std::to_string(step)};
  for (const std::string& c : columns_) cells.push_back(values.contains(c) ? csv_cell(values[c]) : "");
  std::ofstream out(file_, std::ios::app);
  out << csv_line(cells);
  TESSERA_CHECK(out.good(), "csv tracker: cannot append to '", file_.string(), "'");
}

}  // namespace tessera::dist
