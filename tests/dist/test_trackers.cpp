// The Accelerator's experiment trackers (Accelerate's log_with / init_trackers / log /
// get_tracker / end_training) and the CSV and MLflow file-store writers, read back
// independently of the writers (plain parsing of the files).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "tessera/core/error.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/mlflow_store.h"
#include "tessera/dist/trackers.h"
#include "tests/autograd/gradcheck.h"  // error_of

namespace fs = std::filesystem;
using nlohmann::json;
using tessera::testing::error_of;
namespace dist = tessera::dist;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_trackers_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  return dir;
}

std::vector<std::vector<std::string>> read_csv(const fs::path& file) {  // no quoted cells
  std::vector<std::vector<std::string>> rows;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::string cell;
    std::stringstream s(line + ",");
    while (std::getline(s, cell, ',')) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Records what the Accelerator hands it, as a user's own tracker would.
class RecordingTracker : public dist::GeneralTracker {
 public:
  std::string name() const override { return "recording"; }
  bool requires_logging_directory() const override { return false; }
  void store_init_configuration(const json& values) override { configs.push_back(values); }
  void log(const json& values, int64_t step) override { logs.push_back({values, step}); }
  void finish() override { ++finished; }
  std::vector<json> configs;
  std::vector<std::pair<json, int64_t>> logs;
  int finished = 0;
};

}  // namespace

TEST(AcceleratorTrackers, UnknownLogWithNameIsRefusedNamingItAndTheKnownOnesBeforeAnyWork) {
  const fs::path dir = fresh_dir("unknown");
  const bool group_before = dist::is_initialized();
  const std::string e = error_of([&] {
    dist::Accelerator acc({.cpu = true, .log_with = {"csv", "wandb"}, .project_dir = dir.string()});
  });
  EXPECT_NE(e.find("\"wandb\""), std::string::npos) << e;
  EXPECT_NE(e.find("known: tensorboard, csv, mlflow, all"), std::string::npos) << e;
  EXPECT_NE(e.find("log_with"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir));                          // nothing written
  EXPECT_EQ(dist::is_initialized(), group_before);        // no process group made
  EXPECT_EQ(dist::resolve_tracker_names({"all", "csv"}, "x"),
            (std::vector<std::string>{"tensorboard", "csv", "mlflow"}));
}

TEST(AcceleratorTrackers, TrackersThatWriteFilesNeedALoggingDir) {
  for (const char* name : {"tensorboard", "csv"}) {
    const std::string e = error_of([&] { dist::Accelerator acc({.cpu = true, .log_with = {name}}); });
    EXPECT_NE(e.find("needs a logging_dir"), std::string::npos) << e;
    EXPECT_NE(e.find(name), std::string::npos) << e;
  }
}

TEST(AcceleratorTrackers, CsvHoldsEveryLoggedValueAtItsStepAndWidensForLaterNames) {
  const fs::path dir = fresh_dir("csv");
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<std::tuple<int64_t, double, std::optional<double>>> logged;
  {
    dist::Accelerator acc({.cpu = true, .log_with = {"csv"}, .logging_dir = dir.string()});
    acc.init_trackers("proj", {{"lr", 0.001}, {"model", "gpt"}});
    for (int64_t step = 1; step <= 13; ++step) {
      const double loss = normal(rng) * 1e-3 + 1.0 / 3.0;
      json values = {{"loss", loss}};
      std::optional<double> eval;
      if (step >= 5 && step % 4 == 1) eval = normal(rng);  // a name that appears later
      if (eval) values["eval_loss"] = *eval;
      acc.log(values, step * 3);
      logged.emplace_back(step * 3, loss, eval);
    }
    EXPECT_EQ(acc.get_tracker("csv").name(), "csv");
    acc.end_training();
  }
  const auto rows = read_csv(dir / "proj" / "metrics.csv");
  ASSERT_EQ(rows.size(), logged.size() + 1);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"step", "loss", "eval_loss"}));
  for (size_t i = 0; i < logged.size(); ++i) {
    const auto& [step, loss, eval] = logged[i];
    ASSERT_EQ(rows[i + 1].size(), 3u) << i;
    EXPECT_EQ(std::stoll(rows[i + 1][0]), step);
    EXPECT_EQ(std::strtod(rows[i + 1][1].c_str(), nullptr), loss);  // exact: shortest round trip
    if (eval)
      EXPECT_EQ(std::strtod(rows[i + 1][2].c_str(), nullptr), *eval);
    else
      EXPECT_EQ(rows[i + 1][2], "");
  }
  EXPECT_EQ(json::parse(read_text(dir / "proj" / "metrics.config.json"))["model"], "gpt");
  fs::remove_all(dir);
}

TEST(CsvTracker, AResumedTableKeepsItsRowsThroughTheStepAndDropsLaterOnes) {
  const fs::path file = fresh_dir("csv_resume") / "m.csv";
  {
    dist::CsvTracker t(file);
    for (int64_t s = 1; s <= 6; ++s) t.log({{"loss", s * 0.5}, {"lr", 1e-3}}, s);
  }
  {
    dist::CsvTracker t(file, 4);
    t.log({{"loss", 9.0}, {"grad_norm", 2.0}}, 5);
  }
  const auto rows = read_csv(file);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"step", "loss", "lr", "grad_norm"}));
  EXPECT_EQ(rows[4], (std::vector<std::string>{"4", "2", "0.001", ""}));
  EXPECT_EQ(rows[5], (std::vector<std::string>{"5", "9", "", "2"}));
  EXPECT_NE(error_of([&] { dist::CsvTracker(file).log({{"a,b", 1}}, 1); }).find("\"a,b\""),
            std::string::npos);
  fs::remove_all(file.parent_path());
}

TEST(AcceleratorTrackers, ATrackerObjectReceivesTheConfigEveryLogAndFinish) {
  auto mine = std::make_shared<RecordingTracker>();
  dist::Accelerator acc({.cpu = true, .log_with_trackers = {mine}});
  const json config = {{"lr", 3e-4}, {"layers", 2}};
  acc.init_trackers("proj", config);
  acc.log({{"loss", 2.5}}, 1);
  acc.log({{"loss", 2.25}, {"acc", 0.5}});
  ASSERT_EQ(mine->configs.size(), 1u);
  EXPECT_EQ(mine->configs[0], config);
  ASSERT_EQ(mine->logs.size(), 2u);
  EXPECT_EQ(mine->logs[0].first, json({{"loss", 2.5}}));
  EXPECT_EQ(mine->logs[0].second, 1);
  EXPECT_EQ(mine->logs[1].second, 0);  // no step: 0, as Accelerate's trackers store None
  EXPECT_EQ(&acc.get_tracker("recording"), mine.get());
  const std::string e = error_of([&] { acc.get_tracker("tensorboard"); });
  EXPECT_NE(e.find("\"tensorboard\""), std::string::npos) << e;
  EXPECT_NE(e.find("recording"), std::string::npos) << e;
  EXPECT_EQ(mine->finished, 0);
  acc.end_training();
  EXPECT_EQ(mine->finished, 1);
}

TEST(AcceleratorTrackers, InitKwargsAreCheckedByTrackerAndKey) {
  const fs::path dir = fresh_dir("kwargs");
  dist::Accelerator acc({.cpu = true, .log_with = {"mlflow"}, .logging_dir = dir.string()});
  std::string e = error_of([&] { acc.init_trackers("p", nullptr, {{"wandb", json::object()}}); });
  EXPECT_NE(e.find("\"wandb\", which is not among log_with"), std::string::npos) << e;
  e = error_of([&] { acc.init_trackers("p", nullptr, {{"mlflow", {{"tracking_uri", "x"}}}}); });
  EXPECT_NE(e.find("unknown key \"tracking_uri\""), std::string::npos) << e;
  EXPECT_NE(e.find("run_name, tags"), std::string::npos) << e;
  fs::remove_all(dir);
}

// The file store as MLflow's FileStore lays it out: experiments found by name, each run a
// folder with meta.yaml, params, tags and metric lines "timestamp value step".
TEST(MlflowFileStore, RunsLandInTheNamedExperimentWithMetricLinesAndParams) {
  const fs::path dir = fresh_dir("mlflow");
  std::vector<std::string> run_ids;
  for (int run = 0; run < 2; ++run) {
    dist::Accelerator acc({.cpu = true, .log_with = {"mlflow"}, .project_dir = dir.string()});
    acc.init_trackers("my project", {{"lr", 0.1}, {"name", "x: y"}},
                      {{"mlflow", {{"run_name", "r" + std::to_string(run)}, {"tags", {{"team", "a"}}}}}});
    acc.log({{"loss", 1.0 / 3.0}, {"eval/loss", -2e-7}, {"note", "text is skipped"}}, 4);
    acc.log({{"loss", 0.25}}, 9);
    acc.end_training();
  }
  const fs::path root = dir / "mlruns";
  EXPECT_NE(read_text(root / "0" / "meta.yaml").find("name: \"Default\""), std::string::npos);
  std::vector<fs::path> experiments;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && e.path().filename() != "0" && e.path().filename() != ".trash")
      experiments.push_back(e.path());
  ASSERT_EQ(experiments.size(), 1u);  // the second run found the experiment by its name
  const std::string experiment_meta = read_text(experiments[0] / "meta.yaml");
  EXPECT_NE(experiment_meta.find("name: \"my project\""), std::string::npos) << experiment_meta;
  EXPECT_NE(experiment_meta.find("experiment_id: \"" + experiments[0].filename().string() + "\""),
            std::string::npos);
  int runs = 0;
  for (const auto& r : fs::directory_iterator(experiments[0])) {
    if (!fs::exists(r.path() / "meta.yaml")) continue;
    ++runs;
    const std::string meta = read_text(r.path() / "meta.yaml");
    EXPECT_NE(meta.find("run_id: " + r.path().filename().string()), std::string::npos) << meta;
    EXPECT_NE(meta.find("status: 3"), std::string::npos) << meta;  // FINISHED
    EXPECT_EQ(read_text(r.path() / "params" / "lr"), "0.1");
    EXPECT_EQ(read_text(r.path() / "params" / "name"), "x: y");
    EXPECT_EQ(read_text(r.path() / "tags" / "team"), "a");
    EXPECT_TRUE(fs::is_directory(r.path() / "artifacts"));
    EXPECT_FALSE(fs::exists(r.path() / "metrics" / "note"));
    std::ifstream loss(r.path() / "metrics" / "loss");
    int64_t ts, step;
    std::string value;
    ASSERT_TRUE(loss >> ts >> value >> step);
    EXPECT_EQ(std::strtod(value.c_str(), nullptr), 1.0 / 3.0);
    EXPECT_EQ(step, 4);
    EXPECT_GT(ts, 1'600'000'000'000);
    ASSERT_TRUE(loss >> ts >> value >> step);
    EXPECT_EQ(value, "0.25");
    EXPECT_EQ(step, 9);
    std::ifstream nested(r.path() / "metrics" / "eval" / "loss");
    ASSERT_TRUE(nested >> ts >> value >> step);
    EXPECT_EQ(std::strtod(value.c_str(), nullptr), -2e-7);
  }
  EXPECT_EQ(runs, 2);
  dist::MlflowFileStoreRun run(root, "my project", "r");
  EXPECT_NE(error_of([&] { run.log_metric("bad\"key", 1, 0, 0); }).find("\"bad\"key\""),
            std::string::npos);
  run.log_param("p", "1");
  EXPECT_NE(error_of([&] { run.log_param("p", "2"); }).find("immutable"), std::string::npos);
  fs::remove_all(dir);
}

TEST(ShortestNumberText, ReadsBackAsTheSameDouble) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> exponent(-300, 300);
  for (int i = 0; i < 2000; ++i) {
    const double v = std::pow(10.0, exponent(rng)) * (i % 2 ? -1 : 1) * (1 + i * 1e-9);
    EXPECT_EQ(std::strtod(dist::shortest_number_text(v).c_str(), nullptr), v);
  }
  EXPECT_EQ(dist::shortest_number_text(0.25), "0.25");
  EXPECT_EQ(dist::shortest_number_text(std::nan("")), "nan");
}
