#include "tessera/optim/transformers_schedules.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>

namespace tessera::optim {

namespace {

// The keywords each schedule takes (beyond the warmup and training steps).
const std::map<std::string, std::vector<std::string>>& schedule_keywords() {
  static const std::map<std::string, std::vector<std::string>> all = {
      {"linear", {}},
      {"cosine", {"num_cycles"}},
      {"cosine_with_restarts", {"num_cycles"}},
      {"polynomial", {"lr_end", "power"}},
      {"constant", {}},
      {"constant_with_warmup", {}},
      {"inverse_sqrt", {"timescale"}},
      {"cosine_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate"}},
  };
  return all;
}

double type_code(const std::string& name) {
  const auto& types = scheduler_types();
  return static_cast<double>(std::find(types.begin(), types.end(), name) - types.begin());
}

// Warmup as transformers has it: from 0 at step 0 to 1 at num_warmup_steps.
double warmup_factor(int64_t step, int64_t warmup) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
}

double progress_after_warmup(int64_t step, int64_t warmup, int64_t total) {
  return static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
}

void check_steps(const char* what, int64_t warmup, int64_t total) {
  TESSERA_CHECK(warmup >= 0, what, ": num_warmup_steps must be >= 0, got ", warmup);
  TESSERA_CHECK(total > 0, what, ": num_training_steps must be positive, got ", total);
}

std::unique_ptr<LRSchedule> lambda_schedule(Optimizer& optimizer, const std::string& name,
                                            LRSchedule::Factor factor,
                                            std::map<std::string, double> identity) {
  identity["transformers_type"] = type_code(name);
  return std::make_unique<LRSchedule>(optimizer, std::move(factor), std::move(identity));
}

double base_lr(const Optimizer& optimizer) {
  TESSERA_CHECK(!optimizer.param_groups().empty(), "LRSchedule: the optimizer has no parameter groups");
  return optimizer.param_groups().front().initial_lr;
}

std::vector<std::string> given_keywords(const SchedulerKwargs& k) {
  std::vector<std::string> given;
  if (k.num_cycles) given.push_back("num_cycles");
  if (k.min_lr) given.push_back("min_lr");
  if (k.min_lr_rate) given.push_back("min_lr_rate");
  if (k.lr_end) given.push_back("lr_end");
  if (k.power) given.push_back("power");
  if (k.timescale) given.push_back("timescale");
  return given;
}

}  // namespace

const std::vector<std::string>& scheduler_types() {
  static const std::vector<std::string> types = {
      "linear",   "cosine",       "cosine_with_restarts", "polynomial",
      "constant", "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr"};
  return types;
}

bool scheduler_uses_training_steps(const std::string& name) {
  return name != "constant" && name != "constant_with_warmup" && name != "inverse_sqrt";
}

void check_scheduler(const std::string& name, const SchedulerKwargs& kwargs) {
  auto it = schedule_keywords().find(name);
  if (it == schedule_keywords().end()) {
    std::string known;
    for (const std::string& t : scheduler_types()) known += (known.empty() ? "" : ", ") + t;
    TESSERA_FAIL("lr scheduler type \"", name, "\" is not supported (supported: ", known, ")",
                 name == "reduce_lr_on_plateau"
                     ? "; reduce_lr_on_plateau needs the evaluation metric between steps, which "
                       "Tessera's schedules do not take"
                     : name == "warmup_stable_decay" ? "; warmup_stable_decay is not implemented" : "");
  }
  for (const std::string& key : given_keywords(kwargs)) {
    const auto& takes = it->second;
    if (std::find(takes.begin(), takes.end(), key) != takes.end()) continue;
    std::string names;
    for (const std::string& t : takes) names += (names.empty() ? "" : ", ") + t;
    TESSERA_FAIL("lr scheduler \"", name, "\" takes no keyword \"", key, "\" (it takes: ",
                 names.empty() ? "none" : names, ")");
  }
  if (name == "cosine_with_min_lr") {
    TESSERA_CHECK(!(kwargs.min_lr && kwargs.min_lr_rate),
                  "cosine_with_min_lr: give only one of min_lr and min_lr_rate");
    TESSERA_CHECK(kwargs.min_lr || kwargs.min_lr_rate,
                  "cosine_with_min_lr: one of min_lr or min_lr_rate must be set "
                  "(lr_scheduler_kwargs)");
  }
  if (kwargs.timescale)
    TESSERA_CHECK(*kwargs.timescale > 0, "inverse_sqrt: timescale must be positive, got ",
                  *kwargs.timescale);
}

std::unique_ptr<LRSchedule> get_scheduler(const std::string& name, Optimizer& optimizer,
                                          std::optional<int64_t> num_warmup_steps,
                                          std::optional<int64_t> num_training_steps,
                                          const SchedulerKwargs& kwargs) {
  check_scheduler(name, kwargs);
  if (name == "constant") {
    TESSERA_CHECK(num_warmup_steps.value_or(0) == 0, "lr scheduler \"constant\" has no warmup (",
                  "transformers ignores num_warmup_steps = ", *num_warmup_steps,
                  " for it); use \"constant_with_warmup\"");
    return get_constant_schedule(optimizer);
  }
  TESSERA_CHECK(num_warmup_steps.has_value(), name, " requires num_warmup_steps");
  if (name == "constant_with_warmup") return get_constant_schedule_with_warmup(optimizer, *num_warmup_steps);
  if (name == "inverse_sqrt") return get_inverse_sqrt_schedule(optimizer, *num_warmup_steps, kwargs.timescale);
  TESSERA_CHECK(num_training_steps.has_value(), name, " requires num_training_steps");
  const int64_t w = *num_warmup_steps, t = *num_training_steps;
  if (name == "linear") return get_linear_schedule_with_warmup(optimizer, w, t);
  if (name == "cosine") return get_cosine_schedule_with_warmup(optimizer, w, t, kwargs.num_cycles.value_or(0.5));
  if (name == "cosine_with_restarts")
    return get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, w, t, kwargs.num_cycles.value_or(1));
  if (name == "polynomial")
    return get_polynomial_decay_schedule_with_warmup(optimizer, w, t, kwargs.lr_end.value_or(1e-7),
                                                     kwargs.power.value_or(1.0));
  return get_cosine_with_min_lr_schedule_with_warmup(optimizer, w, t, kwargs.num_cycles.value_or(0.5),
                                                     kwargs.min_lr, kwargs.min_lr_rate);
}

std::unique_ptr<LRSchedule> get_constant_schedule(Optimizer& optimizer) {
  return lambda_schedule(optimizer, "constant", [](int64_t) { return 1.0; }, {});
}

std::unique_ptr<LRSchedule> get_constant_schedule_with_warmup(Optimizer& optimizer, int64_t w) {
  TESSERA_CHECK(w >= 0, "constant_with_warmup: num_warmup_steps must be >= 0, got ", w);
  return lambda_schedule(
      optimizer, "constant_with_warmup",
      [w](int64_t s) { return s < w ? warmup_factor(s, w) : 1.0; },
      {{"warmup", static_cast<double>(w)}});
}

std::unique_ptr<LRSchedule> get_linear_schedule_with_warmup(Optimizer& optimizer, int64_t w, int64_t t) {
  check_steps("linear", w, t);
  return lambda_schedule(
      optimizer, "linear",
      [w, t](int64_t s) {
        if (s < w) return warmup_factor(s, w);
        return std::max(0.0, static_cast<double>(t - s) / static_cast<double>(std::max<int64_t>(1, t - w)));
      },
      {{"warmup", static_cast<double>(w)}, {"total", static_cast<double>(t)}});
}

std::unique_ptr<LRSchedule> get_cosine_schedule_with_warmup(Optimizer& optimizer, int64_t w, int64_t t,
                                                            double num_cycles) {
  return get_cosine_with_min_lr_schedule_with_warmup(optimizer, w, t, num_cycles, std::nullopt, 0.0);
}

std::unique_ptr<LRSchedule> get_cosine_with_hard_restarts_schedule_with_warmup(
    Optimizer& optimizer, int64_t w, int64_t t, double num_cycles) {
  check_steps("cosine_with_restarts", w, t);
  return lambda_schedule(
      optimizer, "cosine_with_restarts",
      [w, t, num_cycles](int64_t s) {
        if (s < w) return warmup_factor(s, w);
        const double progress = progress_after_warmup(s, w, t);
        if (progress >= 1.0) return 0.0;
        return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * std::fmod(num_cycles * progress, 1.0))));
      },
      {{"warmup", static_cast<double>(w)}, {"total", static_cast<double>(t)}, {"num_cycles", num_cycles}});
}

// transformers' cosine is this with min_lr_rate 0 (its lambda differs only by the rate).
std::unique_ptr<LRSchedule> get_cosine_with_min_lr_schedule_with_warmup(
    Optimizer& optimizer, int64_t w, int64_t t, double num_cycles, std::optional<double> min_lr,
    std::optional<double> min_lr_rate) {
  const bool plain_cosine = !min_lr && min_lr_rate && *min_lr_rate == 0.0;
  const char* name = plain_cosine ? "cosine" : "cosine_with_min_lr";
  check_steps(name, w, t);
  TESSERA_CHECK(!(min_lr && min_lr_rate), name, ": give only one of min_lr and min_lr_rate");
  TESSERA_CHECK(min_lr || min_lr_rate, name, ": one of min_lr or min_lr_rate must be set");
  const double rate = min_lr ? *min_lr / base_lr(optimizer) : *min_lr_rate;
  TESSERA_CHECK(std::isfinite(rate), name, ": min_lr / lr is not finite (lr ", base_lr(optimizer), ")");
  return lambda_schedule(
      optimizer, name,
      [w, t, num_cycles, rate](int64_t s) {
        if (s < w) return warmup_factor(s, w);
        const double progress = progress_after_warmup(s, w, t);
        const double f = 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress));
        return std::max(0.0, f * (1 - rate) + rate);
      },
      {{"warmup", static_cast<double>(w)},
       {"total", static_cast<double>(t)},
       {"num_cycles", num_cycles},
       {"min_lr_rate", rate}});
}

std::unique_ptr<LRSchedule> get_polynomial_decay_schedule_with_warmup(Optimizer& optimizer, int64_t w,
                                                                      int64_t t, double lr_end,
                                                                      double power) {
  check_steps("polynomial", w, t);
  TESSERA_CHECK(t > w, "polynomial: num_training_steps (", t, ") must exceed num_warmup_steps (", w, ")");
  const double lr_init = base_lr(optimizer);
  TESSERA_CHECK(lr_init > lr_end, "polynomial: lr_end (", lr_end, ") must be smaller than initial lr (",
                lr_init, ")");
  return lambda_schedule(
      optimizer, "polynomial",
      [w, t, lr_end, power, lr_init](int64_t s) {
        if (s < w) return warmup_factor(s, w);
        if (s > t) return lr_end / lr_init;  // as the schedule multiplies by lr_init
        const double pct_remaining = 1 - static_cast<double>(s - w) / static_cast<double>(t - w);
        return ((lr_init - lr_end) * std::pow(pct_remaining, power) + lr_end) / lr_init;
      },
      {{"warmup", static_cast<double>(w)},
       {"total", static_cast<double>(t)},
       {"lr_end", lr_end},
       {"power", power}});
}

std::unique_ptr<LRSchedule> get_inverse_sqrt_schedule(Optimizer& optimizer, int64_t w,
                                                      std::optional<int64_t> timescale) {
  TESSERA_CHECK(w >= 0, "inverse_sqrt: num_warmup_steps must be >= 0, got ", w);
  const int64_t scale = timescale ? *timescale : (w > 0 ? w : 10'000);
  TESSERA_CHECK(scale > 0, "inverse_sqrt: timescale must be positive, got ", scale);
  return lambda_schedule(
      optimizer, "inverse_sqrt",
      [w, scale](int64_t s) {
        if (s < w) return warmup_factor(s, w);
        const double shift = static_cast<double>(scale - w);
        return 1.0 / std::sqrt((static_cast<double>(s) + shift) / static_cast<double>(scale));
      },
      {{"warmup", static_cast<double>(w)}, {"timescale", static_cast<double>(scale)}});
}

}  // namespace tessera::optim
