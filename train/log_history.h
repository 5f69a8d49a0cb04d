// TrainerState's log_history: every log and evaluation of a run, in order, as Hugging Face
// keeps it in trainer_state.json. A long run logs tens of thousands of entries, so they are
// kept on disk (an anonymous temporary file, one compact JSON line each) rather than as
// JSON objects in memory, and read back in fixed-size pieces: a run's resident memory stays
// flat however long it trains (benchmarks/soak.sh checks it). Only the newest entry is held
// in memory. Copies are deep (each holds a file of its own).
#pragma once
#include <cstddef>
#include <cstdio>
#include <functional>
#include <memory>
#include <ostream>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tessera::train {

class LogHistory {
 public:
  LogHistory() = default;
  LogHistory(const LogHistory& other);
  LogHistory& operator=(const LogHistory& other);
  LogHistory(LogHistory&&) noexcept = default;
  LogHistory& operator=(LogHistory&&) noexcept = default;

  void push_back(const nlohmann::json& entry);
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const nlohmann::json& back() const;  // the newest entry; an error when empty
  // Calls `visit` with every entry in order, each read back from disk in turn.
  void for_each(const std::function<void(const nlohmann::json&)>& visit) const;
  // Writes the entries as a JSON array, one compact entry per line indented by `indent`
  // spaces (the closing bracket by indent - 2).
  void write_array(std::ostream& out, int indent) const;

 private:
  // Calls `visit` with every entry's line (without its newline), in order.
  void for_each_line(const std::function<void(std::string_view)>& visit) const;
  void open_file();
  void append(std::string_view bytes);

  struct CloseFile {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, CloseFile> file_;  // opened by the first push_back
  size_t size_ = 0;
  nlohmann::json last_;
};

}  // namespace tessera::train
