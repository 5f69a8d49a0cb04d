// transformers' learning-rate schedules (transformers.optimization) under their own names
// and with their arguments: a LambdaLR whose factor at step s multiplies every group's
// initial lr. Warmup rises linearly from 0: the factor at step s < num_warmup_steps is
// s / num_warmup_steps (so the first step trains at lr 0), as in transformers.
//
//   linear                 1 -> 0 at num_training_steps
//   cosine                 half a cosine 1 -> 0 (num_cycles waves, default 0.5)
//   cosine_with_restarts   num_cycles (default 1) hard restarts of 1 -> 0
//   cosine_with_min_lr     1 -> min_lr (absolute) or min_lr_rate (of the lr); one of them
//   polynomial             (lr - lr_end) * remaining^power + lr_end (defaults 1e-7, 1)
//   constant               1, no warmup (transformers ignores warmup for it)
//   constant_with_warmup   warmup, then 1
//   inverse_sqrt           warmup, then 1 / sqrt((s + timescale - warmup) / timescale)
//                          (timescale default num_warmup_steps, or 10000 without warmup)
//
// Unlike transformers, a keyword a schedule does not take is refused rather than dropped
// (transformers' get_scheduler drops them for constant, constant_with_warmup and
// inverse_sqrt); reduce_lr_on_plateau and warmup_stable_decay are refused by name.
// Tessera's own shapes (optim/schedule.h) start warmup at lr/warmup and decay to a floor.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/optim/schedule.h"

namespace tessera::optim {

// get_scheduler's scheduler_specific_kwargs (transformers' TrainingArguments.lr_scheduler_kwargs).
struct SchedulerKwargs {
  std::optional<double> num_cycles;            // cosine, cosine_with_restarts, cosine_with_min_lr
  std::optional<double> min_lr, min_lr_rate;   // cosine_with_min_lr
  std::optional<double> lr_end, power;         // polynomial
  std::optional<int64_t> timescale;            // inverse_sqrt
};

// The names get_scheduler accepts.
const std::vector<std::string>& scheduler_types();
// Whether the schedule's shape depends on num_training_steps (a run may be extended if not).
bool scheduler_uses_training_steps(const std::string& name);
// Checks a name and its kwargs without building anything; errors name the problem.
void check_scheduler(const std::string& name, const SchedulerKwargs& kwargs);

std::unique_ptr<LRSchedule> get_scheduler(const std::string& name, Optimizer& optimizer,
                                          std::optional<int64_t> num_warmup_steps = std::nullopt,
                                          std::optional<int64_t> num_training_steps = std::nullopt,
                                          const SchedulerKwargs& kwargs = {});

std::unique_ptr<LRSchedule> get_constant_schedule(Optimizer& optimizer);
std::unique_ptr<LRSchedule> get_constant_schedule_with_warmup(Optimizer& optimizer,
                                                              int64_t num_warmup_steps);
std::unique_ptr<LRSchedule> get_linear_schedule_with_warmup(Optimizer& optimizer,
                                                            int64_t num_warmup_steps,
                                                            int64_t num_training_steps);
std::unique_ptr<LRSchedule> get_cosine_schedule_with_warmup(Optimizer& optimizer,
                                                            int64_t num_warmup_steps,
                                                            int64_t num_training_steps,
                                                            double num_cycles = 0.5);
std::unique_ptr<LRSchedule> get_cosine_with_hard_restarts_schedule_with_warmup(
    Optimizer& optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    double num_cycles = 1);
std::unique_ptr<LRSchedule> get_cosine_with_min_lr_schedule_with_warmup(
    Optimizer& optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    double num_cycles = 0.5, std::optional<double> min_lr = std::nullopt,
    std::optional<double> min_lr_rate = std::nullopt);
std::unique_ptr<LRSchedule> get_polynomial_decay_schedule_with_warmup(
    Optimizer& optimizer, int64_t num_warmup_steps, int64_t num_training_steps,
    double lr_end = 1e-7, double power = 1.0);
std::unique_ptr<LRSchedule> get_inverse_sqrt_schedule(Optimizer& optimizer,
                                                      int64_t num_warmup_steps,
                                                      std::optional<int64_t> timescale = std::nullopt);

}  // namespace tessera::optim
