// Training progress: a live bar redrawn in place on a terminal, plain lines otherwise
// (logs, pipes, CI), so both humans and scripts get something readable.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera::train {

class Progress {
 public:
  // `first_step` is where a resumed run starts counting (ETA uses only this run's pace).
  Progress(int64_t total_steps, int64_t first_step, std::FILE* out = stdout);
  void update(int64_t step, double loss, double tokens_per_s, double lr);
  // Prints a message on its own line (above the bar on a terminal).
  void message(const std::string& text);
  void finish();

 private:
  int64_t total_, first_;
  std::FILE* out_;
  bool live_;
  bool bar_drawn_ = false;
  int64_t print_every_;
  std::chrono::steady_clock::time_point start_;
};

std::string format_duration(double seconds);  // "1h02m", "3m05s", "12s"

}  // namespace tessera::train
