// `tessera train --report-to jsonl,csv,mlflow`: metrics.csv holds every metrics.jsonl value
// at its step, and MLflow's own client (PyPI's mlflow-skinny) reads the run's file store
// with every metric at its step (skipped without mlflow).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/nn/python_reference.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One small real run for both tests (its folder is made once per test program).
const fs::path& trained_run() {
  static const fs::path run = [] {
    const fs::path dir = tessera::test::scratch_dir("trackers_cli");
    { std::ofstream(dir / "corpus.txt") << std::string(20000, 'a') + "The cat sat on the mat.\n"; }
    const std::string tessera = (fs::path(TESSERA_BINARY_DIR) / "tessera").string();
    const std::string cmd =
        "OMP_NUM_THREADS=2 " + tessera + " prepare --input '" + (dir / "corpus.txt").string() +
        "' --out '" + (dir / "data").string() + "' >/dev/null 2>&1 && OMP_NUM_THREADS=2 " +
        tessera + " train --data '" + (dir / "data" / "train.bin").string() +
        "' --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 --steps 12 --eval-every 4 "
        "--report-to jsonl,csv,mlflow --out '" + (dir / "run").string() + "' >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return dir / "run";
  }();
  return run;
}

std::vector<json> jsonl_rows(const fs::path& file) {
  std::vector<json> rows;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  return rows;
}

std::vector<std::vector<std::string>> csv_rows(const fs::path& file) {
  std::vector<std::vector<std::string>> rows;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::stringstream s(line + ",");
    for (std::string cell; std::getline(s, cell, ',');) cells.push_back(cell);
    rows.push_back(cells);
  }
  return rows;
}

}  // namespace

TEST(TrackersCli, CsvHoldsEveryMetricsJsonlValueAtItsStep) {
  const fs::path run = trained_run();
  const std::vector<json> rows = jsonl_rows(run / "metrics.jsonl");
  const auto table = csv_rows(run / "metrics.csv");
  ASSERT_GE(rows.size(), 12u);
  ASSERT_EQ(table.size(), rows.size() + 1);  // the header, then a row per record
  const std::vector<std::string>& header = table[0];
  ASSERT_EQ(header[0], "step");
  std::map<std::string, size_t> column;
  for (size_t c = 0; c < header.size(); ++c) column[header[c]] = c;
  size_t compared = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    ASSERT_EQ(table[i + 1].size(), header.size()) << i;
    EXPECT_EQ(std::stoll(table[i + 1][0]), rows[i]["step"].get<int64_t>()) << i;
    for (const auto& [key, value] : rows[i].items()) {
      if (key == "step" || key == "time") continue;
      ASSERT_TRUE(column.count(key)) << key;
      const std::string& cell = table[i + 1][column[key]];
      if (value.is_number()) {
        EXPECT_EQ(std::strtod(cell.c_str(), nullptr), value.get<double>()) << key << " row " << i;
        ++compared;
      } else {
        EXPECT_EQ(cell, "") << key;
      }
    }
    for (const auto& [name, c] : column)  // a value the record did not have: an empty cell
      if (name != "step" && !rows[i].contains(name)) EXPECT_EQ(table[i + 1][c], "") << name;
  }
  EXPECT_GT(compared, 12u * 4);
  EXPECT_TRUE(column.count("val_loss") || column.count("eval_loss"));
  EXPECT_FALSE(column.count("time"));
}

TEST(TrackersCli, MlflowReadsEveryMetricAtItsStep) {
  if (!tessera::test::python_can_import("mlflow")) GTEST_SKIP() << "no mlflow package";
  const fs::path run = trained_run();
  const std::string cmd = tessera::test::python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/cli/mlflow_read.py '" + (run / "mlruns").string() + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (pipe && std::fgets(buf, sizeof(buf), pipe)) out += buf;
  ASSERT_TRUE(pipe && ::pclose(pipe) == 0) << cmd;
  const json read = json::parse(out);
  ASSERT_TRUE(read["experiments"].contains("run")) << read["experiments"].dump();
  json runs = json::array();
  for (const json& r : read["runs"])
    if (r["experiment"] == "run") runs.push_back(r);
  ASSERT_EQ(runs.size(), 1u);
  const json& mlrun = runs[0];
  EXPECT_EQ(mlrun["status"], "FINISHED");
  EXPECT_EQ(mlrun["name"], "run");
  EXPECT_EQ(mlrun["params"]["max_steps"], "12");
  std::map<std::string, size_t> seen;
  for (const json& row : jsonl_rows(run / "metrics.jsonl")) {
    for (const auto& [key, value] : row.items()) {
      if (key == "step" || key == "time" || !value.is_number()) continue;
      const size_t i = seen[key]++;
      ASSERT_TRUE(mlrun["metrics"].contains(key)) << key;
      ASSERT_LT(i, mlrun["metrics"][key].size()) << key;
      const json& point = mlrun["metrics"][key][i];
      EXPECT_EQ(point[0].get<int64_t>(), row["step"].get<int64_t>()) << key;
      EXPECT_EQ(point[1].get<double>(), value.get<double>()) << key;
    }
  }
  for (const auto& [key, count] : seen) EXPECT_EQ(mlrun["metrics"][key].size(), count) << key;
  EXPECT_GE(seen.size(), 5u);
}
