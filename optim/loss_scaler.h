// Dynamic loss scaling for f16 training (torch.cuda.amp.GradScaler's policy):
// the loss is multiplied by `scale` before backward so small f16 gradients do not
// flush to zero; before the optimizer step the gradients are divided by it and
// checked. A step with an inf/NaN gradient is skipped and the scale multiplied by
// backoff_factor; after growth_interval clean steps in a row it is multiplied by
// growth_factor.
//
// DeepSpeed's fp16 settings add to that policy (deepspeed_config.h maps them): `hysteresis`
// overflows are absorbed before the scale backs off (each one still skips its step and
// restarts the growth count; the allowance comes back at the next growth, or after every
// clean step with consecutive_hysteresis), the scale never backs off below min_scale, and
// a static scale (dynamic = false) never changes while overflowing steps are still skipped.
// With the defaults (hysteresis 1, min_scale 0) this is exactly torch's GradScaler.
//
//   scaler.backward(loss);            // or scale_loss(loss).backward()
//   scaler.unscale_(opt);             // optional: to clip the true gradients
//   clip_grad_norm_(params, 1.0);
//   scaler.step(opt);                 // skipped when a gradient is not finite
//   scaler.update();
#pragma once
#include <map>
#include <string>

#include "tessera/optim/optimizer.h"

namespace tessera::optim {

struct LossScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;  // disabled: scale 1, nothing skipped (bf16/f32 runs)
  int64_t hysteresis = 1;               // overflows per back-off (DeepSpeed's hysteresis)
  bool consecutive_hysteresis = false;  // a clean step restores the allowance
  double min_scale = 0;                 // floor of the back-off (DeepSpeed's min_loss_scale)
  bool dynamic = true;                  // false: the scale stays init_scale
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions opts = {});

  double scale() const { return opts_.enabled ? scale_ : 1.0; }
  bool enabled() const { return opts_.enabled; }
  // loss * scale, recorded on the tape.
  Tensor scale_loss(const Tensor& loss) const;
  // Runs backward of loss * scale (seeds the backward with `scale`, adds no node).
  void backward(const Tensor& loss) const;

  // Divides the optimizer's gradients by the scale (once per step; a second call
  // before update() is an error) and returns whether all of them are finite.
  bool unscale_(Optimizer& opt);
  // Unscales if not done yet, then steps unless a gradient was not finite.
  // Returns whether the optimizer stepped.
  bool step(Optimizer& opt);
  // Adjusts the scale from this step's outcome; must follow step().
  void update();

  bool found_inf() const { return found_inf_; }
  // After unscale_: treat this step's gradients as not finite although the ones this
  // process holds are (a sharded optimizer: another rank's slice overflowed).
  void record_found_inf();
  int64_t growth_tracker() const { return growth_tracker_; }
  // Overflows still absorbed before the next back-off (1: the next one backs off).
  int64_t hysteresis_left() const { return hysteresis_left_; }
  const LossScalerOptions& options() const { return opts_; }

  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  LossScalerOptions opts_;
  double scale_;
  int64_t growth_tracker_ = 0;  // clean steps since the last change
  int64_t hysteresis_left_;
  bool unscaled_ = false;
  bool stepped_ = false;
  bool found_inf_ = false;
};

}  // namespace tessera::optim
