// The tape itself: accumulation, retain_graph, grad mode, detach, hooks, in-place
// rules, version counters, dtypes of gradients, error messages.
#include <map>
#include <string>
#include <thread>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::leaf;
using testing::random_f64;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<double> values(const Tensor& t) { return t.contiguous().to(DType::f64).to_vector<double>(); }

// Runs f and returns the message of the tessera::Error it must throw.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a tessera::Error";
  return "";
}

TEST(Engine, ScalarBackwardFillsLeafGrads) {
  Tensor x = leaf(random_f64({3, 7}, 1));
  Tensor w = leaf(random_f64({7}, 2));
  Tensor loss = sum(x * w);
  EXPECT_FALSE(loss.is_leaf());
  EXPECT_TRUE(loss.requires_grad());
  loss.backward();
  // d/dx Σ x·w = w on every row; d/dw = column sums of x.
  std::vector<double> xv = values(x), wv = values(w), gx = values(x.grad()), gw = values(w.grad());
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 7; ++c) EXPECT_DOUBLE_EQ(gx[r * 7 + c], wv[c]);
  for (int c = 0; c < 7; ++c) EXPECT_NEAR(gw[c], xv[c] + xv[7 + c] + xv[14 + c], 1e-12);
}

TEST(Engine, GradientsAccumulateOverBackwards) {
  Tensor x = leaf(random_f64({5}, 3));
  sum(square(x)).backward();
  std::vector<double> once = values(x.grad());
  sum(square(x)).backward();
  std::vector<double> twice = values(x.grad()), xv = values(x);
  for (size_t i = 0; i < xv.size(); ++i) {
    EXPECT_DOUBLE_EQ(once[i], 2 * xv[i]);
    EXPECT_DOUBLE_EQ(twice[i], 4 * xv[i]);
  }
}

TEST(Engine, AccumulatesInPlaceIntoAGradThatIsAViewOfAFlatBuffer) {
  // DDP keeps gradients as views of one bucket; backward must add into them there.
  Tensor a = leaf(random_f64({3}, 4)), b = leaf(random_f64({2, 2}, 5));
  Tensor bucket = zeros({7}, {.dtype = DType::f64});
  a.set_grad(bucket.narrow(0, 0, 3));
  b.set_grad(bucket.narrow(0, 3, 4).view({2, 2}));
  (sum(a * 2.0) + sum(b * 3.0)).backward();
  EXPECT_EQ(values(bucket), (std::vector<double>{2, 2, 2, 3, 3, 3, 3}));
  EXPECT_TRUE(a.grad().shares_storage(bucket));
}

TEST(Engine, ZeroGradHelper) {
  Tensor x = leaf(random_f64({4}, 6));
  sum(x * 5.0).backward();
  Tensor g = x.grad();
  autograd::zero_grad({x}, /*set_to_none=*/false);
  EXPECT_TRUE(x.grad().is_same(g));
  EXPECT_EQ(values(x.grad()), std::vector<double>(4, 0.0));
  autograd::zero_grad({x});
  EXPECT_FALSE(x.grad().defined());
}

TEST(Engine, BackwardWithGivenGradient) {
  Tensor x = leaf(random_f64({2, 3}, 7));
  Tensor y = x * 3.0;
  y.backward(from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::f64}));
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3, 6, 9, 12, 15, 18}));
}

TEST(Engine, RetainGraph) {
  Tensor x = leaf(random_f64({3}, 8));
  Tensor loss = sum(exp(x) * x);
  loss.backward(Tensor(), /*retain_graph=*/true);
  std::vector<double> first = values(x.grad());
  loss.backward();  // allowed: the graph was retained
  std::vector<double> second = values(x.grad());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_DOUBLE_EQ(second[i], 2 * first[i]);
  // Now freed: a third backward names the node and the fix.
  std::string message = error_of([&] { loss.backward(); });
  EXPECT_PRED2(contains, message, "second time");
  EXPECT_PRED2(contains, message, "SumBackward");
  EXPECT_PRED2(contains, message, "retain_graph");
}

TEST(Engine, NoGradGuardIsScopedAndThreadLocal) {
  Tensor x = leaf(random_f64({3}, 9));
  {
    NoGradGuard guard;
    EXPECT_FALSE(autograd::is_grad_enabled());
    Tensor y = x * 2.0;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(y.is_leaf());
    bool other_thread_enabled = false;
    std::thread([&] { other_thread_enabled = autograd::is_grad_enabled(); }).join();
    EXPECT_TRUE(other_thread_enabled);
    {
      autograd::GradModeGuard on(true);
      EXPECT_TRUE((x * 2.0).requires_grad());
    }
    EXPECT_FALSE(autograd::is_grad_enabled());
  }
  EXPECT_TRUE(autograd::is_grad_enabled());
  EXPECT_TRUE((x * 2.0).requires_grad());
}

TEST(Engine, DetachSharesMemoryAndStopsGradients) {
  Tensor x = leaf(random_f64({4}, 10));
  Tensor d = (x * 2.0).detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  Tensor y = sum(x * d.detach()) + sum(x.detach() * 100.0);
  y.backward();
  EXPECT_EQ(values(x.grad()), values(d));  // only the x factor carries a gradient
  Tensor alias = x.detach();
  EXPECT_TRUE(alias.shares_storage(x));
  EXPECT_EQ(alias.raw_data(), x.raw_data());
}

TEST(Engine, ErrorMessages) {
  Tensor x = leaf(random_f64({2, 3}, 11));
  std::string non_scalar = error_of([&] { (x * 2.0).backward(); });
  EXPECT_PRED2(contains, non_scalar, "scalar");
  EXPECT_PRED2(contains, non_scalar, "[2, 3]");
  std::string no_grad = error_of([&] { random_f64({3}, 12).backward(); });
  EXPECT_PRED2(contains, no_grad, "does not require grad");
  std::string wrong_shape = error_of([&] { (x * 2.0).backward(zeros({3, 2}, {.dtype = DType::f64})); });
  EXPECT_PRED2(contains, wrong_shape, "[3, 2]");
  Tensor ids = from_vector<int64_t>({1, 2}, {2}, {.dtype = DType::i64});
  EXPECT_PRED2(contains, error_of([&] { ids.requires_grad_(); }), "floating");
  EXPECT_PRED2(contains, error_of([&] { (x * 2.0).requires_grad_(false); }), "leaf");
}

TEST(Engine, InPlaceOnLeafThatRequiresGrad) {
  Tensor x = leaf(random_f64({3}, 13));
  EXPECT_PRED2(contains, error_of([&] { x.fill_(1.0); }), "leaf");
  EXPECT_PRED2(contains, error_of([&] { x.copy_(random_f64({3}, 14)); }), "NoGradGuard");
  {
    NoGradGuard guard;  // optimizers update parameters this way
    x.fill_(1.5);
  }
  EXPECT_EQ(values(x), std::vector<double>(3, 1.5));
  EXPECT_TRUE(x.is_leaf());
}

// Writing into a view of a graph tensor rewrites the base's history (PyTorch's CopySlices):
// the overwritten elements pass no gradient back. (A view of a leaf is still refused.)
TEST(Engine, InPlaceIntoAViewOfAGraphTensorRewritesTheBase) {
  Tensor x = leaf(random_f64({4}, 15));
  Tensor y = x * 2.0;
  Tensor part = y.narrow(0, 1, 2);
  part.fill_(0.0);
  sum(y).backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{2, 0, 0, 2}));
  EXPECT_PRED2(contains, error_of([&] { x.narrow(0, 0, 2).fill_(0.0); }), "leaf");
}

TEST(Engine, VersionCounterDetectsModifiedSavedTensors) {
  Tensor x = leaf(random_f64({3}, 16));
  Tensor w = leaf(random_f64({3}, 17));
  Tensor loss = sum(x * w);  // saves x and w
  {
    NoGradGuard guard;
    w.fill_(0.0);
  }
  std::string message = error_of([&] { loss.backward(); });
  EXPECT_PRED2(contains, message, "MulBackward");
  EXPECT_PRED2(contains, message, "in-place");
  // A saved output modified later (exp saves its output).
  Tensor y = exp(x);
  Tensor z = sum(y);
  y.fill_(1.0);
  EXPECT_PRED2(contains, error_of([&] { z.backward(); }), "ExpBackward");
  // Unmodified: fine.
  Tensor ok = sum(x * w);
  EXPECT_NO_THROW(ok.backward());
}

TEST(Engine, GradientsTakeTheInputsDtype) {
  Generator gen(18);
  Tensor x32 = leaf(randn({2, 3}, {.dtype = DType::f32}, &gen));
  Tensor w64 = leaf(random_f64({3}, 19));
  Tensor loss = sum(x32.to(DType::f64) * w64) + sum(x32 * w64);  // mixed f32 · f64
  loss.backward();
  ASSERT_EQ(x32.grad().dtype(), DType::f32);
  ASSERT_EQ(w64.grad().dtype(), DType::f64);
  std::vector<double> gx = values(x32.grad()), wv = values(w64);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(gx[i], 2 * wv[i % 3], 1e-6);
}

TEST(Engine, TensorHooks) {
  Tensor x = leaf(random_f64({3}, 20));
  Tensor y = x * 2.0;
  int calls = 0;
  autograd::HookHandle h = autograd::register_hook(y, [&](const Tensor& g) {
    ++calls;
    return ops::mul(g, 10.0);  // replaces the gradient flowing into y
  });
  sum(y).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(values(x.grad()), std::vector<double>(3, 20.0));
  h.remove();
  autograd::zero_grad({x});
  Tensor y2 = x * 2.0;
  autograd::HookHandle leaf_hook = autograd::register_hook(x, [&](const Tensor& g) {
    ++calls;
    return Tensor();  // observe only
  });
  sum(y2).backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(values(x.grad()), std::vector<double>(3, 2.0));
  leaf_hook.remove();
}

// A three-layer MLP whose leaves report when their gradient is final.
struct ReadyHookRecorder {
  std::vector<std::string> order;
  std::map<std::string, std::vector<double>> value_at_hook;
  std::map<std::string, bool> first_layer_grad_defined_at_hook;
  std::vector<autograd::HookHandle> handles;
};

TEST(Engine, GradReadyHooksFireOnceFinalAndInReverseLayerOrder) {
  Tensor w1 = leaf(random_f64({5, 7}, 21)), b1 = leaf(random_f64({7}, 22));
  Tensor w2 = leaf(random_f64({7, 7}, 23)), b2 = leaf(random_f64({7}, 24));
  Tensor w3 = leaf(random_f64({7, 3}, 25)), b3 = leaf(random_f64({3}, 26));
  Tensor x = random_f64({4, 5}, 27);
  const std::map<std::string, Tensor> params{{"w1", w1}, {"b1", b1}, {"w2", w2},
                                             {"b2", b2}, {"w3", w3}, {"b3", b3}};
  ReadyHookRecorder rec;
  for (const auto& [name, p] : params) {
    rec.handles.push_back(autograd::register_grad_ready_hook(p, [&rec, name = name, w1](const Tensor& leaf) {
      rec.order.push_back(name);
      rec.value_at_hook[name] = values(leaf.grad());
      rec.first_layer_grad_defined_at_hook[name] = w1.grad().defined();
    }));
  }
  // w2 is used twice (layers 2 and "2b"), so its gradient has two contributions.
  Tensor h = tanh(linear(x, w1, b1));
  h = tanh(linear(h, w2, b2));
  h = tanh(linear(h, w2, b2));
  Tensor loss = sum(square(linear(h, w3, b3)));
  loss.backward();

  ASSERT_EQ(rec.order.size(), 6u) << "each leaf reported exactly once";
  auto position = [&](const std::string& n) {
    return std::find(rec.order.begin(), rec.order.end(), n) - rec.order.begin();
  };
  EXPECT_LT(position("w3"), position("w2"));
  EXPECT_LT(position("b3"), position("b2"));
  EXPECT_LT(position("w2"), position("w1"));
  EXPECT_LT(position("b2"), position("b1"));
  // Early: layer 3's and layer 2's hooks ran before layer 1's gradient existed.
  EXPECT_FALSE(rec.first_layer_grad_defined_at_hook["w3"]);
  EXPECT_FALSE(rec.first_layer_grad_defined_at_hook["w2"]);
  // Final: what each hook saw is the gradient after backward (w2 included both uses).
  for (const auto& [name, p] : params) EXPECT_EQ(rec.value_at_hook[name], values(p.grad())) << name;

  // Removed hooks no longer fire.
  for (auto& handle : rec.handles) handle.remove();
  sum(w1 * 1.0).backward();
  EXPECT_EQ(rec.order.size(), 6u);
}

TEST(Engine, GradReadyHookNeedsALeafThatRequiresGrad) {
  Tensor x = leaf(random_f64({2}, 28));
  auto noop = [](const Tensor&) {};
  EXPECT_PRED2(contains, error_of([&] { autograd::register_grad_ready_hook(x * 2.0, noop); }), "non-leaf");
  Tensor constant = random_f64({2}, 29);
  EXPECT_PRED2(contains, error_of([&] { autograd::register_grad_ready_hook(constant, noop); }),
               "does not require grad");
}

TEST(Engine, SeveralRootsInOneBackward) {
  Tensor x = leaf(random_f64({3}, 30));
  Tensor a = sum(x * 2.0), b = sum(x * 3.0);
  int ready = 0;
  autograd::HookHandle h = autograd::register_grad_ready_hook(x, [&](const Tensor&) { ++ready; });
  autograd::backward({a, b});
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(values(x.grad()), std::vector<double>(3, 5.0));
  h.remove();
}

// An embedding lookup whose gradient goes to a sink (DDP's sparse embedding gradients): the
// lookup adds no edge into the weight, so a tied head's gradient is final (its grad-ready hook
// fires) before the lookup's backward hands over (indices, dY); the two together are the
// plain embedding's gradient. A declining sink leaves the ordinary backward.
struct RecordingSink : EmbeddingGradSink {
  bool accept = true;
  Tensor indices, grad;
  bool accepts(const Tensor&, const Tensor&) override { return accept; }
  void take(const Tensor& i, const Tensor& g) override {
    indices = i.clone();
    grad = g.clone();
  }
};

TEST(Engine, EmbeddingGradSinkTakesTheLookupsGradientAfterTheWeightIsFinal) {
  const Tensor w0 = random_f64({7, 3}, 31), r = random_f64({2, 3, 7}, 32);
  // Ids with repeats, as a column slice (not contiguous).
  const Tensor wide =
      from_vector<int64_t>({9, 4, 4, 0, 6, 9, 2, 6, 4, 9}, {2, 5}, {.dtype = DType::i64});
  const Tensor ids = wide.narrow(1, 1, 3);
  auto tied_loss = [&](const Tensor& w, const std::shared_ptr<EmbeddingGradSink>& sink) {
    const Tensor y = embedding(w, ids, sink);  // the lookup first, then a tied head
    return sum(matmul(y, w.t()) * r);
  };
  Tensor plain_w = leaf(w0);
  tied_loss(plain_w, nullptr).backward();

  auto sink = std::make_shared<RecordingSink>();
  Tensor w = leaf(w0);
  bool taken_before_ready = true;
  auto handle = autograd::register_grad_ready_hook(
      w, [&](const Tensor&) { taken_before_ready = sink->grad.defined(); });
  tied_loss(w, sink).backward();
  handle.remove();
  EXPECT_FALSE(taken_before_ready)
      << "the weight's gradient was final only after the lookup's backward";
  ASSERT_TRUE(sink->grad.defined());
  EXPECT_EQ(sink->indices.to_vector<int64_t>(), (std::vector<int64_t>{4, 4, 0, 2, 6, 4}));
  // dY = r · W for every looked-up row, by hand.
  const std::vector<double> rv = values(r), wv = values(w0), dy = values(sink->grad);
  ASSERT_EQ(dy.size(), 18u);
  for (int n = 0; n < 6; ++n)
    for (int c = 0; c < 3; ++c) {
      double want = 0;
      for (int v = 0; v < 7; ++v) want += rv[n * 7 + v] * wv[v * 3 + c];
      EXPECT_NEAR(dy[n * 3 + c], want, 1e-12);
    }
  // Head gradient + scattered rows = the plain embedding's gradient.
  Tensor combined = w.grad().clone();
  ops::index_add_(combined, 0, sink->indices, sink->grad);
  const std::vector<double> got = values(combined), want = values(plain_w.grad());
  for (size_t k = 0; k < want.size(); ++k) EXPECT_NEAR(got[k], want[k], 1e-12) << k;

  auto declining = std::make_shared<RecordingSink>();
  declining->accept = false;
  Tensor w2 = leaf(w0);
  tied_loss(w2, declining).backward();
  EXPECT_FALSE(declining->grad.defined());
  EXPECT_EQ(values(w2.grad()), want);
}

// Letting go of a graph 200,000 ops deep: each node's destructor used to destroy its inputs'
// nodes, recursively, and overflowed the stack. Run in a child process so that a regression
// fails this test alone.
TEST(Engine, ReleasingADeepGraphDoesNotOverflowTheStack) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_EXIT(
      {
        const Tensor x = leaf(ones({2}));
        Tensor y = x;
        for (int i = 0; i < 200000; ++i) y = y * 1.0;  // edges only
        y = Tensor();
        Tensor z = x;
        for (int i = 0; i < 200000; ++i) z = z * x;  // closures holding their inputs too
        z = Tensor();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace tessera
