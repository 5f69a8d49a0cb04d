// TensorBoard event files without TensorFlow: TFRecord framing (length, masked CRC-32C,
// data, masked CRC-32C) around hand-encoded protobuf `Event` messages. Scalars are
// Summary.Value.simple_value; text goes to TensorBoard's text plugin (a string tensor).
// TensorBoard and its EventAccumulator read the files.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::train {

// CRC-32C (Castagnoli), the checksum of TFRecord framing; pass the previous value to continue.
uint32_t crc32c(std::span<const std::byte> bytes, uint32_t previous = 0);

// Seconds since the Unix epoch (an event's wall_time).
double unix_time_now();

class TensorBoardWriter {
 public:
  // Creates `log_dir` and events.out.tfevents.<unix time>.<host name> in it.
  explicit TensorBoardWriter(const std::filesystem::path& log_dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step,
                  double wall_time = unix_time_now());
  void add_text(const std::string& tag, const std::string& text, int64_t step,
                double wall_time = unix_time_now());
  // One metrics.jsonl row: every number in it except "step" and "time" becomes a scalar of
  // that name (loss, learning_rate, grad_norm, epoch, tokens_per_s, eval_loss, ...) at the row's "step", with
  // the row's "time" as wall time when it has one. Error naming the row without a step.
  void add_metrics_row(const nlohmann::json& row);
  void flush();  // hands written events to the OS, so a reading TensorBoard sees them
  const std::filesystem::path& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tessera::train
