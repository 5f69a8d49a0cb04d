// transformers' schedules (optim/transformers_schedules.h): the lr at every step equals what
// transformers.get_scheduler gives under PyTorch (the pinned Debian python3 with torch and
// transformers; skipped where they are missing), warmup from lr 0 included; keywords a
// schedule does not take and schedules Tessera lacks are refused by name.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "tessera/optim/optim.h"
#include "tests/nn/python_reference.h"

using namespace tessera;

namespace {

struct Case {
  std::string name;
  double lr;
  int64_t warmup, total;
  nlohmann::json kwargs;  // scheduler_specific_kwargs
  int64_t steps;
};

std::vector<std::vector<double>> transformers_lrs(const std::vector<Case>& cases) {
  nlohmann::json spec = nlohmann::json::array();
  for (const Case& c : cases)
    spec.push_back({{"name", c.name}, {"lr", c.lr}, {"warmup", c.warmup}, {"total", c.total},
                    {"kwargs", c.kwargs}, {"steps", c.steps}});
  const std::string cmd = test::python_interpreter() + " " TESSERA_SOURCE_DIR
                          "/tests/optim/transformers_schedules.py '" + spec.dump() + "'";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (pipe && fgets(buf, sizeof(buf), pipe)) out += buf;
  EXPECT_EQ(pipe ? pclose(pipe) : -1, 0) << cmd << "\n" << out;
  return nlohmann::json::parse(out).get<std::vector<std::vector<double>>>();
}

optim::SchedulerKwargs kwargs_of(const nlohmann::json& j) {
  optim::SchedulerKwargs k;
  if (j.contains("num_cycles")) k.num_cycles = j["num_cycles"].get<double>();
  if (j.contains("min_lr")) k.min_lr = j["min_lr"].get<double>();
  if (j.contains("min_lr_rate")) k.min_lr_rate = j["min_lr_rate"].get<double>();
  if (j.contains("lr_end")) k.lr_end = j["lr_end"].get<double>();
  if (j.contains("power")) k.power = j["power"].get<double>();
  return k;
}

// The lr the optimizer holds during each step, the schedule stepped after each.
std::vector<double> tessera_lrs(const Case& c) {
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW opt({w}, {.lr = c.lr});
  auto schedule = optim::get_scheduler(c.name, opt, c.warmup, c.total, kwargs_of(c.kwargs));
  std::vector<double> lrs;
  for (int64_t s = 0; s < c.steps; ++s) {
    lrs.push_back(opt.lr());
    schedule->step();
  }
  return lrs;
}

}  // namespace

TEST(TransformersSchedules, LrAtEveryStepEqualsTransformersGetScheduler) {
  if (!test::python_can_import("torch, transformers"))
    GTEST_SKIP() << test::python_interpreter() << " cannot import torch and transformers";
  const nlohmann::json none = nlohmann::json::object();
  // Past the total too (steps > total), where the decays hold their end value.
  const std::vector<Case> cases = {
      {"linear", 2e-4, 5, 30, none, 34},
      {"linear", 1e-3, 0, 12, none, 14},
      {"cosine", 3e-4, 4, 25, none, 28},
      {"cosine", 3e-4, 0, 20, {{"num_cycles", 1.5}}, 22},
      {"cosine_with_min_lr", 5e-4, 3, 20, {{"min_lr", 1e-5}}, 24},
      {"cosine_with_min_lr", 5e-4, 3, 20, {{"min_lr_rate", 0.1}}, 24},
      {"constant_with_warmup", 1e-3, 7, 20, none, 12},
      {"polynomial", 1e-3, 4, 20, none, 24},
      {"polynomial", 1e-3, 2, 16, {{"power", 2.0}, {"lr_end", 1e-5}}, 20},
      {"cosine_with_restarts", 1e-3, 2, 22, {{"num_cycles", 3}}, 24},
      {"inverse_sqrt", 1e-3, 5, 0, none, 20},
      {"constant", 1e-3, 0, 0, none, 5},
  };
  const auto want = transformers_lrs(cases);
  ASSERT_EQ(want.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<double> got = tessera_lrs(cases[i]);
    ASSERT_EQ(got.size(), want[i].size());
    for (size_t s = 0; s < got.size(); ++s)
      EXPECT_NEAR(got[s], want[i][s], 1e-15 * cases[i].lr + 1e-300)
          << cases[i].name << " " << cases[i].kwargs.dump() << " step " << s;
  }
}

// Independent of Python: warmup starts at 0 (transformers' convention), Tessera's own
// schedule starts at lr/warmup; cosine decays to 0 where Tessera's decays to its floor.
TEST(TransformersSchedules, WarmupStartsAtZeroAndCosineEndsAtZero) {
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW opt({w}, {.lr = 2e-4});
  auto linear = optim::get_linear_schedule_with_warmup(opt, 10, 100);
  EXPECT_EQ(linear->lr_at(0), 0.0);
  EXPECT_DOUBLE_EQ(linear->lr_at(1), 2e-5);
  EXPECT_DOUBLE_EQ(linear->lr_at(10), 2e-4);
  EXPECT_DOUBLE_EQ(linear->lr_at(55), 1e-4);
  auto cosine = optim::get_cosine_schedule_with_warmup(opt, 0, 50);
  EXPECT_DOUBLE_EQ(cosine->lr_at(0), 2e-4);
  EXPECT_EQ(cosine->lr_at(50), 0.0);
  auto floor = optim::get_cosine_with_min_lr_schedule_with_warmup(opt, 0, 50, 0.5, 2e-5);
  EXPECT_DOUBLE_EQ(floor->lr_at(50), 2e-5);
  optim::LinearSchedule own(opt, {.warmup = 10, .total = 100});
  EXPECT_DOUBLE_EQ(own.lr_at(0), 2e-5);
}

TEST(TransformersSchedules, UnknownKeywordsAndSchedulesAreRefusedByName) {
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW opt({w}, {.lr = 1e-3});
  auto message = [&](auto&& make) {
    try {
      make();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([&] { optim::get_scheduler("linear", opt, 2, 10, {.num_cycles = 2}); }).find("num_cycles"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_scheduler("reduce_lr_on_plateau", opt, 0, 10); }).find("metric"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_scheduler("warmup_stable_decay", opt, 0, 10); }).find("supported"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_scheduler("cosine_with_min_lr", opt, 0, 10); }).find("min_lr"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_scheduler("constant", opt, 5, 10); }).find("constant_with_warmup"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_scheduler("linear", opt, 5); }).find("num_training_steps"),
            std::string::npos);
  EXPECT_NE(message([&] { optim::get_polynomial_decay_schedule_with_warmup(opt, 0, 10, 1.0); }).find("lr_end"),
            std::string::npos);
}

// A resumed schedule continues where it stopped; another shape's state is refused.
TEST(TransformersSchedules, StateDictRestoresTheStepAndChecksTheShape) {
  Tensor w = zeros({2});
  w.requires_grad_(true);
  optim::AdamW a({w}, {.lr = 1e-3}), b({w}, {.lr = 1e-3});
  auto sa = optim::get_cosine_schedule_with_warmup(a, 2, 20);
  for (int i = 0; i < 7; ++i) sa->step();
  auto sb = optim::get_cosine_schedule_with_warmup(b, 2, 20);
  sb->load_state_dict(sa->state_dict());
  EXPECT_EQ(sb->current_step(), 7);
  EXPECT_EQ(b.lr(), a.lr());
  auto linear = optim::get_linear_schedule_with_warmup(b, 2, 20);
  EXPECT_THROW(linear->load_state_dict(sa->state_dict()), Error);
  auto restarts = optim::get_cosine_schedule_with_warmup(b, 2, 20, 1.5);
  EXPECT_THROW(restarts->load_state_dict(sa->state_dict()), Error);
}
