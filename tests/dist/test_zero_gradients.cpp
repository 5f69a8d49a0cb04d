// In-process tests of ZeRO-2/3's gradient lifetime (dist/zero.h): a bucket's full gradient
// buffer lives from its first gradient until its own reduce-scatter is done, at most
// max_buckets_in_flight of them at once, and gradient accumulation in both of its semantics
// (reduce_every_micro_batch: no full gradient between micro-steps; no_sync: the full local
// gradient until the syncing micro-step). One rank: every average is the gradient itself,
// so the shard must hold exactly what a plain backward computes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include <nlohmann/json.hpp>
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"

#include "tessera/dist/accelerator.h"
#include "tessera/dist/deepspeed_config.h"
#include "tessera/dist/process_group.h"
#include "tessera/dist/zero.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"

using namespace tessera;
using namespace tessera::dist;

namespace {

constexpr int kLayers = 6, kWidth = 8;

// kLayers linear layers; with bucket_bytes below one layer's bytes, each is a bucket.
// The layers form a ModuleList, so stage 3 makes each of them a unit.
struct Stack : nn::Module {
  nn::ModuleList layers;
  explicit Stack(uint64_t seed) {
    default_generator().manual_seed(seed);
    for (int k = 0; k < kLayers; ++k)
      layers.push_back(std::make_unique<nn::Linear>(kWidth, kWidth, true, 0.5));
    register_module("layers", layers);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x;
    for (size_t k = 0; k < layers.size(); ++k) h = tanh(layers[k](h));
    return h;
  }
};

struct OneRank : ::testing::Test {
  void SetUp() override {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) unsetenv(v);
    init_process_group();
  }
  void TearDown() override { destroy_process_group(); }
};

Tensor batch(uint64_t seed) {
  Generator g(seed);
  return randn({4, kWidth}, {}, &g);
}

Tensor loss_of(nn::Module& m, const Tensor& x) {
  const Tensor y = m(x);
  return sum(y * y);
}

// Records, at every gradient that becomes final, how many full bucket buffers are held.
struct HeldBuffers {
  size_t most = 0;
  std::vector<autograd::HookHandle> hooks;
  explicit HeldBuffers(const ZeroStrategy& zero) {
    for (const Tensor& p : zero.buckets().parameters())
      hooks.push_back(autograd::register_grad_ready_hook(
          p, [this, &zero](const Tensor&) { most = std::max(most, held(zero)); }));
  }
  ~HeldBuffers() {
    for (auto& h : hooks) h.remove();
  }
  static size_t held(const ZeroStrategy& zero) {
    const auto& buckets = zero.buckets().buckets();
    return std::count_if(buckets.begin(), buckets.end(),
                         [](const auto& b) { return b.gradients.defined(); });
  }
};

// This rank's gradient slices (one rank: whole parameters) in the strategy's piece order,
// next to the plain model's gradients in the same order.
void expect_shard_equals_plain(const ZeroStrategy& zero, nn::Module& plain) {
  const auto plain_params = plain.parameters();
  size_t piece = 0;
  for (const auto& bucket : zero.buckets().buckets())
    for (size_t k : bucket.params) {
      const Tensor got = zero.pieces().at(piece++).grad();
      ASSERT_TRUE(got.defined()) << zero.buckets().parameter_names()[k];
      EXPECT_EQ(got.to_vector<float>(),
                ops::contiguous(plain_params.at(k).grad()).to_vector<float>())
          << zero.buckets().parameter_names()[k];
    }
}

struct Models {
  Stack plain{21}, sharded{21};
};

ZeroOptions small_buckets(int stage, size_t in_flight) {
  ZeroOptions o;
  o.stage = stage;
  o.bucket_bytes = 64;  // below one layer (8x8 + 8 floats): a bucket per weight and bias
  o.max_buckets_in_flight = in_flight;
  return o;
}

TEST_F(OneRank, Stage2And3HoldAtMostTheBucketsInFlightDuringBackward) {
  for (int stage : {2, 3}) {
    for (size_t in_flight : {size_t(1), size_t(2), size_t(0)}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", in flight " + std::to_string(in_flight));
      Models m;
      ZeroStrategy zero(m.sharded, nullptr, small_buckets(stage, in_flight));
      optim::AdamW opt(m.sharded.parameters());
      zero.prepare_optimizer(opt);
      ASSERT_GE(zero.buckets().buckets().size(), size_t(kLayers));
      HeldBuffers held(zero);
      const Tensor x = batch(5);
      loss_of(m.plain, x).backward();
      loss_of(m.sharded, x).backward();
      zero.finish_gradient_sync();
      // 0: no bound, every bucket is held until the end of backward (the old lifetime).
      if (in_flight == 0)
        EXPECT_EQ(held.most, zero.buckets().buckets().size());
      else
        EXPECT_LE(held.most, in_flight);
      EXPECT_GE(held.most, 1u);
      EXPECT_EQ(HeldBuffers::held(zero), 0u) << "a full buffer outlived the sync";
      for (const Tensor& p : m.sharded.parameters())
        EXPECT_FALSE(p.grad().defined()) << ".grad keeps a released buffer alive";
      expect_shard_equals_plain(zero, m.plain);
    }
  }
}

// Three micro-batches, the first two inside no_sync. reduce_every_micro_batch reduces each
// as backward produces it, so no full buffer is left between micro-steps; no_sync keeps
// them all until the syncing one. On one rank both sum the same gradients in the same order
// as a plain backward does (g1 + g2, then + g3), so the shard equals it exactly.
TEST_F(OneRank, AccumulationReducesEveryMicroBatchOrKeepsTheFullGradientUnderNoSync) {
  for (int stage : {2, 3}) {
    for (GradientAccumulation accumulation :
         {GradientAccumulation::reduce_every_micro_batch, GradientAccumulation::no_sync}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", " +
                   gradient_accumulation_name(accumulation));
      Models m;
      ZeroOptions o = small_buckets(stage, 2);
      o.accumulation = accumulation;
      ZeroStrategy zero(m.sharded, nullptr, o);
      optim::AdamW opt(m.sharded.parameters());
      zero.prepare_optimizer(opt);
      const size_t buckets = zero.buckets().buckets().size();
      EXPECT_EQ(zero.reduces_every_micro_batch(),
                accumulation == GradientAccumulation::reduce_every_micro_batch);
      for (uint64_t micro = 0; micro < 3; ++micro) {
        const Tensor x = batch(40 + micro);
        loss_of(m.plain, x).backward();
        const bool sync = micro == 2;
        {
          std::optional<DataParallelStrategy::NoSyncGuard> guard;
          if (!sync) guard.emplace(zero.no_sync());
          EXPECT_EQ(zero.gradient_sync(), sync);
          loss_of(m.sharded, x).backward();
          zero.finish_gradient_sync();  // Accelerator::backward calls it on every micro-step
        }
        const size_t expected_held =
            sync || accumulation == GradientAccumulation::reduce_every_micro_batch ? 0 : buckets;
        EXPECT_EQ(HeldBuffers::held(zero), expected_held) << "after micro-step " << micro;
      }
      expect_shard_equals_plain(zero, m.plain);
      // The next optimizer step starts from its own first micro-batch, not from these sums.
      opt.zero_grad();
      m.plain.zero_grad(true);
      const Tensor x = batch(99);
      loss_of(m.plain, x).backward();
      loss_of(m.sharded, x).backward();
      zero.finish_gradient_sync();
      expect_shard_equals_plain(zero, m.plain);
    }
  }
}

TEST(ZeroOptionsTest, AccumulationNamesAreCheckedNamingTheValue) {
  EXPECT_EQ(gradient_accumulation_from_name("no_sync"), GradientAccumulation::no_sync);
  EXPECT_EQ(gradient_accumulation_from_name("reduce_every_micro_batch"),
            GradientAccumulation::reduce_every_micro_batch);
  try {
    gradient_accumulation_from_name("sometimes");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'sometimes'"), std::string::npos) << e.what();
  }
}

// DeepSpeed's overlap_comm is the number of buckets in flight: true double-buffers (2),
// false reduces each bucket before the next one's first gradient (1).
TEST(ZeroOptionsTest, OverlapCommSetsTheBucketsInFlight) {
  auto applied = [](bool overlap, size_t given) {
    AcceleratorOptions o;
    o.max_buckets_in_flight = given;
    DeepSpeedConfig::from_json(nlohmann::json{{"zero_optimization", {{"overlap_comm", overlap}}}},
                               "ds.json")
        .apply_to(o);
    return o.max_buckets_in_flight;
  };
  EXPECT_EQ(applied(false, 2), 1u);
  EXPECT_EQ(applied(true, 2), 2u);
  EXPECT_EQ(applied(false, 1), 1u);
  try {
    applied(true, 1);
    ADD_FAILURE() << "a contradiction was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.overlap_comm"), std::string::npos)
        << e.what();
  }
}

}  // namespace
