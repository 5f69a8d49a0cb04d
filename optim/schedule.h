// Learning-rate schedules. A schedule owns a step counter; on construction it sets
// the lr of step 0 and each step() advances one step and sets the next lr (like
// torch.optim.lr_scheduler.LambdaLR). Every group's lr is its initial_lr times the
// same factor, so groups keep their ratios.
//
// Shape: linear warmup from initial_lr/warmup to initial_lr over `warmup` steps
// (factor (step+1)/warmup), then constant, cosine or linear decay reaching the
// floor at step `total` and staying there. The floor is min_lr for a group whose
// initial_lr is the first group's (groups with other lrs get the same fraction).
//
// Any other shape is a factor function of the step (torch's LambdaLR), e.g. transformers'
// schedules in optim/transformers_schedules.h; its `identity` (numbers naming the shape and
// its settings) is saved by state_dict and must match on load.
#pragma once
#include <functional>
#include <map>
#include <string>

#include "tessera/optim/optimizer.h"

namespace tessera::optim {

enum class DecayShape { Constant, Cosine, Linear };

struct ScheduleOptions {
  int64_t warmup = 0;
  int64_t total = 0;      // the step where decay reaches the floor (ignored for Constant)
  double min_lr = 0.0;    // absolute floor (see above)
};

class LRSchedule {
 public:
  LRSchedule(Optimizer& opt, DecayShape shape, ScheduleOptions opts);
  using Factor = std::function<double(int64_t step)>;
  LRSchedule(Optimizer& opt, Factor factor, std::map<std::string, double> identity);
  virtual ~LRSchedule() = default;

  // Advances one step and sets the optimizer's lr for it; nothing while the step gate
  // says no (see Optimizer::set_step_gate; the Accelerator installs the same gate here).
  void step();
  // An empty function removes the gate.
  void set_step_gate(std::function<bool()> gate) { gate_ = std::move(gate); }
  int64_t current_step() const { return step_; }
  // Multiplier of initial_lr at `step` (pure function of the options).
  double factor(int64_t step) const;
  // The lr of the first group at `step`.
  double lr_at(int64_t step) const;
  double last_lr() const;

  std::map<std::string, double> state_dict() const;
  // Restores the step (and checks the options match) and sets the lr for it.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  void apply();
  Optimizer& opt_;
  double base_lr_;
  Factor factor_;
  std::map<std::string, double> identity_;  // all of state_dict but "step"
  int64_t step_ = 0;
  std::function<bool()> gate_;
};

struct ConstantSchedule : LRSchedule {
  ConstantSchedule(Optimizer& opt, ScheduleOptions opts = {})
      : LRSchedule(opt, DecayShape::Constant, opts) {}
};
struct CosineSchedule : LRSchedule {
  CosineSchedule(Optimizer& opt, ScheduleOptions opts) : LRSchedule(opt, DecayShape::Cosine, opts) {}
};
struct LinearSchedule : LRSchedule {
  LinearSchedule(Optimizer& opt, ScheduleOptions opts) : LRSchedule(opt, DecayShape::Linear, opts) {}
};

}  // namespace tessera::optim
