#include "tessera/dist/mlflow_store.h"

#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/dist/env.h"
#include "tessera/dist/trackers.h"

namespace tessera::dist {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// MLflow's FileStore enum values, as its meta.yaml files store them.
constexpr int kRunRunning = 1, kRunFinished = 3;
constexpr int kSourceLocal = 4;

// A JSON string is a valid YAML double-quoted scalar, so meta.yaml needs no YAML emitter.
std::string yaml_text(const std::string& s) { return Json(s).dump(); }

// The experiment name of a meta.yaml line "name: ..." as MLflow (yaml.safe_dump) or this
// writer (JSON quoting) spells it.
std::string yaml_scalar_text(std::string value) {
  while (!value.empty() && (value.back() == '\r' || value.back() == ' ')) value.pop_back();
  if (value.size() >= 2 && value.front() == '"') {
    const Json parsed = Json::parse(value, nullptr, false);
    return parsed.is_string() ? parsed.get<std::string>() : value;
  }
  if (value.size() >= 2 && value.front() == '\'' && value.back() == '\'') {
    std::string out;
    for (size_t i = 1; i + 1 < value.size(); ++i) {
      out += value[i];
      if (value[i] == '\'' && value[i + 1] == '\'') ++i;  // '' is a quote inside ''
    }
    return out;
  }
  return value;
}

std::string experiment_name_in(const fs::path& meta) {
  std::ifstream in(meta);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("name: ", 0) == 0) return yaml_scalar_text(line.substr(6));
  return "";
}

std::string random_digits_id() {  // MLflow's experiment ids: a random positive integer
  std::random_device device;
  std::uniform_int_distribution<int64_t> pick(100'000'000'000'000'000, 999'999'999'999'999'999);
  return std::to_string(pick(device));
}

std::string random_hex_id() {  // MLflow's run ids: uuid4().hex, 32 hex digits
  std::random_device device;
  std::uniform_int_distribution<int> nibble(0, 15);
  std::string id;
  for (int i = 0; i < 32; ++i) id += "0123456789abcdef"[nibble(device)];
  return id;
}

std::string file_uri(const fs::path& p) { return "file://" + fs::absolute(p).lexically_normal().string(); }

void write_experiment(const fs::path& root, const std::string& id, const std::string& name) {
  const fs::path dir = root / id;
  fs::create_directories(dir / "tags");
  const int64_t now = unix_time_millis_now();
  std::ostringstream meta;
  meta << "artifact_location: " << yaml_text(file_uri(dir)) << "\n"
       << "creation_time: " << now << "\n"
       << "experiment_id: " << yaml_text(id) << "\n"
       << "last_update_time: " << now << "\n"
       << "lifecycle_stage: active\n"
       << "name: " << yaml_text(name) << "\n";
  write_file_atomically(dir / "meta.yaml", meta.str());
}

// The id of experiment `name` under root, created when there is none.
std::string find_or_create_experiment(const fs::path& root, const std::string& name) {
  if (!fs::exists(root / "0" / "meta.yaml")) write_experiment(root, "0", "Default");
  fs::create_directories(root / ".trash");
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.is_directory() && fs::exists(entry.path() / "meta.yaml") &&
        experiment_name_in(entry.path() / "meta.yaml") == name)
      return entry.path().filename().string();
  std::string id = random_digits_id();
  while (fs::exists(root / id)) id = random_digits_id();
  write_experiment(root, id, name);
  return id;
}

void check_key(const std::string& key, const char* what) {
  bool ok = !key.empty() && key.front() != '/' && key.find("..") == std::string::npos;
  for (char c : key)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || std::string("_-. :/").find(c) !=
                                                                    std::string::npos);
  TESSERA_CHECK(ok, "mlflow tracker: ", what, " name \"", key,
                "\" is not one MLflow accepts (letters, digits, '_', '-', '.', ' ', ':' and '/', "
                "not starting with '/', no '..')");
}

void append_line(const fs::path& file, const std::string& line) {
  fs::create_directories(file.parent_path());
  std::ofstream out(file, std::ios::app);
  out << line;
  TESSERA_CHECK(out.good(), "mlflow tracker: cannot append to '", file.string(), "'");
}

}  // namespace

int64_t unix_time_millis_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

MlflowFileStoreRun::MlflowFileStoreRun(const fs::path& root, const std::string& experiment_name,
                                       const std::string& run_name)
    : root_(root), run_name_(run_name) {
  TESSERA_CHECK(!experiment_name.empty(), "mlflow tracker: the experiment name is empty");
  fs::create_directories(root_);
  experiment_id_ = find_or_create_experiment(root_, experiment_name);
  run_id_ = random_hex_id();
  run_dir_ = root_ / experiment_id_ / run_id_;
  for (const char* sub : {"metrics", "params", "artifacts", "tags"})
    fs::create_directories(run_dir_ / sub);
  start_time_ms_ = unix_time_millis_now();
  write_run_meta(kRunRunning, -1);
  set_tag("mlflow.runName", run_name_);
  set_tag("mlflow.user", env_string("USER", "unknown"));
  set_tag("mlflow.source.name", "tessera");
  set_tag("mlflow.source.type", "LOCAL");
}

void MlflowFileStoreRun::write_run_meta(int status, int64_t end_time_ms) {
  std::ostringstream meta;
  meta << "artifact_uri: " << yaml_text(file_uri(run_dir_ / "artifacts")) << "\n"
       << "end_time: " << (end_time_ms < 0 ? std::string("null") : std::to_string(end_time_ms))
       << "\n"
       << "entry_point_name: ''\n"
       << "experiment_id: " << yaml_text(experiment_id_) << "\n"
       << "lifecycle_stage: active\n"
       << "run_id: " << run_id_ << "\n"
       << "run_name: " << yaml_text(run_name_) << "\n"
       << "run_uuid: " << run_id_ << "\n"
       << "source_name: ''\n"
       << "source_type: " << kSourceLocal << "\n"
       << "source_version: ''\n"
       << "start_time: " << start_time_ms_ << "\n"
       << "status: " << status << "\n"
       << "tags: []\n"
       << "user_id: " << yaml_text(env_string("USER", "unknown")) << "\n";
  write_file_atomically(run_dir_ / "meta.yaml", meta.str());
}

void MlflowFileStoreRun::log_param(const std::string& key, const std::string& value) {
  check_key(key, "param");
  const fs::path file = run_dir_ / "params" / key;
  if (fs::exists(file)) {
    std::ifstream in(file);
    const std::string old((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    TESSERA_CHECK(old == value, "mlflow tracker: param \"", key, "\" was logged as \"", old,
                  "\" and cannot change to \"", value, "\" (MLflow params are immutable)");
    return;
  }
  fs::create_directories(file.parent_path());
  write_file_atomically(file, value);
}

void MlflowFileStoreRun::log_metric(const std::string& key, double value, int64_t step,
                                    int64_t timestamp_ms) {
  check_key(key, "metric");
  append_line(run_dir_ / "metrics" / key, std::to_string(timestamp_ms) + " " +
                                              shortest_number_text(value) + " " +
                                              std::to_string(step) + "\n");
}

void MlflowFileStoreRun::set_tag(const std::string& key, const std::string& value) {
  check_key(key, "tag");
  const fs::path file = run_dir_ / "tags" / key;
  fs::create_directories(file.parent_path());
  write_file_atomically(file, value);
}

void MlflowFileStoreRun::end_run() {
  if (ended_) return;
  ended_ = true;
  write_run_meta(kRunFinished, unix_time_millis_now());
}

}  // namespace tessera::dist
