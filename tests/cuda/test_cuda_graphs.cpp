// Whole training steps recorded as CUDA graphs (train/step_graph.h) against the same steps
// run eagerly: losses, gradient norms and weights must agree bit for bit, through the
// Trainer (bf16, a warming-up cosine schedule so the lr changes every replay, clipping,
// gradient accumulation) and through StepGraphRunner directly with a shape change in the
// middle of the run and with steps that cannot be recorded (a host read, dropout).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/cuda/graph_copy_nodes.h"
#include "tessera/data/token_file.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"
#include "tessera/train/step_graph.h"
#include "tessera/train/trainer.h"
#include "tests/cuda/cuda_test_util.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

constexpr int64_t kVocab = 61;

fs::path scratch(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("tessera_test_graphs_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

data::TokenFile token_stream(const fs::path& dir) {
  std::vector<uint32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<uint32_t>((i * 7 + i / 11 + (i * i) % 13) % kVocab);
  data::write_token_file(dir / "tokens.bin", tokens);
  return data::TokenFile(dir / "tokens.bin");
}

nn::GPTConfig tiny_config(double dropout = 0.0) {
  nn::GPTConfig g;
  g.vocab_size = kVocab, g.block_size = 32, g.n_layer = 2, g.n_head = 2, g.n_embd = 32;
  g.dropout = dropout;
  return g;
}

// Every element's bits, so that equality means bit for bit (NaN included).
std::vector<uint32_t> bits_of(const Tensor& t) {
  const std::vector<float> v =
      raw::to(t.detach(), Device::cpu(), DType::f32).contiguous().to_vector<float>();
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

void expect_same_weights(nn::Module& a, nn::Module& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    SCOPED_TRACE(sa[i].first);
    ASSERT_EQ(sa[i].first, sb[i].first);
    EXPECT_EQ(bits_of(sa[i].second), bits_of(sb[i].second));
  }
}

// index_add_ adds with atomics unless deterministic (the embedding's backward no longer uses
// it and is deterministic by itself); kept so that nothing in a step varies between runs.
class Deterministic {
 public:
  Deterministic() { cuda::set_deterministic(true); }
  ~Deterministic() { cuda::set_deterministic(false); }
};

class GraphsEnv {
 public:
  explicit GraphsEnv(const char* value) { setenv("TESSERA_CUDA_GRAPHS", value, 1); }
  ~GraphsEnv() { unsetenv("TESSERA_CUDA_GRAPHS"); }
};

struct TrainerRun {
  std::vector<double> losses, norms, lrs;
  std::unique_ptr<nn::GPT> model;
  int64_t replayed = 0;
  std::string status;
};

TrainerRun train_with_graphs(const char* graphs, int64_t accumulation, int64_t zero_stage = 0) {
  GraphsEnv env(graphs);
  const fs::path dir = scratch(std::string("trainer_") + graphs + "_" +
                               std::to_string(accumulation) + "_" + std::to_string(zero_stage));
  const data::TokenFile tokens = token_stream(dir);
  train::TrainingArguments a;
  a.data = (dir / "tokens.bin").string();
  a.output_dir = (dir / "run").string();
  a.n_layer = 2, a.n_head = 2, a.n_embd = 32, a.seq = 32;
  a.per_device_train_batch_size = 6;
  a.gradient_accumulation_steps = accumulation;
  a.max_steps = 9;
  a.warmup_steps = 3;  // cosine with warmup: a different lr at every step
  a.learning_rate = 3e-3;
  a.max_grad_norm = 0.5;  // small enough to clip
  a.bf16 = true;
  a.device = "cuda";
  a.eval_strategy = "no";
  a.seed = 7;
  a.zero_stage = zero_stage;
  TrainerRun run;
  Generator gen(5);
  run.model = std::make_unique<nn::GPT>(tiny_config(), &gen);
  train::Trainer trainer(a, *run.model, tokens);
  trainer.train();
  // ZeRO-3 keeps only each rank's slice between steps (a checkpoint no longer gathers the
  // model): the whole weights for the comparison.
  trainer.accelerator().unwrap_model(*run.model);
  trainer.state().log_history.for_each([&](const nlohmann::json& entry) {
    run.losses.push_back(entry.at("loss").get<double>());
    run.norms.push_back(entry.at("grad_norm").get<double>());
    run.lrs.push_back(entry.at("learning_rate").get<double>());
  });
  if (const train::StepGraphRunner* g = trainer.step_graphs()) {
    run.replayed = g->replayed_steps();
    run.status = g->status();
  }
  return run;
}

// The device work of one step, as the Trainer's: accumulate, loss, backward, clip, update.
train::StepOutputs gpt_step(dist::Accelerator& acc, nn::GPT& model, optim::AdamW& opt,
                            const std::vector<data::Batch>& batches, bool read_on_host) {
  Tensor loss_sum;
  for (const data::Batch& b : batches) {
    const dist::AccumulateScope scope = acc.accumulate(model);
    const Tensor loss = model.loss(b.x, b.y);
    acc.backward(loss);
    if (read_on_host) EXPECT_TRUE(std::isfinite(loss.item()));  // not recordable
    const Tensor l64 = raw::to(loss.detach(), loss.device(), DType::f64);
    loss_sum = loss_sum.defined() ? ops::add(loss_sum, l64) : l64;
  }
  train::StepOutputs out{loss_sum, acc.clip_grad_norm_on_device_(model.parameters(), 0.5)};
  opt.step();
  opt.zero_grad();
  return out;
}

// A tiny GPT trained by a StepGraphRunner (graphs on or off) on batches of the given
// sequence lengths, one optimizer step per entry; returns the losses read after each step.
struct RunnerRun {
  std::vector<double> losses;
  std::unique_ptr<nn::GPT> model;
  int64_t replayed = 0, recorded = 0, eager = 0;
  std::string status;
};

RunnerRun run_runner(bool graphs, const std::vector<int64_t>& seqs, bool read_on_host = false,
                     double dropout = 0.0) {
  dist::Accelerator acc({.mixed_precision = "bf16"});
  RunnerRun run;
  Generator gen(11);
  run.model = std::make_unique<nn::GPT>(tiny_config(dropout), &gen);
  run.model->to(acc.device());
  optim::AdamW opt(run.model->parameters(), {.lr = 2e-3, .weight_decay = 0.1});
  acc.prepare(*run.model, opt);
  manual_seed(3);  // the dropout masks draw from the default generator
  train::StepGraphRunner runner(acc, opt,
                                [&](const std::vector<data::Batch>& b) {
                                  return gpt_step(acc, *run.model, opt, b, read_on_host);
                                },
                                {.enabled = graphs});
  Generator data_gen(21);
  for (size_t step = 0; step < seqs.size(); ++step) {
    const Tensor tokens = randint(0, kVocab, {4, seqs[step] + 1}, {.dtype = DType::i64}, &data_gen);
    const data::Batch batch{
        raw::to(raw::narrow(tokens, 1, 0, seqs[step]), acc.device(), DType::i64),
        raw::to(raw::narrow(tokens, 1, 1, seqs[step]), acc.device(), DType::i64)};
    opt.set_lr(2e-3 * (1.0 + 0.1 * static_cast<double>(step)));  // a new lr every step
    run.losses.push_back(runner.run({batch}).loss.item());
  }
  run.replayed = runner.replayed_steps();
  run.recorded = runner.recorded_graphs();
  run.eager = runner.eager_steps();
  run.status = runner.status();
  return run;
}

}  // namespace

TEST(CudaGraphs, TrainerStepsMatchEagerBitForBit) {
  TESSERA_REQUIRE_GPU();
  Deterministic deterministic;
  for (int64_t accumulation : {1, 2}) {
    SCOPED_TRACE("gradient_accumulation_steps " + std::to_string(accumulation));
    const TrainerRun eager = train_with_graphs("0", accumulation);
    const TrainerRun graphed = train_with_graphs("1", accumulation);
    ASSERT_EQ(eager.losses.size(), 9u);
    EXPECT_EQ(graphed.losses, eager.losses);
    EXPECT_EQ(graphed.norms, eager.norms);
    EXPECT_EQ(graphed.lrs, eager.lrs);
    expect_same_weights(*graphed.model, *eager.model);
    // One warm-up step eagerly, one recorded (and replayed once), seven replays.
    EXPECT_EQ(graphed.replayed, 7) << graphed.status;
    EXPECT_EQ(graphed.status, "replaying");
    // The run learns (the data are a fixed pattern) and clipping was active at first.
    EXPECT_LT(eager.losses.back(), eager.losses.front());
    EXPECT_GT(eager.norms.front(), 0.5);
  }
}

// ZeRO shards the gradients, so their norm cannot be decided by one device inside a recorded
// step: the Trainer steps eagerly (it used to record anyway and fail in the first step).
TEST(CudaGraphs, TrainerUnderZeroStepsEagerly) {
  TESSERA_REQUIRE_GPU();
  Deterministic deterministic;
  for (int64_t stage : {1, 2, 3}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    const TrainerRun eager = train_with_graphs("0", 1, stage);
    const TrainerRun asked = train_with_graphs("1", 1, stage);
    ASSERT_EQ(asked.losses.size(), 9u);
    EXPECT_EQ(asked.replayed, 0);
    EXPECT_EQ(asked.losses, eager.losses);
    expect_same_weights(*asked.model, *eager.model);
    EXPECT_LT(asked.losses.back(), asked.losses.front());
  }
}

TEST(CudaGraphs, ShapeChangeRunsEagerlyThenRecordsTheNewShape) {
  TESSERA_REQUIRE_GPU();
  Deterministic deterministic;
  // 32, 32, 32 (warm-up, record, replay), 16 x 3 (warm-up, record, replay), 32 (replay).
  const std::vector<int64_t> seqs = {32, 32, 32, 16, 16, 16, 32};
  const RunnerRun eager = run_runner(false, seqs);
  const RunnerRun graphed = run_runner(true, seqs);
  EXPECT_EQ(graphed.losses, eager.losses);
  expect_same_weights(*graphed.model, *eager.model);
  EXPECT_EQ(graphed.recorded, 2);
  EXPECT_EQ(graphed.replayed, 3);
  EXPECT_EQ(graphed.eager, 2);
  EXPECT_EQ(graphed.status, "replaying");
  EXPECT_EQ(eager.replayed, 0);
  EXPECT_NE(eager.status.find("graphs are off"), std::string::npos) << eager.status;
}

TEST(CudaGraphs, StepThatCannotBeRecordedFallsBackCleanly) {
  TESSERA_REQUIRE_GPU();
  Deterministic deterministic;
  const std::vector<int64_t> seqs = {32, 32, 32, 32};
  {
    SCOPED_TRACE("a host read inside the step");
    const RunnerRun eager = run_runner(false, seqs, /*read_on_host=*/true);
    const RunnerRun graphed = run_runner(true, seqs, /*read_on_host=*/true);
    EXPECT_EQ(graphed.losses, eager.losses);
    expect_same_weights(*graphed.model, *eager.model);
    EXPECT_EQ(graphed.recorded, 0);
    EXPECT_EQ(graphed.replayed, 0);
    EXPECT_EQ(graphed.eager, 4);
    EXPECT_NE(graphed.status.find("could not be recorded"), std::string::npos) << graphed.status;
  }
  {
    SCOPED_TRACE("dropout draws random numbers");
    const RunnerRun eager = run_runner(false, seqs, false, /*dropout=*/0.1);
    const RunnerRun graphed = run_runner(true, seqs, false, /*dropout=*/0.1);
    EXPECT_EQ(graphed.losses, eager.losses);
    expect_same_weights(*graphed.model, *eager.model);
    EXPECT_EQ(graphed.replayed, 0);
    EXPECT_NE(graphed.status.find("random numbers"), std::string::npos) << graphed.status;
  }
}

// A capture takes the blocks an eager step left in the cache instead of asking the driver
// for a second copy of the step's memory; while the graph lives those blocks serve only its
// replays (eager work gets fresh memory), and once it is destroyed they serve eager work again.
TEST(CudaGraphs, CaptureReusesTheCachedBlocksOfTheEagerStep) {
  TESSERA_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  GraphBackend& backend = *graph_backend(DeviceType::CUDA);
  const Tensor x = cuda_test::to_gpu(cuda_test::host_randn({1000, 257}, DType::f32));
  auto step = [&] { return ops::mul(ops::add(x, 1.0), x); };  // two blocks of x's size
  cuda::synchronize();
  cuda::empty_cache();  // what earlier tests left cached would hide the driver calls
  const std::vector<uint32_t> want = bits_of(step());  // its blocks go back to the cache
  const size_t reserved_before = cuda::memory_stats(0).reserved_bytes;

  backend.begin_capture(gpu);
  Tensor recorded = step();
  std::unique_ptr<DeviceGraph> graph = backend.end_capture(gpu);
  EXPECT_EQ(cuda::memory_stats(0).reserved_bytes, reserved_before)
      << "the capture asked the driver for memory although the eager step's blocks were cached";
  graph->replay();
  EXPECT_EQ(bits_of(recorded), want);

  {
    // The graph's blocks are not handed to eager work: this step needs new memory, and
    // writing its result leaves what the next replay computes unchanged.
    Tensor eager = step();
    EXPECT_GT(cuda::memory_stats(0).reserved_bytes, reserved_before);
    raw::fill_(eager, -1.0);
    graph->replay();
    EXPECT_EQ(bits_of(recorded), want);
  }
  cuda::synchronize();
  cuda::empty_cache();  // drops the eager step's blocks; the graph's stay reserved
  recorded = Tensor();
  graph.reset();
  const size_t reserved_after = cuda::memory_stats(0).reserved_bytes;
  EXPECT_GE(reserved_after, reserved_before);
  const Tensor after = step();  // served by the released graph blocks: no new driver memory
  EXPECT_EQ(cuda::memory_stats(0).reserved_bytes, reserved_after);
  EXPECT_EQ(bits_of(after), want);
}

// A recorded step's small memsets and device-to-device copies replay as kernel nodes with
// the same dependencies (core/cuda/graph_copy_nodes.h); large ones stay copy-engine nodes.
// Results equal the eager step's and those of a graph recorded without the rewrite.
TEST(CudaGraphs, SmallCopiesAndMemsetsReplayAsKernels) {
  TESSERA_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  GraphBackend& backend = *graph_backend(DeviceType::CUDA);
  const Tensor x = cuda_test::to_gpu(cuda_test::host_randn({1000, 257}, DType::f32));
  const TensorOptions f32{.dtype = DType::f32, .device = gpu};
  // Outputs written by the step (poisoned before each replay).
  Tensor row = empty({257}, f32), ones_bits = empty({3, 100}, f32), big = empty({1000, 300}, f32);
  Tensor out;
  auto step = [&] {
    const Tensor y = ops::add(x, 1.0);
    raw::copy_(row, y.select(0, 3));  // 1,028 contiguous bytes: a memcpy node
    // Bytes of 0x3f in a 2-D memset of 3 rows of 400 bytes: a memset node.
    TESSERA_CUDA_CHECK(
        cudaMemset2DAsync(ones_bits.raw_data(), 400, 0x3f, 400, 3, cuda::current_stream(0)));
    // 1.2 MB: stays on the copy engine.
    TESSERA_CUDA_CHECK(cudaMemsetAsync(big.raw_data(), 0, big.nbytes(), cuda::current_stream(0)));
    out = ops::add(ops::mul(row, ones_bits.select(0, 2).narrow(0, 0, 1)), 2.0);
  };
  step();
  cuda::synchronize();
  const std::vector<uint32_t> want_row = bits_of(row), want_ones = bits_of(ones_bits),
                              want_out = bits_of(out);
  for (const bool rewrite : {true, false}) {
    SCOPED_TRACE(rewrite ? "rewritten" : "TESSERA_GRAPH_COPY_KERNELS=0");
    if (!rewrite) setenv("TESSERA_GRAPH_COPY_KERNELS", "0", 1);
    const int64_t before = cuda::graph_copy_nodes_rewritten();
    backend.begin_capture(gpu);
    step();
    std::unique_ptr<DeviceGraph> graph = backend.end_capture(gpu);
    unsetenv("TESSERA_GRAPH_COPY_KERNELS");
    // The copy and the memset; not the 1.2 MB memset.
    EXPECT_EQ(cuda::graph_copy_nodes_rewritten() - before, rewrite ? 2 : 0);
    for (int replay = 0; replay < 2; ++replay) {
      for (const Tensor* t : {&row, &ones_bits, &big, &out}) raw::fill_(*t, -7.0);
      graph->replay();
      EXPECT_EQ(bits_of(row), want_row);
      EXPECT_EQ(bits_of(ones_bits), want_ones);
      EXPECT_EQ(bits_of(out), want_out);
      EXPECT_EQ(bits_of(big), std::vector<uint32_t>(big.numel(), 0u));
    }
  }
}
