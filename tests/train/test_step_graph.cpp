// StepGraphRunner where no graph can be recorded (the CPU): every step runs eagerly with the
// same results as calling the step directly, and status() says why; the host-state pieces a
// failed capture restores (optimizer step counts) and the errors of the device-only paths.
// The GPU behaviour (recording, replaying, shape changes) is tests/cuda/test_cuda_graphs.cpp.
#include <gtest/gtest.h>

#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/clip.h"
#include "tessera/train/step_graph.h"

using namespace tessera;

namespace {

struct TinyRun {
  std::unique_ptr<nn::GPT> model;
  std::vector<double> losses;
  std::string status;
  int64_t eager = 0, replayed = 0;
};

nn::GPTConfig tiny_config() {
  nn::GPTConfig g;
  g.vocab_size = 23, g.block_size = 8, g.n_layer = 1, g.n_head = 2, g.n_embd = 8;
  return g;
}

// Four AdamW steps on one random batch, through a runner (graphs asked for) or directly.
TinyRun train_tiny(bool through_runner) {
  dist::Accelerator acc({.cpu = true});
  TinyRun run;
  Generator gen(4);
  run.model = std::make_unique<nn::GPT>(tiny_config(), &gen);
  optim::AdamW opt(run.model->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  acc.prepare(*run.model, opt);
  auto step = [&](const std::vector<data::Batch>& batches) {
    const dist::AccumulateScope scope = acc.accumulate(*run.model);
    const Tensor loss = run.model->loss(batches[0].x, batches[0].y);
    acc.backward(loss);
    const double norm = acc.clip_grad_norm_(run.model->parameters(), 0.5);
    opt.step();
    opt.zero_grad();
    return train::StepOutputs{loss.detach(), full({}, norm)};
  };
  train::StepGraphRunner runner(acc, opt, step, {.enabled = true});
  Generator data_gen(9);  // one batch, seen every step: its loss must fall
  const Tensor tokens = randint(0, 23, {3, 9}, {.dtype = DType::i64}, &data_gen);
  const std::vector<data::Batch> batches{{ops::contiguous(ops::narrow(tokens, 1, 0, 8)),
                                          ops::contiguous(ops::narrow(tokens, 1, 1, 8))}};
  for (int i = 0; i < 4; ++i)
    run.losses.push_back((through_runner ? runner.run(batches) : step(batches)).loss.item());
  run.status = runner.status();
  run.eager = runner.eager_steps();
  run.replayed = runner.replayed_steps();
  return run;
}

}  // namespace

TEST(StepGraphRunner, RunsEagerlyWhereNoGraphCanBeRecorded) {
  const TinyRun direct = train_tiny(false);
  const TinyRun runner = train_tiny(true);
  EXPECT_EQ(runner.losses, direct.losses);
  const auto a = runner.model->state_dict(), b = direct.model->state_dict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i].second.to_vector<float>(), b[i].second.to_vector<float>()) << a[i].first;
  EXPECT_EQ(runner.eager, 4);
  EXPECT_EQ(runner.replayed, 0);
  EXPECT_EQ(runner.status, "eager: the run is not on a CUDA device");
  EXPECT_LT(direct.losses.back(), direct.losses.front());  // it trains
}

TEST(StepGraphRunner, RejectsAMismatchedNumberOfMicroBatches) {
  dist::Accelerator acc({.gradient_accumulation_steps = 2, .cpu = true});
  Generator gen(4);
  nn::GPT model(tiny_config(), &gen);
  optim::AdamW opt(model.parameters(), {});
  train::StepGraphRunner runner(acc, opt, [](const auto&) { return train::StepOutputs{}; }, {});
  const Tensor x = zeros({1, 8}, {.dtype = DType::i64});
  try {
    runner.run({{x, x}});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 micro-batches for 2 accumulation steps"),
              std::string::npos)
        << e.what();
  }
}

TEST(StepGraphRunner, StepCountsRoundTripAndReplayNeedsARecording) {
  Generator gen(4);
  nn::GPT model(tiny_config(), &gen);
  optim::AdamW opt(model.parameters(), {});
  const size_t n = model.parameters().size();
  std::vector<int64_t> steps(n);
  for (size_t i = 0; i < n; ++i) steps[i] = static_cast<int64_t>(3 * i + 1);
  opt.set_step_counts(steps);
  EXPECT_EQ(opt.step_counts(), steps);
  EXPECT_THROW(opt.set_step_counts({1, 2}), Error);
  try {
    opt.prepare_graph_replay();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no step was recorded"), std::string::npos) << e.what();
  }
}

TEST(StepGraphRunner, DeviceClippingNeedsTheFusedKernels) {
  Generator gen(4);
  Tensor w = randn({3, 5}, {}, &gen).requires_grad_();
  w.set_grad(randn({3, 5}, {}, &gen));
  try {
    optim::clip_grad_norm_on_device_({w}, 1.0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu has no fused norm and clip kernels"),
              std::string::npos)
        << e.what();
  }
}
