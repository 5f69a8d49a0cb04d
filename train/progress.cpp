#include "tessera/train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace tessera::train {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof(buf), "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60) std::snprintf(buf, sizeof(buf), "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(buf, sizeof(buf), "%lds", s);
  return buf;
}

void MovingAverage::add(double x) {
  sum_ = beta_ * sum_ + (1 - beta_) * x;
  weight_ = beta_ * weight_ + (1 - beta_);
  ++count_;
}

double MovingAverage::value() const { return count_ == 0 ? NAN : sum_ / weight_; }

Progress::Progress(int64_t total_steps, int64_t first_step, std::FILE* out)
    : total_(total_steps), first_(first_step), out_(out), live_(::isatty(::fileno(out)) != 0),
      print_every_(std::max<int64_t>(1, total_steps / 100)), last_update_(std::chrono::steady_clock::now()),
      last_step_(first_step) {}

void Progress::update(int64_t step, double loss, double tokens_per_s, double lr, const char* unit) {
  const auto now = std::chrono::steady_clock::now();
  if (step > last_step_) {  // seconds per step, smoothed, make the ETA
    seconds_per_step_.add(std::chrono::duration<double>(now - last_update_).count() /
                          static_cast<double>(step - last_step_));
  }
  last_update_ = now;
  last_step_ = step;
  if (std::isfinite(tokens_per_s) && tokens_per_s > 0) tokens_per_s_.add(tokens_per_s);
  if (!tokens_per_s_.empty()) tokens_per_s = tokens_per_s_.value();
  const double eta = seconds_per_step_.value() * static_cast<double>(total_ - step);
  if (live_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * static_cast<double>(step) / std::max<int64_t>(1, total_));
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\r[%s] %lld/%lld loss %.4f | %.0f %s/s | ETA %s   ", bar.c_str(),
                 static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s, unit,
                 format_duration(eta).c_str());
    bar_drawn_ = true;
  } else if (step % print_every_ == 0 || step == total_ || step == first_ + 1) {
    std::fprintf(out_, "step %lld/%lld | loss %.4f | lr %.3e | %.0f %s/s | ETA %s\n",
                 static_cast<long long>(step), static_cast<long long>(total_), loss, lr, tokens_per_s, unit,
                 format_duration(eta).c_str());
  }
  std::fflush(out_);
}

void Progress::message(const std::string& text) {
  if (bar_drawn_) std::fputc('\n', out_);
  bar_drawn_ = false;
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void Progress::finish() {
  if (bar_drawn_) std::fputc('\n', out_);
  bar_drawn_ = false;
  std::fflush(out_);
}

}  // namespace tessera::train
