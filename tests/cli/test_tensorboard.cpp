// The TensorBoard event writer: CRC-32C against its published check value, and event files
// read back by TensorBoard's own EventAccumulator with every tag, step, value and text equal.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "tests/nn/python_reference.h"
#include "train/tensorboard.h"

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
