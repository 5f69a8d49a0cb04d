// Training progress: a live bar redrawn in place on a terminal, plain lines otherwise
// (logs, pipes, CI), so both humans and scripts get something readable.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera::train {

// Exponential moving average with bias correction (as Adam's moments): the first values
// are not pulled toward zero, and one slow or fast step moves the average by 1 - beta.
class MovingAverage {
 public:
  explicit MovingAverage(double beta = 0.9) : beta_(beta) {}
  void add(double x);
  double value() const;  // NaN before the first add
  bool empty() const { return count_ == 0; }

 private:
  double beta_, sum_ = 0, weight_ = 0;
  int64_t count_ = 0;
};

// Shows a smoothed tokens/s (or samples/s) (the measured value of each step, averaged) and an ETA from the
// smoothed time per step, so one slow step (an evaluation, a checkpoint) or one fast one
// does not make the line jump.
class Progress {
 public:
  // `first_step` is where a resumed run starts counting (ETA uses only this run's pace).
  Progress(int64_t total_steps, int64_t first_step, std::FILE* out = stdout);
  // `rate` is in `unit` per second: tokens for a language model, samples for a classifier.
  void update(int64_t step, double loss, double rate, double lr, const char* unit = "tok");
  // Prints a message on its own line (above the bar on a terminal).
  void message(const std::string& text);
  void finish();

 private:
  int64_t total_, first_;
  std::FILE* out_;
  bool live_;
  bool bar_drawn_ = false;
  int64_t print_every_;
  std::chrono::steady_clock::time_point last_update_;
  MovingAverage tokens_per_s_, seconds_per_step_;
  int64_t last_step_;
};

std::string format_duration(double seconds);  // "1h02m", "3m05s", "12s"

}  // namespace tessera::train
