// The TensorBoard event writer: CRC-32C against its published check value, and event files
// read back by TensorBoard's own EventAccumulator with every tag, step, value and text equal.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "tessera/core/error.h"
#include "tests/nn/python_reference.h"
#include "tessera/train/tensorboard.h"

namespace fs = std::filesystem;
using tessera::train::crc32c;
using tessera::train::TensorBoardWriter;

namespace {

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

nlohmann::json read_with_tensorboard(const fs::path& dir) {
  const std::string cmd = tessera::test::python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/cli/tensorboard_read.py '" + dir.string() + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (pipe && std::fgets(buf, sizeof(buf), pipe)) out += buf;
  EXPECT_TRUE(pipe && ::pclose(pipe) == 0) << cmd;
  return nlohmann::json::parse(out, nullptr, false);
}

}  // namespace

TEST(TensorBoard, Crc32cMatchesTheCheckValue) {
  EXPECT_EQ(crc32c(bytes_of("123456789")), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c(bytes_of("")), 0u);
  EXPECT_EQ(crc32c(bytes_of("6789"), crc32c(bytes_of("12345"))), 0xE3069283u);  // continues
  EXPECT_EQ(crc32c(bytes_of(std::string(32, '\0'))), 0x8A9136AAu);              // RFC 3720 B.4
}

TEST(TensorBoard, EventAccumulatorReadsEveryScalarAndText) {
  if (!tessera::test::python_can_import("tensorboard")) GTEST_SKIP() << "no tensorboard package";
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_tb_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.f, 3.f);
  std::map<std::string, std::vector<std::pair<int64_t, float>>> written;
  const std::string settings = "lr: 3e-4\nbatch: 16\nüñíçødé: ✓";
  {
    TensorBoardWriter writer(dir);
    EXPECT_EQ(writer.path().filename().string().rfind("events.out.tfevents.", 0), 0u);
    writer.add_text("run/settings", settings, 0);
    for (int64_t step = 1; step <= 1500;
         ++step) {  // more than TensorBoard's default sample of 1000
      for (const char* tag : {"train/loss", "train/lr", "train/grad_norm"}) {
        const float value = noise(rng) * (step % 7 == 0 ? 1e-6f : 1.f);
        writer.add_scalar(tag, value, step, 1.7e9 + static_cast<double>(step));
        written[tag].emplace_back(step, value);
      }
      if (step % 500 == 0) {
        writer.add_scalar("eval/val_loss", 1.0 / static_cast<double>(step), step);
        written["eval/val_loss"].emplace_back(step, 1.f / static_cast<float>(step));
      }
    }
  }
  const nlohmann::json read = read_with_tensorboard(dir);
  ASSERT_TRUE(read.is_object());
  ASSERT_EQ(read["scalars"].size(), written.size());
  for (const auto& [tag, points] : written) {
    const auto& got = read["scalars"][tag];
    ASSERT_EQ(got.size(), points.size()) << tag;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(got[i][0].get<int64_t>(), points[i].first) << tag;
      EXPECT_EQ(got[i][1].get<float>(), points[i].second) << tag << " step " << points[i].first;
      if (tag != "eval/val_loss")
        EXPECT_EQ(got[i][2].get<double>(), 1.7e9 + static_cast<double>(points[i].first));
    }
  }
  ASSERT_EQ(read["texts"]["run/settings"].size(), 1u);
  EXPECT_EQ(read["texts"]["run/settings"][0][1], settings);
  fs::remove_all(dir);
}

// `tessera train --report-to tensorboard,jsonl`: TensorBoard's reader sees every number of
// every metrics.jsonl row, at the row's step and time (values as float32, as TensorBoard
// keeps them), and the run's settings as text.
TEST(TensorBoard, ReadsEveryScalarOfARealMetricsFile) {
  if (!tessera::test::python_can_import("tensorboard")) GTEST_SKIP() << "no tensorboard package";
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_tb_run_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  { std::ofstream(dir / "corpus.txt") << std::string(20000, 'a') + "The cat sat on the mat.\n"; }
  const std::string tessera = (fs::path(TESSERA_BINARY_DIR) / "tessera").string();
  const std::string cmd =
      "OMP_NUM_THREADS=2 " + tessera + " prepare --input '" + (dir / "corpus.txt").string() +
      "' --out '" + (dir / "data").string() + "' >/dev/null 2>&1 && OMP_NUM_THREADS=2 " + tessera +
      " train --data '" + (dir / "data" / "train.bin").string() +
      "' --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 2 --steps 12 --eval-every 4 "
      "--report-to tensorboard,jsonl --out '" + (dir / "run").string() + "' >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<nlohmann::json> rows;
  {
    std::ifstream in(dir / "run" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  }
  ASSERT_GE(rows.size(), 12u);
  const nlohmann::json read = read_with_tensorboard(dir / "run" / "tensorboard");
  ASSERT_TRUE(read.is_object());
  std::map<std::string, size_t> seen;
  for (const auto& row : rows) {
    for (const auto& [key, value] : row.items()) {
      if (key == "step" || key == "time" || !value.is_number()) continue;
      const size_t i = seen[key]++;
      ASSERT_LT(i, read["scalars"][key].size()) << key;
      const auto& got = read["scalars"][key][i];
      EXPECT_EQ(got[0].get<int64_t>(), row["step"].get<int64_t>()) << key;
      EXPECT_EQ(got[1].get<float>(), static_cast<float>(value.get<double>())) << key;
      EXPECT_DOUBLE_EQ(got[2].get<double>(), row["time"].get<double>()) << key;
    }
  }
  for (const char* key : {"loss", "learning_rate", "grad_norm", "tokens_per_s", "eval_loss"}) {
    EXPECT_GT(seen[key], 0u) << key;
    EXPECT_EQ(read["scalars"][key].size(), seen[key]) << key;
  }
  ASSERT_EQ(read["texts"]["settings"].size(), 1u);
  EXPECT_NE(read["texts"]["settings"][0][1].get<std::string>().find("\"max_steps\": 12"), std::string::npos)
      << read["texts"]["settings"][0][1];
  EXPECT_THROW(TensorBoardWriter(dir / "tb2").add_metrics_row({{"loss", 1.0}}), tessera::Error);
  fs::remove_all(dir);
}
