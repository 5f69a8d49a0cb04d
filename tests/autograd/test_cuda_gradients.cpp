// The differentiable functions on a CUDA device give the CPU's gradients (skips without
// a GPU). The backward closures are device-agnostic; this checks the pieces that are not
// (zeros materialised on the device, scalars as device tensors, cross-device to()).
#include "gradcheck.h"

namespace tessera {
namespace {

using Xs = std::vector<Tensor>;

struct Case {
  const char* name;
  std::function<Tensor(const Xs&)> fn;
  std::vector<Shape> shapes;  // of the float inputs, all requiring grad
};

Tensor weights_like(const Tensor& t) {
  Generator gen(99);
  return randn(t.shape(), {.dtype = DType::f32}, &gen);
}

// Gradients of Σ fn(x)·w w.r.t. inputs created on `device` from the same values.
std::vector<Tensor> gradients_on(Device device, const Case& c, const Xs& values) {
  Xs inputs;
  for (const Tensor& v : values) inputs.push_back(testing::leaf(v.to(device)));
  Tensor out = c.fn(inputs);
  EXPECT_EQ(out.device(), device) << c.name;
  sum(out * weights_like(out).to(device)).backward();
  std::vector<Tensor> grads;
  for (const Tensor& in : inputs) {
    EXPECT_EQ(in.grad().device(), device) << c.name;
    grads.push_back(in.grad().cpu());
  }
  return grads;
}

TEST(CudaGradients, MatchTheCpu) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const Tensor ids = from_vector<int64_t>({3, 0, 3, 6, 1, -100}, {2, 3}, {.dtype = DType::i64});
  const Tensor ids_cpu = from_vector<int64_t>({3, 0, 3, 6, 1, 2}, {2, 3}, {.dtype = DType::i64});
  auto on = [](const Tensor& t, const Tensor& like) { return t.to(like.device()); };
  const std::vector<Case> cases = {
      {"arithmetic", [](const Xs& x) { return (x[0] + x[1]) * x[0] / (x[1] * x[1] + 1.0) - 2.0 / (x[0] * x[0] + 1.0); }, {{3, 7}, {7}}},
      {"unary", [](const Xs& x) { return exp(tanh(x[0])) + sigmoid(x[0]) * relu(x[0]) + gelu(x[0]) + abs(x[0]) + sqrt(square(x[0]) + 1.0); }, {{5, 33}}},
      {"reductions", [](const Xs& x) { return sum(x[0], {1}, true) + mean(x[0], {0}) + amax(x[0], {1}, true) - amin(x[0]); }, {{7, 5}}},
      {"softmax", [](const Xs& x) { return softmax(x[0], -1) + log_softmax(x[0].transpose(0, 1), 0).transpose(0, 1); }, {{3, 33}}},
      {"layer_norm", [](const Xs& x) { return layer_norm(x[0], x[1], x[2], 1e-5); }, {{2, 3, 33}, {33}, {33}}},
      {"linear_matmul", [](const Xs& x) { return matmul(linear(x[0], x[1], x[2]), x[1].t()); }, {{2, 3, 7}, {7, 5}, {5}}},
      {"embedding", [ids_cpu, on](const Xs& x) { return embedding(x[0], on(ids_cpu, x[0])); }, {{7, 5}}},
      {"cross_entropy", [ids, on](const Xs& x) { return cross_entropy(x[0], on(ids, x[0])) * 1.0; }, {{2, 3, 7}}},
      {"cross_entropy_none", [ids, on](const Xs& x) { return cross_entropy(x[0], on(ids, x[0]), -100, Reduction::None); }, {{2, 3, 7}}},
      {"cat_split", [](const Xs& x) { auto p = split(cat({x[0], x[1]}, 1), 4, 1); return p[0] * p[1] + sum(stack({x[0], x[0]}, 0), {0}); }, {{3, 4}, {3, 4}}},
      {"views", [](const Xs& x) { return x[0].permute({1, 0}).reshape({35}).narrow(0, 3, 7).unsqueeze(0).expand({2, 7}).contiguous(); }, {{7, 5}}},
      {"where_mask", [](const Xs& x) { Tensor m = ops::binary(BinaryOp::Gt, x[0], 0.0); return where(m, x[0], x[1]) + masked_fill(x[1], m, 2.0); }, {{3, 7}, {3, 7}}},
      {"maximum_pow", [](const Xs& x) { return maximum(x[0], x[1]) + pow(square(x[0]) + 1.0, x[1]) + pow(abs(x[1]) + 1.0, 1.5); }, {{3, 7}, {7}}},
      {"dropout", [](const Xs& x) { Generator g(3); return dropout(x[0], 0.5, true, &g); }, {{5, 7}}},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Xs values;
    for (const Shape& s : c.shapes) {
      Generator gen(seed++);
      values.push_back(randn(s, {.dtype = DType::f32}, &gen));
    }
    std::vector<Tensor> cpu = gradients_on(Device::cpu(), c, values);
    std::vector<Tensor> gpu = gradients_on(Device::cuda(), c, values);
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_LT(ops::max_rel_error(gpu[i], cpu[i]), 1e-4) << "input " << i;
  }
}

TEST(CudaGradients, AcrossDevices) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  Tensor x = testing::leaf(testing::random_f64({3, 5}, 7).to(DType::f32));
  Tensor y = square(x.to(Device::cuda())).to(Device::cpu());
  sum(y).backward();
  ASSERT_TRUE(x.grad().device().is_cpu());
  EXPECT_LT(ops::max_rel_error(x.grad(), x.detach() * 2.0), 1e-6);
}

}  // namespace
}  // namespace tessera
