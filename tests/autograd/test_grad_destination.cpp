// Gradient destinations (autograd::set_grad_destination): a leaf's first gradient written
// straight into memory given in advance (a DDP bucket's slot) by the weight GEMMs of linear and
// matmul, or copied there; every result equals the run without a destination bit for bit, and
// hooks, a defined .grad, retain_graph and checkpointing behave as without one.
#include <cstring>
#include <functional>

#include "gradcheck.h"

namespace tessera {
namespace {

using autograd::grad_destination_counts;
using autograd::set_grad_destination;
using testing::error_of;

Tensor random_f32(const Shape& shape, uint64_t seed, Device device = Device::cpu()) {
  Generator gen(seed);
  return ops::to(randn(shape, {}, &gen), device, DType::f32);
}

Tensor leaf_from(const Tensor& values) {
  Tensor t = ops::clone(values);
  t.requires_grad_(true);
  return t;
}

// The bytes of t (contiguous, on the host): equal bytes are equal values bit for bit.
std::vector<unsigned char> bytes_of(const Tensor& t) {
  const Tensor host = ops::contiguous(ops::to(t, Device::cpu(), t.dtype()));
  std::vector<unsigned char> out(host.nbytes());
  std::memcpy(out.data(), host.raw_data(), out.size());
  return out;
}

// A flat buffer of garbage (random values, never zeros: an overwrite must not rely on them)
// with one contiguous view per shape, back to back, as FlatBuckets lays its slots out.
struct Bucket {
  Tensor flat;
  std::vector<Tensor> slots;
  Bucket(const std::vector<Tensor>& like, uint64_t seed) {
    int64_t total = 0;
    for (const Tensor& t : like) total += t.numel();
    flat = ops::to(random_f32({total + 3}, seed), like.front().device(), like.front().dtype());
    int64_t at = 1;  // not at the start of the storage
    for (const Tensor& t : like) {
      slots.push_back(ops::view(ops::narrow(flat, 0, at, t.numel()), t.shape()));
      at += t.numel();
    }
  }
};

using LossFn = std::function<Tensor(const std::vector<Tensor>& leaves)>;

// Runs loss_fn on fresh leaves with `values`, with each leaf's destination a slot of a garbage
// bucket when `with_destinations`; returns the leaves (with their .grad). `backwards` > 1 runs
// that many backwards through one retained graph.
struct Trained {
  std::vector<Tensor> leaves;
  std::unique_ptr<Bucket> bucket;
};
Trained run(const LossFn& loss_fn, const std::vector<Tensor>& values, bool with_destinations,
            int backwards = 1) {
  Trained r;
  for (const Tensor& v : values) r.leaves.push_back(leaf_from(v));
  if (with_destinations) {
    r.bucket = std::make_unique<Bucket>(values, 99);
    for (size_t i = 0; i < values.size(); ++i)
      set_grad_destination(r.leaves[i], r.bucket->slots[i]);
  }
  Tensor loss = loss_fn(r.leaves);
  for (int k = 0; k < backwards; ++k) loss.backward(Tensor(), /*retain_graph=*/k + 1 < backwards);
  return r;
}

// Both runs' gradients are equal bit for bit, and the one with destinations has each .grad in
// its slot's memory.
void expect_gradients_in_slots_and_equal(const Trained& plain, const Trained& with) {
  ASSERT_EQ(plain.leaves.size(), with.leaves.size());
  for (size_t i = 0; i < plain.leaves.size(); ++i) {
    SCOPED_TRACE("leaf " + std::to_string(i));
    ASSERT_TRUE(with.leaves[i].grad().defined());
    EXPECT_EQ(with.leaves[i].grad().raw_data(), with.bucket->slots[i].raw_data());
    EXPECT_EQ(bytes_of(with.leaves[i].grad()), bytes_of(plain.leaves[i].grad()));
  }
}

// A projection of every element of y with fixed random weights, so each matters differently.
Tensor project(const Tensor& y, uint64_t seed) {
  return sum(y * random_f32(y.shape(), seed, y.device()));
}

TEST(GradDestination, LinearWritesWeightAndBiasIntoTheirSlots) {
  // A non-contiguous input (a transpose), odd sizes, leading batch dims folded into rows.
  const Tensor x = ops::transpose(random_f32({2, 7, 3}, 1), 1, 2);  // [2, 3, 7]
  const LossFn loss = [&](const std::vector<Tensor>& p) {
    return project(linear(x, p[0], p[1]), 2);
  };
  const std::vector<Tensor> values = {random_f32({7, 5}, 3), random_f32({5}, 4)};
  const auto before = grad_destination_counts();
  Trained with = run(loss, values, true);
  const auto after = grad_destination_counts();
  expect_gradients_in_slots_and_equal(run(loss, values, false), with);
  // Both were written there by the backward: nothing was copied in.
  EXPECT_EQ(after.written - before.written, 2);
  EXPECT_EQ(after.copied - before.copied, 0);
}

TEST(GradDestination, MatmulWeightsAndATorchLayoutWeightSeenTransposed) {
  const Tensor x = random_f32({3, 4, 6}, 5), h = random_f32({5, 6}, 6);
  // w [6, 2] as a batched matmul's matrix; v [9, 6] used as v.t() (a tied output head);
  // u [2, 6] through linear(x, u.t()) (nn's torch-layout linear).
  const LossFn loss = [&](const std::vector<Tensor>& p) {
    return project(matmul(x, p[0]), 7) + project(matmul(h, p[1].t()), 8) +
           project(linear(x, p[2].t()), 9);
  };
  const std::vector<Tensor> values = {random_f32({6, 2}, 10), random_f32({9, 6}, 11),
                                      random_f32({2, 6}, 12)};
  const auto before = grad_destination_counts();
  Trained with = run(loss, values, true);
  EXPECT_EQ(grad_destination_counts().written - before.written, 3);
  EXPECT_EQ(grad_destination_counts().copied - before.copied, 0);
  expect_gradients_in_slots_and_equal(run(loss, values, false), with);
}

TEST(GradDestination, ATiedWeightGetsTheSumOfItsUses) {
  // As GPT-2's wte: an embedding lookup and the output head (x @ W.t()), plus a plain linear
  // and a matmul on the same weight, and a weight used twice by one op (matmul(s, s)).
  const Tensor idx = from_vector(std::vector<int64_t>{3, 0, 3, 8, 5}, {5}, {.dtype = DType::i64});
  const Tensor x = random_f32({5, 6}, 20), z = random_f32({4, 9}, 21);
  const LossFn loss = [&](const std::vector<Tensor>& p) {
    const Tensor& w = p[0];
    Tensor out = project(matmul(x, w.t()), 22);
    out = out + project(embedding(w, idx), 23);
    out = out + project(linear(z, w), 24) + project(matmul(z, w), 25);
    return out + project(matmul(p[1], p[1]), 26);
  };
  const std::vector<Tensor> values = {random_f32({9, 6}, 27), random_f32({4, 4}, 28)};
  expect_gradients_in_slots_and_equal(run(loss, values, false), run(loss, values, true));
}

TEST(GradDestination, HooksADefinedGradAndRetainGraphBehaveAsWithout) {
  const Tensor x = random_f32({4, 3}, 30);
  const std::vector<Tensor> values = {random_f32({3, 5}, 31), random_f32({5}, 32)};
  const LossFn plain_loss = [&](const std::vector<Tensor>& p) {
    return project(linear(x, p[0], p[1]), 33);
  };
  // A hook that returns another tensor: the gradient is computed as before, then copied.
  const LossFn hooked_loss = [&](const std::vector<Tensor>& p) {
    autograd::register_hook(p[0], [](const Tensor& g) { return ops::mul(g, 3.0); });
    return plain_loss(p);
  };
  const auto before = grad_destination_counts();
  Trained hooked = run(hooked_loss, values, true);
  EXPECT_EQ(grad_destination_counts().copied - before.copied, 1);  // the hooked weight
  expect_gradients_in_slots_and_equal(run(hooked_loss, values, false), hooked);

  // retain_graph: the second backward adds into the .grad the first wrote into the slot.
  expect_gradients_in_slots_and_equal(run(plain_loss, values, false, 2),
                                      run(plain_loss, values, true, 2));

  // A .grad defined before backward (no_sync accumulation) is added into where it is.
  for (bool with : {false, true}) {
    Trained r;
    for (const Tensor& v : values) r.leaves.push_back(leaf_from(v));
    const Tensor earlier = random_f32({3, 5}, 34);
    r.leaves[0].set_grad(ops::clone(earlier));
    const void* memory = r.leaves[0].grad().raw_data();
    Bucket bucket(values, 35);
    if (with) set_grad_destination(r.leaves[0], bucket.slots[0]);
    plain_loss(r.leaves).backward();
    EXPECT_EQ(r.leaves[0].grad().raw_data(), memory);
    Trained reference = run(plain_loss, values, false);
    EXPECT_EQ(bytes_of(r.leaves[0].grad()),
              bytes_of(ops::add(earlier, reference.leaves[0].grad())));
  }
}

TEST(GradDestination, ZeroGradToNoneThenTheNextBackwardOverwritesTheSameMemory) {
  const Tensor x = random_f32({6, 4}, 40);
  const LossFn loss = [&](const std::vector<Tensor>& p) {
    return project(linear(x, p[0], p[1]), 41);
  };
  const std::vector<Tensor> values = {random_f32({4, 3}, 42), random_f32({3}, 43)};
  Trained with = run(loss, values, true);
  autograd::zero_grad(with.leaves, /*set_to_none=*/true);
  EXPECT_FALSE(with.leaves[0].grad().defined());
  loss(with.leaves).backward();  // not added to the first step's values still in the slots
  expect_gradients_in_slots_and_equal(run(loss, values, false), with);
}

TEST(GradDestination, ALeafUsedInsideAndOutsideACheckpointSumsAllParts) {
  const Tensor x = random_f32({5, 4}, 50);
  const LossFn loss = [&](const std::vector<Tensor>& p) {
    const Tensor& w = p[0];
    const Tensor before = linear(x, w);  // runs last in backward
    const Tensor inner = autograd::checkpoint(
        [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{tanh(linear(in[0], w))}; },
        {x})[0];
    const Tensor after = linear(x, w);  // runs first: its part goes into the destination
    // The checkpoint's nested backward then reaches w while the outer backward still holds a
    // part there, and `before` adds the last part.
    return project(before, 51) + project(inner, 52) + project(after, 53);
  };
  const std::vector<Tensor> values = {random_f32({4, 4}, 54)};
  Trained plain = run(loss, values, false), with = run(loss, values, true);
  ASSERT_EQ(with.leaves[0].grad().raw_data(), with.bucket->slots[0].raw_data());
  // Three parts summed in another order than without destinations: equal to rounding.
  const std::vector<float> got = ops::contiguous(with.leaves[0].grad()).to_vector<float>();
  const std::vector<float> want = ops::contiguous(plain.leaves[0].grad()).to_vector<float>();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i])));
}

TEST(GradDestination, OneTensorReturnedForTwoInputsCountsTwice) {
  // y + y: the add's backward returns one tensor for both inputs, which must be summed (the
  // engine adds into a buffer in place only where it offered that buffer to the backward).
  const Tensor r = random_f32({3, 4}, 80);
  for (bool with : {false, true}) {
    Tensor w = leaf_from(random_f32({3, 4}, 81));
    Bucket bucket({w}, 82);
    if (with) set_grad_destination(w, bucket.slots[0]);
    const Tensor y = w * 3.0;
    sum((y + y) * r).backward();
    const std::vector<float> got = ops::contiguous(w.grad()).to_vector<float>();
    const std::vector<float> rv = r.to_vector<float>();
    for (size_t i = 0; i < rv.size(); ++i) EXPECT_FLOAT_EQ(got[i], 6 * rv[i]) << i;
  }
}

TEST(GradDestination, AWrongDestinationIsRefusedNamingWhatDiffers) {
  Tensor w = leaf_from(random_f32({3, 4}, 60));
  const std::string shape = error_of([&] { set_grad_destination(w, zeros({4, 3})); });
  EXPECT_NE(shape.find("shape [4, 3]"), std::string::npos) << shape;
  EXPECT_NE(shape.find("shape [3, 4]"), std::string::npos) << shape;
  const std::string dtype = error_of([&] {
    set_grad_destination(w, zeros({3, 4}, {.dtype = DType::f64}));
  });
  EXPECT_NE(dtype.find("float64"), std::string::npos) << dtype;
  EXPECT_NE(dtype.find("float32"), std::string::npos) << dtype;
  const std::string strided = error_of([&] {
    set_grad_destination(w, ops::transpose(zeros({4, 3}), 0, 1));
  });
  EXPECT_NE(strided.find("contiguous"), std::string::npos) << strided;
  const Tensor non_leaf = w * 2.0;
  EXPECT_NE(error_of([&] {
              set_grad_destination(non_leaf, zeros({3, 4}));
            }).find("leaf"),
            std::string::npos);
  // Cleared by an undefined tensor: the gradient gets memory of its own again.
  Tensor slot = zeros({3, 4});
  set_grad_destination(w, slot);
  set_grad_destination(w, Tensor());
  EXPECT_FALSE(autograd::grad_destination(w).defined());
  sum(w * w).backward();
  EXPECT_NE(w.grad().raw_data(), slot.raw_data());
}

TEST(GradDestinationCuda, FusedLinearAndHeadGemmsWriteIntoTheSlots) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const Device gpu = Device::cuda(0);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = ops::to(random_f32({2, 5, 16}, 70), gpu, dtype);
    const LossFn loss = [&](const std::vector<Tensor>& p) {
      return project(linear(x, p[0], p[1]).to(DType::f32), 71) +
             project(matmul(x, p[2].t()).to(DType::f32), 72);
    };
    const std::vector<Tensor> values = {ops::to(random_f32({16, 24}, 73), gpu, dtype),
                                        ops::to(random_f32({24}, 74), gpu, dtype),
                                        ops::to(random_f32({40, 16}, 75), gpu, dtype)};
    const auto before = grad_destination_counts();
    Trained with = run(loss, values, true);
    EXPECT_EQ(grad_destination_counts().written - before.written, 3);
    expect_gradients_in_slots_and_equal(run(loss, values, false), with);
  }
}

}  // namespace
}  // namespace tessera
