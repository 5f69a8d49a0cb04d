// Pipeline parallelism (dist/pipeline_parallel.h): the schedules and their logical timelines,
// the cut, the refusals and a one-stage pipeline in one process; GPT-2 and Llama cut into 2
// and 4 stages (dist_pp_check jobs through `tessera launch`) against the same models trained
// in one process, and the bubble measured on the timeline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>

#include "parallel_jobs.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/dist/single_process_group.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace {

using namespace tessera;
using dist::PipelineOp;
using dist::PipelineSchedule;
using tessera::parallel_check::count_of;
using tessera::parallel_check::error_of;
using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

std::string order_of(const std::vector<PipelineOp>& ops) {
  std::string out;
  for (const PipelineOp& op : ops)
    out += (op.kind == PipelineOp::forward ? "F" : "B") + std::to_string(op.micro_batch) + " ";
  return out;
}

TEST(PipelineParallel, SchedulesRunEveryMicroBatchInTheirOrder) {
  // 4 stages, 6 micro-batches: AFAB all forwards then all backwards on every stage; 1F1B a
  // warm-up of 3 - s forwards, then alternating, then the remaining backwards.
  EXPECT_EQ(order_of(dist::pipeline_ops(PipelineSchedule::afab, 2, 4, 6)),
            "F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5 ");
  EXPECT_EQ(order_of(dist::pipeline_ops(PipelineSchedule::one_f_one_b, 0, 4, 6)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  EXPECT_EQ(order_of(dist::pipeline_ops(PipelineSchedule::one_f_one_b, 2, 4, 6)),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5 ");
  EXPECT_EQ(order_of(dist::pipeline_ops(PipelineSchedule::one_f_one_b, 3, 4, 6)),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 ");
  // Fewer micro-batches than the warm-up: stage 0 of 4 with 2 runs F0 F1 B0 B1.
  EXPECT_EQ(order_of(dist::pipeline_ops(PipelineSchedule::one_f_one_b, 0, 4, 2)), "F0 F1 B0 B1 ");
  EXPECT_EQ(dist::parse_pipeline_schedule("1f1b"), PipelineSchedule::one_f_one_b);
  EXPECT_NE(error_of([] {
              dist::parse_pipeline_schedule("gpipe");
            }).find("unknown schedule 'gpipe' (expected afab or 1f1b)"),
            std::string::npos);
}

// At most p - s micro-batches' activations live on stage s under 1F1B; all m under AFAB.
TEST(PipelineParallel, OneFOneBHoldsAtMostTheStagesAheadInFlight) {
  for (int s = 0; s < 4; ++s)
    for (PipelineSchedule schedule : {PipelineSchedule::afab, PipelineSchedule::one_f_one_b}) {
      int live = 0, most = 0;
      for (const PipelineOp& op : dist::pipeline_ops(schedule, s, 4, 8))
        most = std::max(most, live += op.kind == PipelineOp::forward ? 1 : -1);
      EXPECT_EQ(most, schedule == PipelineSchedule::afab ? 8 : 4 - s) << s;
    }
}

// The logical timeline of both schedules: the bubble (p - 1) / (m + p - 1), exactly, for any
// forward and backward costs; stage 0 runs the first and the last op.
TEST(PipelineParallel, LogicalTimelineBubbleIsGPipesFormula) {
  for (PipelineSchedule schedule : {PipelineSchedule::afab, PipelineSchedule::one_f_one_b})
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 4, 8})
        for (double backward : {1.0, 2.0}) {
          const auto stages = dist::simulate_pipeline(schedule, p, m, 1.0, backward);
          std::vector<double> busy;
          double first = 1e300, last = 0;
          for (const dist::PipelineTimeline& t : stages) {
            busy.push_back(t.busy_s());
            EXPECT_DOUBLE_EQ(t.busy_s(), m * (1 + backward));
            first = std::min(first, t.events.front().start_s);
            last = std::max(last, t.events.back().end_s);
          }
          EXPECT_EQ(first, stages.front().events.front().start_s);
          EXPECT_EQ(last, stages.front().events.back().end_s);
          EXPECT_DOUBLE_EQ(stages.front().span_s(), (m + p - 1) * (1 + backward));
          EXPECT_NEAR(dist::pipeline_bubble(busy, stages.front().span_s()),
                      dist::theoretical_bubble(p, m), 1e-12)
              << dist::pipeline_schedule_name(schedule) << " p " << p << " m " << m;
        }
  EXPECT_DOUBLE_EQ(dist::theoretical_bubble(4, 8), 3.0 / 11.0);
}

TEST(PipelineParallel, StagesTakeContiguousBlocksDifferingByAtMostOne) {
  // 5 blocks on 2 stages: 0..1 and 2..4; on 4: 1, 1, 1, 2.
  EXPECT_EQ(dist::pipeline_stage_blocks(5, 0, 2).end, 2);
  EXPECT_EQ(dist::pipeline_stage_blocks(5, 1, 2).begin, 2);
  EXPECT_EQ(dist::pipeline_stage_blocks(5, 1, 2).end, 5);
  int64_t next = 0;
  for (int s = 0; s < 4; ++s) {
    const dist::StageBlocks b = dist::pipeline_stage_blocks(5, s, 4);
    EXPECT_EQ(b.begin, next);
    EXPECT_EQ(b.end - b.begin, s < 3 ? 1 : 2);
    next = b.end;
  }
  EXPECT_EQ(next, 5);
}

TEST(PipelineParallel, RefusesSizesNamingTheNumbers) {
  EXPECT_NE(error_of([] {
              dist::check_pipeline_parallel(4, 5, "GPT-2");
            }).find("pp_size 5 exceeds the 4 blocks of GPT-2"),
            std::string::npos);
  EXPECT_NO_THROW(dist::check_pipeline_parallel(4, 4, "GPT-2"));
  EXPECT_NE(error_of([] {
              dist::check_micro_batches(3, 16);
            }).find("micro_batches 3 does not divide the batch of 16 rows"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { dist::check_micro_batches(0, 16); }).find("micro_batches must be >= 1, got 0"),
      std::string::npos);
  dist::SingleProcessGroup world;
  EXPECT_NE(error_of([&] {
              dist::pipeline_parallel_group(world, 2);
            }).find("pp_size 2 does not divide the world size 1"),
            std::string::npos);
  Generator gen(1);
  nn::GPT gpt({.vocab_size = 17, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 8}, &gen);
  gpt.set_dropout(0.1);
  EXPECT_NE(error_of([&] {
              dist::pipeline_parallel(gpt, std::make_shared<dist::SingleProcessGroup>());
            }).find("GPT-2's dropout is 0.1"),
            std::string::npos);
}

// One stage holding the whole model, 4 micro-batches: the loss and every gradient of one
// process's loss(idx, targets).backward() on the whole batch, ignored targets included, under
// the full model's parameter names; the input refusals.
TEST(PipelineParallel, OneStageEqualsOneProcessAndRefusesBadBatches) {
  Generator gen(4);
  nn::GPT gpt({.vocab_size = 31, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16}, &gen);
  nn::Llama llama({.vocab_size = 31,
                   .hidden_size = 16,
                   .intermediate_size = 24,
                   .num_hidden_layers = 2,
                   .num_attention_heads = 4,
                   .num_key_value_heads = 2,
                   .max_position_embeddings = 8},
                  &gen);
  const Tensor x = randint(0, 31, {8, 6}, {.dtype = DType::i64}, &gen);
  Tensor y = randint(0, 31, {8, 6}, {.dtype = DType::i64}, &gen);
  ops::fill_(ops::narrow(ops::narrow(y, 0, 1, 3), 1, 0, 4), -100.0);
  for (nn::CausalLM* model : std::vector<nn::CausalLM*>{&gpt, &llama}) {
    auto pipe = dist::pipeline_parallel(*model, std::make_shared<dist::SingleProcessGroup>(),
                                        {.micro_batches = 4});
    const Tensor want = model->loss(x, y);
    want.backward();
    const Tensor got = pipe->train_step(x, y);
    EXPECT_NEAR(got.item(), want.item(), 1e-6 * want.item()) << model->describe();
    const nn::NamedTensors mine = pipe->named_parameters();
    ASSERT_EQ(mine.size(), model->named_parameters().size());
    for (const auto& [name, p] : mine) {
      const auto g = p.grad().to_vector<float>();
      const auto w = model->parameter(name).grad().to_vector<float>();
      double diff = 0, norm = 0;
      for (size_t i = 0; i < w.size(); ++i)
        diff += (g[i] - w[i]) * (g[i] - w[i]), norm += w[i] * w[i];
      EXPECT_LE(std::sqrt(diff / std::max(norm, 1e-30)), 1e-5) << name;
    }
    EXPECT_EQ(pipe->timeline().events.size(), 8u);
    EXPECT_NE(error_of([&] {
                pipe->train_step(ops::narrow(x, 0, 0, 6), ops::narrow(y, 0, 0, 6));
              }).find("micro_batches 4 does not divide the batch of 6 rows"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                pipe->train_step(x, ops::narrow(y, 0, 0, 4));
              }).find("targets [4, 6] must have idx's shape [8, 6]"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                pipe->set_options({.micro_batches = 0});
              }).find("micro_batches must be >= 1, got 0"),
              std::string::npos);
  }
}

std::string launch(int nproc, const std::string& args) {
  return parallel_check::launch(DIST_PP_CHECK, nproc, args);
}

double expect_equal_to_one_process(int nproc, const std::string& args) {
  return parallel_check::expect_equal_to_one_process(DIST_PP_CHECK, "pp", nproc, args);
}

// GPT-2's AdamW runs with eps 1e-5, as in test_tensor_parallel.cpp: the key bias's gradient is
// zero in real numbers, and eps 1e-8 would turn the rounding noise both runs compute there into
// steps that no two summation orders agree on. Llama has no biases and runs with 1e-8.
const std::string kGpt = "--model gpt --eps 1e-5";

// 5 blocks: 2 + 3 on 2 stages, 1 + 1 + 1 + 2 on 4; 16 rows in 8 micro-batches of 2.
TEST(PipelineParallelJobs, Gpt2TiedOn2And4StagesBothSchedulesEqualsOneProcess) {
  for (const char* schedule : {"afab", "1f1b"}) {
    const std::string args = kGpt + " --schedule " + schedule;
    EXPECT_LE(expect_equal_to_one_process(2, args), 1e-6);
    EXPECT_LE(expect_equal_to_one_process(4, args), 1e-6);
  }
}

TEST(PipelineParallelJobs, Gpt2UntiedAndTwoPipelinesOf2On4RanksSavedAndReloaded) {
  const auto dir = tessera::test_jobs::fresh_scratch_folder("pp_save").string();
  EXPECT_LE(expect_equal_to_one_process(4, kGpt + " --untied --save-dir " + dir + "/untied"), 1e-6);
  EXPECT_LE(
      expect_equal_to_one_process(4, kGpt + " --pp 2 --schedule afab --save-dir " + dir + "/pipes"),
      1e-6);
  EXPECT_TRUE(std::filesystem::exists(dir + "/pipes/pipe1/model.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST(PipelineParallelJobs, LlamaOn2And4StagesBothSchedulesAndTiedSavedEqualsOneProcess) {
  for (const char* schedule : {"afab", "1f1b"}) {
    const std::string args = std::string("--model llama --schedule ") + schedule;
    EXPECT_LE(expect_equal_to_one_process(2, args), 1e-6);
    EXPECT_LE(expect_equal_to_one_process(4, args), 1e-6);
  }
  // Tied, with the model directory written by each of two pipelines of 2 and read back.
  const auto dir = tessera::test_jobs::fresh_scratch_folder("pp_llama").string();
  EXPECT_LE(expect_equal_to_one_process(4, "--model llama --tied --pp 2 --save-dir " + dir), 1e-6);
  EXPECT_TRUE(std::filesystem::exists(dir + "/pipe1/model.safetensors"));
  std::filesystem::remove_all(dir);
}

// The bubble of the last step's timeline for p = 2, 4 and m = 4, 8, both schedules. Asserted:
// the stages' recorded op orders replayed in op slots equal (p - 1) / (m + p - 1) within 10%
// (exactly, when the stages ran their schedule). Reported, not asserted: the wall-clock figure
// and the orders replayed with each op's CPU time. On a 2-core machine 4 ranks (and whatever
// else runs there) share the cores, so an op's wall-clock time depends on how many other
// stages compute at that moment; docs/parallelism.md has the figures and why they differ.
TEST(PipelineParallelJobs, BubbleOnTheTimelineIsGPipesFormula) {
  const std::regex figures(
      "rank 0: bubble (.*): wall-clock ([0-9.]+) .* replayed CPU time ([0-9.]+), logical "
      "([0-9.]+), theory ([0-9.]+)");
  for (int p : {2, 4})
    for (int m : {4, 8})
      for (const char* schedule : {"afab", "1f1b"}) {
        const JobResult r = run_job(
            launch(p, "--bubble --micro-batches " + std::to_string(m) + " --schedule " + schedule),
            120);
        EXPECT_EQ(r.status, 0) << r.output;
        EXPECT_EQ(count_of(r.output, "-> OK"), p) << r.output;
        std::smatch got;
        ASSERT_TRUE(std::regex_search(r.output, got, figures)) << r.output;
        const double theory = std::stod(got[5]);
        EXPECT_NEAR(std::stod(got[4]), theory, 0.1 * theory) << r.output;
        std::printf(
            "[ pp ] bubble %s: theory %s, logical %s, replayed CPU time %s, wall-clock %s\n",
            got[1].str().c_str(), got[5].str().c_str(), got[4].str().c_str(), got[3].str().c_str(),
            got[2].str().c_str());
      }
}

void expect_refused(int nproc, const std::string& args, const std::string& message) {
  parallel_check::expect_refused(DIST_PP_CHECK, nproc, args, message);
}

TEST(PipelineParallelJobs, BadSizesAreRefusedOnEveryRankNamingTheNumbers) {
  expect_refused(4, "--model gpt --layers 3", "pp_size 4 exceeds the 3 blocks of GPT-2");
  expect_refused(4, "--model llama --pp 3", "pp_size 3 does not divide the world size 4");
  expect_refused(2, "--model gpt --micro-batches 3",
                 "micro_batches 3 does not divide the batch of 16 rows");
  expect_refused(2, "--model llama --micro-batches 0", "micro_batches must be >= 1, got 0");
}

}  // namespace
