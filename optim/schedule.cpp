#include "tessera/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tessera::optim {

namespace {

double tessera_factor(DecayShape shape, const ScheduleOptions& opts, double base_lr, int64_t step) {
  if (step < opts.warmup) return static_cast<double>(step + 1) / static_cast<double>(opts.warmup);
  if (shape == DecayShape::Constant) return 1.0;
  const double floor = base_lr > 0 ? opts.min_lr / base_lr : 0.0;
  if (step >= opts.total) return floor;
  const double progress =
      static_cast<double>(step - opts.warmup) / static_cast<double>(opts.total - opts.warmup);
  const double decay = shape == DecayShape::Cosine
                           ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress))
                           : 1.0 - progress;
  return floor + (1.0 - floor) * decay;
}

double first_initial_lr(const Optimizer& opt) {
  TESSERA_CHECK(!opt.param_groups().empty(), "LRSchedule: the optimizer has no parameter groups");
  return opt.param_groups().front().initial_lr;
}

}  // namespace

LRSchedule::LRSchedule(Optimizer& opt, DecayShape shape, ScheduleOptions opts)
    : opt_(opt), base_lr_(first_initial_lr(opt)) {
  TESSERA_CHECK(opts.warmup >= 0, "LRSchedule: warmup must be >= 0, got ", opts.warmup);
  TESSERA_CHECK(shape == DecayShape::Constant || opts.total > opts.warmup,
                "LRSchedule: total (", opts.total, ") must exceed warmup (", opts.warmup,
                ") for a decaying schedule");
  TESSERA_CHECK(base_lr_ > 0 || opts.min_lr == 0, "LRSchedule: min_lr ", opts.min_lr,
                " given but the base lr is ", base_lr_);
  TESSERA_CHECK(opts.min_lr >= 0 && opts.min_lr <= base_lr_, "LRSchedule: min_lr ", opts.min_lr,
                " must lie in [0, base lr ", base_lr_, "]");
  factor_ = [shape, opts, base = base_lr_](int64_t step) {
    return tessera_factor(shape, opts, base, step);
  };
  // The keys checkpoints have always held for these shapes.
  identity_ = {{"warmup", static_cast<double>(opts.warmup)},
               {"total", static_cast<double>(opts.total)},
               {"min_lr", opts.min_lr},
               {"base_lr", base_lr_},
               {"shape", static_cast<double>(shape)}};
  apply();
}

LRSchedule::LRSchedule(Optimizer& opt, Factor factor, std::map<std::string, double> identity)
    : opt_(opt), base_lr_(first_initial_lr(opt)), factor_(std::move(factor)),
      identity_(std::move(identity)) {
  TESSERA_CHECK(factor_ != nullptr, "LRSchedule: no factor function given");
  TESSERA_CHECK(!identity_.count("step"), "LRSchedule: \"step\" cannot name a schedule setting");
  identity_["base_lr"] = base_lr_;
  apply();
}

double LRSchedule::factor(int64_t step) const { return factor_(step); }

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
  std::map<std::string, double> state = identity_;
  state["step"] = static_cast<double>(step_);
  return state;
}

void LRSchedule::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const std::string& key) {
    auto it = state.find(key);
    TESSERA_CHECK(it != state.end(), "LRSchedule::load_state_dict: missing '", key, "'");
    return it->second;
  };
  // The base lr may differ (a resumed run with another --lr scales the same shape).
  for (const auto& [key, mine] : identity_)
    if (key != "base_lr")
      TESSERA_CHECK(get(key) == mine, "LRSchedule::load_state_dict: saved ", key, " = ", get(key),
                    " but this schedule has ", mine);
  step_ = static_cast<int64_t>(get("step"));
  apply();
}

}  // namespace tessera::optim
