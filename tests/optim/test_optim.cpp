// optim/: AdamW and SGD against float64 implementations of their update formulas,
// schedules, global-norm clipping, the loss scaler and state dicts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "tessera/autograd/functions.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

std::vector<double> as_f64(const Tensor& t) {
  return ops::contiguous(ops::to(t, Device::cpu(), DType::f64)).to_vector<double>();
}

// Parameters of odd shapes (rank 1 and 2 so weight decay grouping matters).
std::vector<Tensor> make_params(Generator& gen, DType dtype = DType::f32) {
  std::vector<Tensor> ps;
  for (const Shape& s :
       {Shape{33, 7}, Shape{7}, Shape{1}, Shape{257}, Shape{3, 5, 2}, Shape{301, 129}}) {
    Tensor p = normal(s, 0, 1, {.dtype = dtype}, &gen);
    p.requires_grad_(true);
    ps.push_back(p);
  }
  return ps;
}

void set_random_grads(const std::vector<Tensor>& ps, Generator& gen, double scale = 1.0) {
  for (const auto& p : ps) p.set_grad(normal(p.shape(), 0, scale, {.dtype = p.dtype()}, &gen));
}

struct AdamRef {
  std::vector<double> p, m, v;
  int64_t t = 0;
  void step(const std::vector<double>& g, double lr, double b1, double b2, double eps, double wd) {
    if (m.empty()) m.assign(p.size(), 0), v.assign(p.size(), 0);
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
    }
  }
};

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace

TEST(AdamW, MatchesFloat64FormulaWithDecayOnMatricesOnly) {
  for (DType dtype : {DType::f32, DType::f64}) {
    Generator gen(1);
    auto ps = make_params(gen, dtype);
    const double lr = 3e-3, wd = 0.1, b1 = 0.8, b2 = 0.95, eps = 1e-6;
    optim::AdamW opt(ps, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd});
    ASSERT_EQ(opt.param_groups().size(), 2u);
    EXPECT_EQ(opt.param_groups()[0].params.size(), 3u);  // [33,7], [3,5,2], [301,129]
    std::vector<AdamRef> ref(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) ref[i].p = as_f64(ps[i]);
    for (int step = 0; step < 6; ++step) {
      set_random_grads(ps, gen, 0.5 + step);
      for (size_t i = 0; i < ps.size(); ++i)
        ref[i].step(as_f64(ps[i].grad()), lr, b1, b2, eps, ps[i].dim() >= 2 ? wd : 0.0);
      opt.step();
    }
    const double tol = dtype == DType::f64 ? 1e-12 : 2e-6;
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_LT(max_abs_diff(as_f64(ps[i]), ref[i].p), tol) << "param " << i << " " << dtype;
  }
}

TEST(AdamW, HalfPrecisionParametersKeepFloat32Moments) {
  for (DType dtype : {DType::f16, DType::bf16}) {
    Generator gen(12);
    auto ps = make_params(gen, dtype);
    optim::AdamW opt(ps, {.lr = 1e-2, .weight_decay = 0.1});
    std::vector<AdamRef> ref(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) ref[i].p = as_f64(ps[i]);
    for (int step = 0; step < 3; ++step) {
      set_random_grads(ps, gen);
      for (size_t i = 0; i < ps.size(); ++i)
        ref[i].step(as_f64(ps[i].grad()), 1e-2, 0.9, 0.999, 1e-8, ps[i].dim() >= 2 ? 0.1 : 0.0);
      opt.step();
      // The stored parameter is the reference rounded to its dtype (moments stay f32).
      for (size_t i = 0; i < ps.size(); ++i)
        ref[i].p = as_f64(ops::to(from_vector(ref[i].p, ps[i].shape(), {.dtype = DType::f64}),
                                  Device::cpu(), dtype));
    }
    // At most one unit in the last place apart (f32 vs f64 arithmetic before rounding).
    const double eps = dtype == DType::f16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    for (size_t i = 0; i < ps.size(); ++i) {
      EXPECT_EQ(ps[i].dtype(), dtype);
      const auto got = as_f64(ps[i]);
      for (size_t k = 0; k < got.size(); ++k)
        ASSERT_LE(std::abs(got[k] - ref[i].p[k]), 1.01 * eps * std::abs(ref[i].p[k]) + 1e-7)
            << "param " << i << " element " << k << " " << dtype;
    }
    EXPECT_EQ(opt.state_dict().tensors.at("state.0.exp_avg").dtype(), DType::f32);
  }
}

TEST(AdamW, MasterWeightsKeepUpdatesSmallerThanABf16Ulp) {
  // bf16 parameters with f32 masters must follow an f32 run bit for bit (master == the f32
  // parameters, parameter == their rounding), while plain bf16 AdamW loses updates that are
  // smaller than half a bf16 ulp: with lr 1e-3 every step moves a weight near 1 by about
  // 1e-3, under half of bf16's ulp there (2^-8 or 2^-9), while 30 steps of gradients with a
  // common sign add up to several ulps.
  Generator gen(11);
  std::vector<Tensor> ref, mixed, plain;
  for (const Shape& s : {Shape{33, 7}, Shape{257}, Shape{5, 3, 2}}) {
    Tensor start = ops::to(normal(s, 1, 0.1, {}, &gen), Device::cpu(), DType::bf16);
    ref.push_back(ops::to(start, Device::cpu(), DType::f32).requires_grad_(true));
    mixed.push_back(ops::clone(start).requires_grad_(true));
    plain.push_back(ops::clone(start).requires_grad_(true));
  }
  const optim::AdamWOptions opts{
      .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  optim::AdamW ref_opt(ref, opts), plain_opt(plain, opts);
  optim::AdamWOptions mixed_opts = opts;
  mixed_opts.master_weights = true;
  optim::AdamW mixed_opt(mixed, mixed_opts);
  for (int step = 0; step < 30; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      const Tensor g =
          ops::to(normal(ref[i].shape(), 0.5, 1, {}, &gen), Device::cpu(), DType::bf16);
      ref[i].set_grad(ops::to(g, Device::cpu(), DType::f32));
      mixed[i].set_grad(g);
      plain[i].set_grad(ops::clone(g));
    }
    ref_opt.step();
    mixed_opt.step();
    plain_opt.step();
  }
  const optim::OptimizerStateDict state = mixed_opt.state_dict();
  int64_t plain_moved = 0, total = 0;  // weights where plain bf16 AdamW ended elsewhere
  const std::vector<Tensor> order = mixed_opt.parameters();  // the state dict's index order
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t index = std::find_if(order.begin(), order.end(),
                                      [&](const Tensor& t) { return t.is_same(mixed[i]); }) -
                         order.begin();
    const auto master = as_f64(state.tensors.at("state." + std::to_string(index) + ".master"));
    EXPECT_EQ(master, as_f64(ref[i])) << "master of parameter " << i;
    EXPECT_EQ(as_f64(mixed[i]), as_f64(ops::to(ref[i], Device::cpu(), DType::bf16)))
        << "parameter " << i;
    const auto p = as_f64(plain[i]), q = as_f64(mixed[i]);
    for (size_t j = 0; j < p.size(); ++j, ++total) plain_moved += p[j] != q[j];
  }
  // Rounding every step in bf16 drifts away from the f32 trajectory for many weights.
  EXPECT_GT(plain_moved, total / 10);
}

// AdamW's float update with every operation rounded on its own (each result forced through
// a volatile float, so no compiler can fuse a multiply-add): the arithmetic the CUDA kernel
// runs (core/adamw_math.h), written out independently.
struct RoundedAdamWRef {
  std::vector<float> p, m, v;
  void step(const std::vector<float>& g, double lr, double b1, double b2, double eps, double wd,
            int64_t t) {
    if (m.empty()) m.assign(p.size(), 0.f), v.assign(p.size(), 0.f);
    volatile double lr_wd = lr * wd;  // rounded before the subtraction, as the library does
    const float decay = static_cast<float>(1.0 - lr_wd);
    const float step_size = static_cast<float>(lr / (1.0 - std::pow(b1, double(t))));
    const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, double(t))));
    const float fb1 = float(b1), fb2 = float(b2), f1b1 = float(1.0 - b1), f1b2 = float(1.0 - b2);
    for (size_t i = 0; i < p.size(); ++i) {
      volatile float decayed = p[i] * decay;
      volatile float m1 = fb1 * m[i], m2 = f1b1 * g[i];
      volatile float new_m = m1 + m2;
      volatile float v1 = fb2 * v[i], v2 = f1b2 * g[i];
      volatile float v3 = v2 * g[i];
      volatile float new_v = v1 + v3;
      volatile float root = std::sqrt(float(new_v));
      volatile float scaled = root / bc2_sqrt;
      volatile float denom = scaled + float(eps);
      volatile float ratio = new_m / denom;
      volatile float delta = step_size * ratio;
      m[i] = new_m;
      v[i] = new_v;
      p[i] = decayed - delta;
    }
  }
};

std::vector<float> as_f32(const Tensor& t) {
  return ops::contiguous(ops::to(t, Device::cpu(), DType::f32)).to_vector<float>();
}

// Bit for bit what the CUDA kernel computes (tests/cuda/test_adamw_bits.cpp checks the GPU
// side): this fails if the CPU loop fused a multiply-add or reordered the formula.
TEST(AdamW, CpuUpdateRoundsEveryOperationAsTheCudaKernelDoes) {
  Generator gen(21);
  auto ps = make_params(gen);
  std::vector<RoundedAdamWRef> ref(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) ref[i].p = as_f32(ps[i]);
  const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  optim::AdamW opt(ps, {.lr = 1e-3, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd});
  for (int64_t t = 1; t <= 5; ++t) {
    const double lr = 1e-3 * (1.0 + 0.37 * double(t));  // a schedule: coefficients change
    opt.set_lr(lr);
    set_random_grads(ps, gen, 0.1 * double(t));
    for (size_t i = 0; i < ps.size(); ++i)
      ref[i].step(as_f32(ps[i].grad()), lr, b1, b2, eps, ps[i].dim() >= 2 ? wd : 0.0, t);
    opt.step();
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::vector<float> got = as_f32(ps[i]);
      ASSERT_EQ(got.size(), ref[i].p.size());
      int64_t differing = 0;  // compared as bits (memcmp): -0 vs 0 or NaNs would count too
      for (size_t e = 0; e < got.size(); ++e)
        differing += std::memcmp(&got[e], &ref[i].p[e], sizeof(float)) != 0;
      ASSERT_EQ(differing, 0) << "of " << got.size() << " elements of parameter " << i
                              << " after step " << t;
    }
  }
}

TEST(AdamW, SkipsParametersWithoutGradientAndUpdatesStridedViews) {
  Generator gen(2);
  Tensor base = normal({7, 33}, 0, 1, {}, &gen);
  Tensor strided = base.t();  // [33, 7] non-contiguous parameter
  strided.requires_grad_(true);
  Tensor untouched = normal({5}, 0, 1, {}, &gen);
  untouched.requires_grad_(true);
  optim::AdamW opt({strided, untouched}, {.lr = 0.1, .weight_decay = 0.0});
  const auto before = as_f64(untouched);
  AdamRef ref{as_f64(strided)};
  strided.set_grad(normal({33, 7}, 0, 1, {}, &gen));
  ref.step(as_f64(strided.grad()), 0.1, 0.9, 0.999, 1e-8, 0.0);
  opt.step();
  EXPECT_EQ(as_f64(untouched), before);
  EXPECT_LT(max_abs_diff(as_f64(strided), ref.p), 1e-6);
  EXPECT_LT(max_abs_diff(as_f64(base.t()), ref.p), 1e-6);  // written through the view
}

// ZeRO-Offload's per-bucket step: some parameters updated by step_parameters (in two calls),
// the rest by the step() after them, gives the bits of one step() over all; the step() after
// that updates every parameter again. A repeated index and a pending clip are errors.
TEST(AdamW, StepParametersThenStepMatchesOneStep) {
  Generator g1(3), g2(3);
  auto a = make_params(g1), b = make_params(g2);
  ASSERT_GE(a.size(), 3u);
  optim::AdamW oa(a, {.lr = 1e-2}), ob(b, {.lr = 1e-2});
  Generator grads(9);
  for (int s = 0; s < 3; ++s) {
    set_random_grads(a, grads);
    for (size_t i = 0; i < a.size(); ++i) b[i].set_grad(ops::clone(a[i].grad()));
    oa.step();
    ob.step_parameters({0});
    ob.step_parameters({2});
    EXPECT_TRUE(ob.has_early_steps());
    EXPECT_THROW(ob.step_parameters({2}), Error);
    ob.step();
    EXPECT_FALSE(ob.has_early_steps());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(as_f64(b[i]), as_f64(a[i])) << "step " << s << " parameter " << i;
  }
  ob.clip_grads_in_next_step(full({1}, 2.0), 1.0);
  EXPECT_THROW(ob.step_parameters({0}), Error);
  optim::SGD sgd(b, {.lr = 0.1});
  EXPECT_THROW(sgd.step_parameters({0}), Error);
}

TEST(AdamW, StateDictResumesExactly) {
  Generator g1(3), g2(3);
  auto a = make_params(g1), b = make_params(g2);
  optim::AdamW oa(a, {.lr = 1e-2}), ob(b, {.lr = 1e-2});
  Generator grads(9);
  for (int s = 0; s < 3; ++s) {
    set_random_grads(a, grads);
    for (size_t i = 0; i < a.size(); ++i) b[i].set_grad(ops::clone(a[i].grad()));
    oa.step();
    ob.step();
  }
  // A fresh optimizer over b's parameters, restored from a's state.
  optim::AdamW restored(b, {.lr = 1e-2});
  restored.load_state_dict(oa.state_dict());
  for (int s = 0; s < 2; ++s) {
    set_random_grads(a, grads);
    for (size_t i = 0; i < a.size(); ++i) b[i].set_grad(ops::clone(a[i].grad()));
    oa.step();
    restored.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(as_f64(a[i]), as_f64(b[i])) << i;
  EXPECT_EQ(oa.state_dict().scalars.at("state.0.step"), 5.0);

  // Through a file: exactly the same scalars and tensors.
  const std::string path = std::string(TESSERA_BINARY_DIR) + "/test_optim_state.safetensors";
  optim::save_optimizer_state(oa.state_dict(), path);
  const auto from_file = optim::load_optimizer_state(path);
  EXPECT_EQ(from_file.scalars, oa.state_dict().scalars);
  for (const auto& [key, t] : oa.state_dict().tensors)
    EXPECT_EQ(as_f64(from_file.tensors.at(key)), as_f64(t)) << key;

  auto bad = oa.state_dict();
  bad.tensors["state.0.exp_avg"] = zeros({2, 2});
  try {
    restored.load_state_dict(bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.0.exp_avg"), std::string::npos) << e.what();
  }
  auto missing = oa.state_dict();
  missing.scalars.erase("group.1.lr");
  EXPECT_THROW(restored.load_state_dict(missing), Error);
}

TEST(AdamW, DoesNotRecordOnTheTape) {
  Generator gen(4);
  auto ps = make_params(gen);
  set_random_grads(ps, gen);
  optim::AdamW opt(ps);
  opt.step();
  for (const auto& p : ps) {
    EXPECT_TRUE(p.is_leaf());
    EXPECT_TRUE(p.requires_grad());
  }
}

TEST(SGD, MatchesFloat64FormulaAllVariants) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const Case c : {Case{0, 0, 0, false}, Case{0.9, 0, 0.01, false}, Case{0.9, 0.1, 0, false},
                       Case{0.8, 0, 0.05, true}}) {
    Generator gen(5);
    auto ps = make_params(gen);
    const double lr = 0.05;
    optim::SGD opt(ps, {.lr = lr,
                        .momentum = c.momentum,
                        .dampening = c.dampening,
                        .weight_decay = c.wd,
                        .nesterov = c.nesterov});
    std::vector<std::vector<double>> p(ps.size()), buf(ps.size());
    for (size_t i = 0; i < ps.size(); ++i) p[i] = as_f64(ps[i]);
    for (int step = 0; step < 4; ++step) {
      set_random_grads(ps, gen);
      for (size_t i = 0; i < ps.size(); ++i) {
        auto g = as_f64(ps[i].grad());
        if (step == 0) buf[i].assign(g.size(), 0.0);
        for (size_t k = 0; k < g.size(); ++k) {
          double d = g[k] + c.wd * p[i][k];
          if (c.momentum != 0) {
            buf[i][k] = step == 0 ? d : c.momentum * buf[i][k] + (1 - c.dampening) * d;
            d = c.nesterov ? d + c.momentum * buf[i][k] : buf[i][k];
          }
          p[i][k] -= lr * d;
        }
      }
      opt.step();
    }
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_LT(max_abs_diff(as_f64(ps[i]), p[i]), 1e-5)
          << "momentum " << c.momentum << " nesterov " << c.nesterov << " param " << i;
  }
  Generator gen(6);
  EXPECT_THROW(optim::SGD(make_params(gen), {.lr = 0.1, .momentum = 0, .nesterov = true}), Error);
}

TEST(Schedule, WarmupThenCosineOrLinearToTheFloor) {
  Generator gen(7);
  auto ps = make_params(gen);
  optim::AdamW opt(ps, {.lr = 0.5});
  const int64_t warmup = 4, total = 20;
  const double min_lr = 0.05;
  optim::CosineSchedule cosine(opt, {.warmup = warmup, .total = total, .min_lr = min_lr});
  for (int64_t s = 0; s < 30; ++s) {
    double expect;
    if (s < warmup)
      expect = 0.5 * (s + 1) / warmup;
    else if (s >= total)
      expect = min_lr;
    else
      expect = min_lr +
               (0.5 - min_lr) * 0.5 * (1 + std::cos(M_PI * (s - warmup) / double(total - warmup)));
    ASSERT_NEAR(opt.param_groups()[0].lr, expect, 1e-12) << "step " << s;
    ASSERT_NEAR(opt.param_groups()[1].lr, expect, 1e-12) << "step " << s;
    cosine.step();
  }
  optim::AdamW opt2(ps, {.lr = 1.0});
  optim::LinearSchedule linear(opt2, {.warmup = 0, .total = 10, .min_lr = 0.0});
  EXPECT_NEAR(linear.lr_at(0), 1.0, 1e-12);
  EXPECT_NEAR(linear.lr_at(5), 0.5, 1e-12);
  EXPECT_NEAR(linear.lr_at(12), 0.0, 1e-12);
  optim::ConstantSchedule constant(opt2, {.warmup = 2});
  EXPECT_NEAR(constant.lr_at(0), 0.5, 1e-12);
  EXPECT_NEAR(constant.lr_at(100), 1.0, 1e-12);
  EXPECT_THROW(optim::CosineSchedule(opt2, {.warmup = 10, .total = 10}), Error);
  EXPECT_THROW(optim::CosineSchedule(opt2, {.warmup = 1, .total = 10, .min_lr = 2.0}), Error);
}

TEST(Schedule, StateDictRestoresTheStep) {
  Generator gen(8);
  auto ps = make_params(gen);
  optim::AdamW a(ps, {.lr = 0.1}), b(ps, {.lr = 0.1});
  optim::CosineSchedule sa(a, {.warmup = 2, .total = 10}), sb(b, {.warmup = 2, .total = 10});
  for (int i = 0; i < 6; ++i) sa.step();
  sb.load_state_dict(sa.state_dict());
  EXPECT_EQ(sb.current_step(), 6);
  EXPECT_DOUBLE_EQ(b.lr(), a.lr());
  optim::CosineSchedule other(b, {.warmup = 3, .total = 10});
  EXPECT_THROW(other.load_state_dict(sa.state_dict()), Error);
}

// Optimizer::clip_grads_in_next_step on the CPU: the step clips the gradients it reads by the
// norm's factor, with the bits of clip_grad_norm_ followed by step (AdamW and SGD, a norm that
// clips and one that does not); a gate that is shut drops the request.
TEST(Clip, FoldedIntoTheNextStepMatchesClippingFirst) {
  for (double max_norm : {0.5, 1e9}) {
    Generator gen(21);
    const std::vector<Tensor> start = make_params(gen);
    auto copy_params = [&] {
      std::vector<Tensor> ps;
      for (const Tensor& p : start) ps.push_back(ops::clone(p).requires_grad_(true));
      return ps;
    };
    std::vector<Tensor> a = copy_params(), b = copy_params(), c = copy_params(), d = copy_params();
    optim::AdamW adam_a(a, {.lr = 1e-2}), adam_b(b, {.lr = 1e-2});
    optim::SGD sgd_c(c, {.lr = 0.1, .momentum = 0.9}), sgd_d(d, {.lr = 0.1, .momentum = 0.9});
    for (int step = 1; step <= 3; ++step) {
      set_random_grads(a, gen, 2.0);
      for (size_t i = 0; i < a.size(); ++i) {
        b[i].set_grad(ops::clone(a[i].grad()));
        c[i].set_grad(ops::clone(a[i].grad()));
        d[i].set_grad(ops::clone(a[i].grad()));
      }
      const double norm = optim::clip_grad_norm_(a, max_norm);
      adam_a.step();
      optim::clip_grad_norm_(c, max_norm);
      sgd_c.step();
      const Tensor measured = full({}, norm, {.dtype = DType::f32});
      adam_b.clip_grads_in_next_step(measured, max_norm);
      adam_b.step();
      sgd_d.clip_grads_in_next_step(measured, max_norm);
      sgd_d.step();
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(as_f64(a[i]), as_f64(b[i])) << "AdamW parameter " << i << " step " << step;
        ASSERT_EQ(as_f64(c[i]), as_f64(d[i])) << "SGD parameter " << i << " step " << step;
      }
    }
  }
  // The norm must be one value and max_norm positive.
  Generator gen(3);
  std::vector<Tensor> ps = make_params(gen);
  optim::SGD sgd(ps, {.lr = 0.1});
  EXPECT_THROW(sgd.clip_grads_in_next_step(full({2}, 1.0), 1.0), Error);
  EXPECT_THROW(sgd.clip_grads_in_next_step(full({}, 1.0), 0.0), Error);
  // A shut gate: no step, and the request does not carry over to the next one (the step after
  // it equals a twin's that was never asked to clip).
  set_random_grads(ps, gen, 2.0);
  std::vector<Tensor> twin;
  for (const Tensor& p : ps) {
    twin.push_back(ops::clone(p).requires_grad_(true));
    twin.back().set_grad(ops::clone(p.grad()));
  }
  optim::SGD twin_sgd(twin, {.lr = 0.1});
  const std::vector<double> before = as_f64(ps[0]);
  bool open = false;
  sgd.set_step_gate([&] { return open; });
  sgd.clip_grads_in_next_step(full({}, 1e-3, {.dtype = DType::f32}), 1e-6);
  sgd.step();
  EXPECT_EQ(as_f64(ps[0]), before);
  open = true;
  sgd.step();
  twin_sgd.step();
  for (size_t i = 0; i < ps.size(); ++i) ASSERT_EQ(as_f64(ps[i]), as_f64(twin[i])) << i;
  EXPECT_NE(as_f64(ps[0]), before);
}

TEST(Clip, GlobalNormMatchesFloat64AndScalesOnlyWhenAbove) {
  Generator gen(9);
  auto ps = make_params(gen);
  set_random_grads(ps, gen, 3.0);
  Tensor no_grad = ones({4});
  no_grad.requires_grad_(true);
  ps.push_back(no_grad);  // skipped
  double sq = 0;
  std::vector<std::vector<double>> before;
  for (size_t i = 0; i + 1 < ps.size(); ++i) {
    before.push_back(as_f64(ps[i].grad()));
    for (double g : before.back()) sq += g * g;
  }
  const double norm = std::sqrt(sq);
  EXPECT_NEAR(optim::grad_norm(ps), norm, 1e-9 * norm);
  // Above the norm: nothing changes.
  EXPECT_NEAR(optim::clip_grad_norm_(ps, norm * 2), norm, 1e-9 * norm);
  EXPECT_EQ(as_f64(ps[0].grad()), before[0]);
  // Below: scaled by max_norm / (norm + 1e-6).
  const double max_norm = norm / 7;
  EXPECT_NEAR(optim::clip_grad_norm_(ps, max_norm), norm, 1e-9 * norm);
  const double coef = max_norm / (norm + 1e-6);
  for (size_t i = 0; i + 1 < ps.size(); ++i) {
    auto after = as_f64(ps[i].grad());
    for (size_t k = 0; k < after.size(); ++k) ASSERT_NEAR(after[k], before[i][k] * coef, 1e-6);
  }
  EXPECT_NEAR(optim::grad_norm(ps), max_norm, 1e-5 * max_norm);
  EXPECT_THROW(optim::clip_grad_norm_(ps, 0.0), Error);
  // A non-finite gradient gives a non-finite norm.
  ps[1].set_grad(full(ps[1].shape(), std::numeric_limits<double>::infinity()));
  EXPECT_FALSE(std::isfinite(optim::clip_grad_norm_(ps, 1.0)));
}

TEST(LossScaler, ScalesUnscalesSkipsAndGrows) {
  Tensor p = from_vector<float>({1.0f, -2.0f, 3.0f}, {3});
  p.requires_grad_(true);
  Tensor x = from_vector<float>({0.5f, 0.25f, -1.0f}, {3});
  optim::SGD opt({p}, {.lr = 1.0});
  optim::LossScaler scaler(
      {.init_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 2});
  // backward of the scaled loss: grad = scale * x.
  scaler.backward(sum(p * x));
  EXPECT_EQ(as_f64(p.grad()), (std::vector<double>{512, 256, -1024}));
  EXPECT_TRUE(scaler.step(opt));  // unscales, then steps: p -= x
  scaler.update();
  EXPECT_EQ(as_f64(p), (std::vector<double>{0.5, -2.25, 4.0}));
  EXPECT_EQ(scaler.scale(), 1024);
  EXPECT_EQ(scaler.growth_tracker(), 1);

  // An inf gradient: step skipped, scale backed off, tracker reset.
  opt.zero_grad();
  p.set_grad(from_vector<float>({1.0f, std::numeric_limits<float>::infinity(), 0.0f}, {3}));
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(scaler.found_inf());
  scaler.update();
  EXPECT_EQ(as_f64(p), (std::vector<double>{0.5, -2.25, 4.0}));
  EXPECT_EQ(scaler.scale(), 512);
  EXPECT_EQ(scaler.growth_tracker(), 0);

  // Two clean steps in a row double it; unscale_ twice per step is an error.
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    scaler.scale_loss(sum(p * x)).backward();
    EXPECT_TRUE(scaler.unscale_(opt));
    EXPECT_THROW(scaler.unscale_(opt), Error);
    EXPECT_NEAR(as_f64(p.grad())[2], -1.0, 1e-7);  // the true gradient after unscale_
    scaler.step(opt);
    scaler.update();
  }
  EXPECT_EQ(scaler.scale(), 1024);

  optim::LossScaler restored;
  restored.load_state_dict(scaler.state_dict());
  EXPECT_EQ(restored.scale(), 1024);
  EXPECT_THROW(optim::LossScaler({.init_scale = 0}), Error);
  optim::LossScaler off({.enabled = false});
  EXPECT_EQ(off.scale(), 1.0);
}

// The per-parameter keys of a state dict are spelled in one place: made and read back there,
// other keys (the groups') and malformed ones are not parameters'.
TEST(OptimizerStateKeys, RoundTripAndRefuseOtherKeys) {
  using tessera::optim::optimizer_state_key;
  using tessera::optim::parse_optimizer_state_key;
  EXPECT_EQ(optimizer_state_key(12, "exp_avg"), "state.12.exp_avg");
  const auto parsed = parse_optimizer_state_key(optimizer_state_key(12, "exp_avg_sq"));
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->first, 12u);
  EXPECT_EQ(parsed->second, "exp_avg_sq");
  for (const char* other : {"group.0.lr", "state.3", "state..step", "state.x.step", "state.3.",
                            "state.-1.step", "states.1.step"})
    EXPECT_FALSE(parse_optimizer_state_key(other).has_value()) << other;
}
