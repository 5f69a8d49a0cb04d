// Activation checkpointing: the gradients equal a plain run's bit for bit, also with
// dropout drawing from the default generator inside the checkpointed function.
#include <cstring>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::leaf;

// A float32 leaf of N(0, scale²) values.
Tensor param(const Shape& shape, uint64_t seed, double scale = 0.5) {
  Generator gen(seed);
  return leaf(normal(shape, 0.0, scale, {.dtype = DType::f32}, &gen));
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;
}

struct Block {
  Tensor w1 = param({7, 33}, 1), b1 = param({33}, 2), w2 = param({33, 7}, 3), b2 = param({7}, 4);
  int calls = 0;
  std::vector<bool> grad_mode_at_call;
  // A transformer-MLP-like block with dropout from the default generator.
  std::vector<Tensor> operator()(const std::vector<Tensor>& in) {
    ++calls;
    grad_mode_at_call.push_back(autograd::is_grad_enabled());
    Tensor h = dropout(gelu(linear(in[0], w1, b1)), 0.25, /*training=*/true);
    return {in[0] + linear(h, w2, b2), h};
  }
  std::vector<Tensor> params() const { return {w1, b1, w2, b2}; }
};

Tensor loss_of(const std::vector<Tensor>& outs) { return sum(square(outs[0])) + mean(outs[1]); }

TEST(Checkpoint, GradientsEqualThePlainRunBitForBit) {
  Block block;
  Tensor x = param({3, 5, 7}, 5, 1.0);

  manual_seed(42);
  loss_of(block({x})).backward();
  std::vector<Tensor> plain;
  for (const Tensor& p : block.params()) plain.push_back(p.grad());
  Tensor plain_x = x.grad();
  const uint64_t offset_after_plain = default_generator().offset();
  autograd::zero_grad(block.params());
  autograd::zero_grad({x});

  manual_seed(42);
  block.calls = 0;
  block.grad_mode_at_call.clear();
  std::vector<Tensor> outs = autograd::checkpoint(std::ref(block), {x});
  EXPECT_EQ(block.calls, 1);
  EXPECT_TRUE(outs[0].requires_grad());
  EXPECT_EQ(outs[0].impl().autograd->grad_fn->name, "CheckpointBackward");
  Tensor loss = loss_of(outs);
  // Other random draws between forward and backward must not change the recompute.
  (void)rand({100});
  const uint64_t offset_before_backward = default_generator().offset();
  loss.backward();

  EXPECT_EQ(block.calls, 2) << "recomputed once in backward";
  EXPECT_EQ(block.grad_mode_at_call, (std::vector<bool>{false, true}))
      << "the first run saves nothing (grad mode off); the recompute records";
  EXPECT_EQ(default_generator().offset(), offset_before_backward) << "generator restored";
  EXPECT_GT(offset_after_plain, 0u);
  std::vector<Tensor> params = block.params();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i].grad(), plain[i])) << i;
  EXPECT_TRUE(bitwise_equal(x.grad(), plain_x));
}

TEST(Checkpoint, DropoutMaskMattersSoTheRestoreIsTested) {
  // Without restoring the generator the recompute would draw another mask: check the
  // gradients of two different seeds differ, so equality above is meaningful.
  Block block;
  Tensor x = param({3, 5, 7}, 6, 1.0);
  manual_seed(1);
  loss_of(block({x})).backward();
  Tensor first = block.w1.grad();
  autograd::zero_grad(block.params());
  manual_seed(2);
  loss_of(block({x})).backward();
  EXPECT_FALSE(bitwise_equal(first, block.w1.grad()));
}

TEST(Checkpoint, GradReadyHooksFireForParametersInside) {
  Block block;
  Tensor x = param({2, 7}, 7, 1.0);
  std::vector<std::string> ready;
  std::vector<autograd::HookHandle> handles;
  const char* names[] = {"w1", "b1", "w2", "b2"};
  std::vector<Tensor> params = block.params();
  for (size_t i = 0; i < params.size(); ++i) {
    handles.push_back(autograd::register_grad_ready_hook(params[i], [&ready, name = names[i]](const Tensor& p) {
      ASSERT_TRUE(p.grad().defined());
      ready.push_back(name);
    }));
  }
  loss_of(autograd::checkpoint(std::ref(block), {x})).backward();
  ASSERT_EQ(ready.size(), 4u);
  EXPECT_TRUE(std::find(ready.begin(), ready.end(), "w2") < std::find(ready.begin(), ready.end(), "w1"));
  for (auto& h : handles) h.remove();
}

TEST(Checkpoint, FiniteDifferences) {
  // Gradients through a checkpoint (inputs and captured weights) in float64.
  Tensor w = leaf(testing::random_f64({5, 3}, 8));
  auto fn = [w](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{tanh(matmul(in[0], w)) * in[1]};
  };
  Tensor a = leaf(testing::random_f64({4, 5}, 9)), b = leaf(testing::random_f64({3}, 10));
  EXPECT_TRUE(testing::gradcheck(testing::MultiFn([&](const std::vector<Tensor>& v) {
    return autograd::checkpoint(fn, {v[0], v[1]});
  }), {a, b, w}));
}

TEST(Checkpoint, WithoutGradModeJustRuns) {
  Block block;
  Tensor x = param({2, 7}, 11, 1.0);
  NoGradGuard guard;
  std::vector<Tensor> outs = autograd::checkpoint(std::ref(block), {x});
  EXPECT_FALSE(outs[0].requires_grad());
  EXPECT_EQ(block.calls, 1);
}

}  // namespace
}  // namespace tessera
