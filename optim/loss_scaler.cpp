#include "tessera/optim/loss_scaler.h"

#include <algorithm>

#include "tessera/autograd/functions.h"
#include "tessera/optim/clip.h"

namespace tessera::optim {

LossScaler::LossScaler(LossScalerOptions opts)
    : opts_(opts), scale_(opts.init_scale), hysteresis_left_(opts.hysteresis) {
  TESSERA_CHECK(opts.init_scale > 0 && opts.growth_factor > 1 && opts.backoff_factor > 0 &&
                    opts.backoff_factor < 1 && opts.growth_interval > 0,
                "LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                "growth_interval > 0; got ",
                opts.init_scale, ", ", opts.growth_factor, ", ", opts.backoff_factor, ", ",
                opts.growth_interval);
  TESSERA_CHECK(opts.hysteresis >= 1, "LossScaler: hysteresis must be >= 1, got ", opts.hysteresis);
  TESSERA_CHECK(opts.min_scale >= 0 && opts.min_scale <= opts.init_scale,
                "LossScaler: min_scale must lie in [0, init_scale = ", opts.init_scale, "], got ",
                opts.min_scale);
}

Tensor LossScaler::scale_loss(const Tensor& loss) const {
  return opts_.enabled ? loss * scale_ : loss;
}

void LossScaler::backward(const Tensor& loss) const {
  TESSERA_CHECK(loss.numel() == 1, "LossScaler::backward: loss must be a scalar, got shape ",
                shape_str(loss.shape()));
  loss.backward(full(loss.shape(), scale(), {.dtype = loss.dtype(), .device = loss.device()}));
}

bool LossScaler::unscale_(Optimizer& opt) {
  TESSERA_CHECK(!unscaled_, "LossScaler::unscale_: already called since the last update()");
  unscaled_ = true;
  if (!opts_.enabled) {
    found_inf_ = false;
    return true;
  }
  found_inf_ = !scale_grads_and_check_finite_(opt.parameters(), 1.0 / scale_);
  return !found_inf_;
}

void LossScaler::record_found_inf() {
  TESSERA_CHECK(unscaled_, "LossScaler::record_found_inf: call unscale_() first");
  found_inf_ = true;
}

bool LossScaler::step(Optimizer& opt) {
  if (!unscaled_) unscale_(opt);
  stepped_ = true;
  if (found_inf_) return false;
  opt.step();
  return true;
}

void LossScaler::update() {
  TESSERA_CHECK(stepped_, "LossScaler::update: call step() first");
  if (opts_.enabled && opts_.dynamic) {
    if (found_inf_) {
      // The allowance stays used up after a back-off: further overflows back off at once.
      if (hysteresis_left_ <= 1)
        scale_ = std::max(scale_ * opts_.backoff_factor, opts_.min_scale);
      else
        --hysteresis_left_;
      growth_tracker_ = 0;
    } else {
      if (opts_.consecutive_hysteresis) hysteresis_left_ = opts_.hysteresis;
      if (++growth_tracker_ == opts_.growth_interval) {
        scale_ *= opts_.growth_factor;
        growth_tracker_ = 0;
        hysteresis_left_ = opts_.hysteresis;
      }
    }
  }
  unscaled_ = stepped_ = found_inf_ = false;
}

std::map<std::string, double> LossScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_tracker", static_cast<double>(growth_tracker_)},
          {"growth_factor", opts_.growth_factor},
          {"backoff_factor", opts_.backoff_factor},
          {"growth_interval", static_cast<double>(opts_.growth_interval)},
          {"hysteresis", static_cast<double>(opts_.hysteresis)},
          {"hysteresis_left", static_cast<double>(hysteresis_left_)},
          {"min_scale", opts_.min_scale}};
}

void LossScaler::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const char* key) {
    auto it = state.find(key);
    TESSERA_CHECK(it != state.end(), "LossScaler::load_state_dict: missing '", key, "'");
    return it->second;
  };
  scale_ = get("scale");
  growth_tracker_ = static_cast<int64_t>(get("growth_tracker"));
  opts_.growth_factor = get("growth_factor");
  opts_.backoff_factor = get("backoff_factor");
  opts_.growth_interval = static_cast<int64_t>(get("growth_interval"));
  // Checkpoints from before hysteresis existed: torch's policy.
  auto get_or = [&](const char* key, double fallback) {
    auto it = state.find(key);
    return it == state.end() ? fallback : it->second;
  };
  opts_.hysteresis = static_cast<int64_t>(get_or("hysteresis", 1));
  hysteresis_left_ = static_cast<int64_t>(get_or("hysteresis_left", static_cast<double>(opts_.hysteresis)));
  opts_.min_scale = get_or("min_scale", 0);
  TESSERA_CHECK(opts_.hysteresis >= 1 && hysteresis_left_ >= 1 && hysteresis_left_ <= opts_.hysteresis,
                "LossScaler::load_state_dict: hysteresis_left ", hysteresis_left_,
                " must lie in [1, hysteresis = ", opts_.hysteresis, "]");
  unscaled_ = stepped_ = found_inf_ = false;
}

}  // namespace tessera::optim
