#include "tessera/optim/loss_scaler.h"

#include "tessera/autograd/functions.h"
#include "tessera/optim/clip.h"

namespace tessera::optim {

LossScaler::LossScaler(LossScalerOptions opts) : opts_(opts), scale_(opts.init_scale) {
  TESSERA_CHECK(opts.init_scale > 0 && opts.growth_factor > 1 && opts.backoff_factor > 0 &&
                    opts.backoff_factor < 1 && opts.growth_interval > 0,
                "LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                "growth_interval > 0; got ",
                opts.init_scale, ", ", opts.growth_factor, ", ", opts.backoff_factor, ", ",
                opts.growth_interval);
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

bool LossScaler::step(Optimizer& opt) {
  if (!unscaled_) unscale_(opt);
  stepped_ = true;
  if (found_inf_) return false;
  opt.step();
  return true;
}

void LossScaler::update() {
  TESSERA_CHECK(stepped_, "LossScaler::update: call step() first");
  if (opts_.enabled) {
    if (found_inf_) {
      scale_ *= opts_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == opts_.growth_interval) {
      scale_ *= opts_.growth_factor;
      growth_tracker_ = 0;
    }
  }
  unscaled_ = stepped_ = found_inf_ = false;
}

std::map<std::string, double> LossScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_tracker", static_cast<double>(growth_tracker_)},
          {"growth_factor", opts_.growth_factor},
          {"backoff_factor", opts_.backoff_factor},
          {"growth_interval", static_cast<double>(opts_.growth_interval)}};
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
  unscaled_ = stepped_ = found_inf_ = false;
}

}  // namespace tessera::optim
