// DeepSpeed's fp16 loss-scale settings on optim::LossScaler: the scale sequence over a run
// with overflows equals the one DeepSpeed's documented dynamic loss scaler produces (written
// here in DeepSpeed's own terms: an iteration counter, the last overflow's iteration, a
// hysteresis counter), and torch's GradScaler policy is unchanged with the defaults.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

// DeepSpeed's algorithm: on overflow, back off (never below min_scale) once the hysteresis
// is used up, else use one up; the scale grows when (iteration - last overflow) is a multiple
// of the window; the hysteresis comes back with a growth (or on every clean step when
// consecutive).
struct DeepSpeedReference {
  double scale, min_scale;
  int64_t window, hysteresis, left;
  bool consecutive;
  int64_t iteration = 0, last_overflow = -1;
  void update(bool overflow) {
    if (overflow) {
      if (hysteresis == 1 || left == 1)
        scale = std::max(scale / 2, min_scale);
      else
        --left;
      last_overflow = iteration;
    } else {
      if (consecutive) left = hysteresis;
      if ((iteration - last_overflow) % window == 0) {
        if (!consecutive) left = hysteresis;
        scale *= 2;
      }
    }
    ++iteration;
  }
};

// One step with a finite or an overflowing gradient; returns whether the optimizer stepped.
bool scaled_step(optim::LossScaler& scaler, optim::SGD& opt, Tensor& p, bool overflow) {
  opt.zero_grad();
  p.set_grad(full({2}, overflow ? std::numeric_limits<double>::infinity() : 1.0));
  const bool stepped = scaler.step(opt);
  scaler.update();
  return stepped;
}

}  // namespace

TEST(LossScalerDeepSpeed, ScaleSequenceMatchesDeepSpeedsDynamicLossScaler) {
  // Bursts of overflows, long clean stretches (growths) and a run down to the floor.
  std::vector<bool> overflows;
  for (int i = 0; i < 200; ++i) overflows.push_back(i % 37 == 5 || i % 37 == 6 || (i > 120 && i < 150));
  for (const bool consecutive : {false, true})
    for (const int64_t hysteresis : {1, 2, 3}) {
      optim::LossScaler scaler({.init_scale = 1 << 10, .growth_interval = 8, .hysteresis = hysteresis,
                                .consecutive_hysteresis = consecutive, .min_scale = 4});
      DeepSpeedReference ds{1 << 10, 4, 8, hysteresis, hysteresis, consecutive};
      Tensor p = zeros({2});
      p.requires_grad_(true);
      optim::SGD opt({p}, {.lr = 0.0});
      for (size_t i = 0; i < overflows.size(); ++i) {
        EXPECT_EQ(scaled_step(scaler, opt, p, overflows[i]), !overflows[i]) << "step " << i;
        ds.update(overflows[i]);
        ASSERT_EQ(scaler.scale(), ds.scale)
            << "step " << i << " hysteresis " << hysteresis << " consecutive " << consecutive;
        ASSERT_EQ(scaler.hysteresis_left(), ds.left) << "step " << i;
      }
      EXPECT_GE(scaler.scale(), 4.0);
    }
}

TEST(LossScalerDeepSpeed, HysteresisAbsorbsOverflowsAndMinScaleIsTheFloor) {
  optim::LossScaler scaler({.init_scale = 16, .growth_interval = 3, .hysteresis = 2, .min_scale = 4});
  Tensor p = zeros({2});
  p.requires_grad_(true);
  optim::SGD opt({p}, {.lr = 0.0});
  std::vector<double> scales;
  for (bool overflow : {true, true, true, true, true, false, false, false})
    scaled_step(scaler, opt, p, overflow), scales.push_back(scaler.scale());
  // 1st overflow absorbed, then 16 -> 8 -> 4 -> 4 (floor); 3 clean steps double it.
  EXPECT_EQ(scales, (std::vector<double>{16, 8, 4, 4, 4, 4, 4, 8}));

  optim::LossScaler fixed({.init_scale = 128, .dynamic = false});
  EXPECT_FALSE(scaled_step(fixed, opt, p, true));  // an overflowing step is still skipped
  for (int i = 0; i < 3000; ++i) scaled_step(fixed, opt, p, false);
  EXPECT_EQ(fixed.scale(), 128);

  // The hysteresis left is part of the state a checkpoint keeps.
  optim::LossScaler a({.init_scale = 16, .growth_interval = 3, .hysteresis = 3});
  scaled_step(a, opt, p, true);
  optim::LossScaler b({.init_scale = 16, .growth_interval = 3, .hysteresis = 3});
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.hysteresis_left(), 2);
  EXPECT_THROW(optim::LossScaler({.hysteresis = 0}), Error);
  EXPECT_THROW(optim::LossScaler({.init_scale = 8, .min_scale = 16}), Error);
}
