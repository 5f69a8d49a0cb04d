#include "tessera/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tessera::optim {

LRSchedule::LRSchedule(Optimizer& opt, DecayShape shape, ScheduleOptions opts)
    : opt_(opt), shape_(shape), opts_(opts) {
  TESSERA_CHECK(!opt.param_groups().empty(), "LRSchedule: the optimizer has no parameter groups");
  TESSERA_CHECK(opts.warmup >= 0, "LRSchedule: warmup must be >= 0, got ", opts.warmup);
  TESSERA_CHECK(shape == DecayShape::Constant || opts.total > opts.warmup,
                "LRSchedule: total (", opts.total, ") must exceed warmup (", opts.warmup,
                ") for a decaying schedule");
  base_lr_ = opt.param_groups().front().initial_lr;
  TESSERA_CHECK(base_lr_ > 0 || opts.min_lr == 0, "LRSchedule: min_lr ", opts.min_lr,
                " given but the base lr is ", base_lr_);
  TESSERA_CHECK(opts.min_lr >= 0 && opts.min_lr <= base_lr_, "LRSchedule: min_lr ", opts.min_lr,
                " must lie in [0, base lr ", base_lr_, "]");
  apply();
}

double LRSchedule::factor(int64_t step) const {
  if (step < opts_.warmup) return static_cast<double>(step + 1) / static_cast<double>(opts_.warmup);
  if (shape_ == DecayShape::Constant) return 1.0;
  const double floor = base_lr_ > 0 ? opts_.min_lr / base_lr_ : 0.0;
  if (step >= opts_.total) return floor;
  const double progress =
      static_cast<double>(step - opts_.warmup) / static_cast<double>(opts_.total - opts_.warmup);
  const double decay = shape_ == DecayShape::Cosine
                           ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress))
                           : 1.0 - progress;
  return floor + (1.0 - floor) * decay;
}

double LRSchedule::lr_at(int64_t step) const { return base_lr_ * factor(step); }

double LRSchedule::last_lr() const { return opt_.param_groups().front().lr; }

void LRSchedule::apply() {
  const double f = factor(step_);
  for (auto& g : opt_.param_groups()) g.lr = g.initial_lr * f;
}

void LRSchedule::step() {
  if (gate_ && !gate_()) return;
  ++step_;
  apply();
}

std::map<std::string, double> LRSchedule::state_dict() const {
  return {{"step", static_cast<double>(step_)},
          {"warmup", static_cast<double>(opts_.warmup)},
          {"total", static_cast<double>(opts_.total)},
          {"min_lr", opts_.min_lr},
          {"base_lr", base_lr_},
          {"shape", static_cast<double>(shape_)}};
}

void LRSchedule::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const char* key) {
    auto it = state.find(key);
    TESSERA_CHECK(it != state.end(), "LRSchedule::load_state_dict: missing '", key, "'");
    return it->second;
  };
  const auto check_same = [&](const char* key, double mine) {
    TESSERA_CHECK(get(key) == mine, "LRSchedule::load_state_dict: saved ", key, " = ", get(key),
                  " but this schedule has ", mine);
  };
  check_same("warmup", static_cast<double>(opts_.warmup));
  check_same("total", static_cast<double>(opts_.total));
  check_same("min_lr", opts_.min_lr);
  check_same("shape", static_cast<double>(shape_));
  step_ = static_cast<int64_t>(get("step"));
  apply();
}

}  // namespace tessera::optim
