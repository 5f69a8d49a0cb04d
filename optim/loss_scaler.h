// Dynamic loss scaling for f16 training (torch.cuda.amp.GradScaler's policy):
// the loss is multiplied by `scale` before backward so small f16 gradients do not
// flush to zero; before the optimizer step the gradients are divided by it and
// checked. A step with an inf/NaN gradient is skipped and the scale multiplied by
// backoff_factor; after growth_interval clean steps in a row it is multiplied by
// growth_factor.
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
  int64_t growth_tracker() const { return growth_tracker_; }

  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  LossScalerOptions opts_;
  double scale_;
  int64_t growth_tracker_ = 0;  // clean steps since the last change
  bool unscaled_ = false;
  bool stepped_ = false;
  bool found_inf_ = false;
};

}  // namespace tessera::optim
