// In-place arithmetic under autograd (add_, sub_, mul_, div_) and in-place writes into views
// of graph tensors: gradients against finite differences of the out-of-place equivalent,
// version-counter errors, and what is refused.
#include "gradcheck.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::error_of;
using testing::leaf;
using testing::random_f64;
using Xs = std::vector<Tensor>;

TEST(Inplace, ArithmeticGradients) {
  Tensor a = leaf(random_f64({4, 5}, 1)), b = leaf(random_f64({5}, 2, 0.5, 2.0));
  // Each op on a non-leaf copy of a, with b broadcast.
  EXPECT_TRUE(gradcheck(
      [](const Xs& x) {
        Tensor t = x[0] * 1.0;
        return add_(t, x[1]);
      },
      {a, b}));
  EXPECT_TRUE(gradcheck(
      [](const Xs& x) {
        Tensor t = x[0] * 1.0;
        return sub_(t, x[1]);
      },
      {a, b}));
  EXPECT_TRUE(gradcheck(
      [](const Xs& x) {
        Tensor t = x[0] * 1.0;
        return mul_(t, x[1]);
      },
      {a, b}));
  EXPECT_TRUE(gradcheck(
      [](const Xs& x) {
        Tensor t = x[0] * 1.0;
        return div_(t, x[1]);
      },
      {a, b}));
  // Chains of in-place ops and scalars.
  EXPECT_TRUE(gradcheck(
      [](const Xs& x) {
        Tensor t = x[0] * 1.5;  // a scalar product saves nothing that the chain overwrites
        mul_(t, x[1]);
        add_(t, 2.0);
        div_(t, x[1]);
        return mul_(t, -3.0);
      },
      {a, b}));
}

TEST(Inplace, ModifyingASavedTensorMakesBackwardRaise) {
  Tensor x = leaf(random_f64({3, 4}, 3));
  Tensor y = exp(x);  // ExpBackward saves its output y
  mul_(y, 2.0);
  const std::string message = error_of([&] { sum(y).backward(); });
  EXPECT_NE(message.find("ExpBackward"), std::string::npos) << message;
  EXPECT_NE(message.find("modified"), std::string::npos) << message;
  // The same through a view of the saved tensor.
  Tensor z = leaf(random_f64({3, 4}, 4));
  Tensor w = sigmoid(z);
  Tensor alias = w.detach();
  ops::binary_(BinaryOp::Add, alias, 1.0);
  EXPECT_NE(error_of([&] { sum(w).backward(); }), "");
}

TEST(Inplace, RefusedOnLeavesThatRequireGradAndOverlaps) {
  Tensor x = leaf(random_f64({3}, 5));
  EXPECT_NE(error_of([&] { add_(x, 1.0); }).find("leaf"), std::string::npos);
  {
    NoGradGuard no_grad;
    add_(x, 1.0);  // allowed without grad mode (an optimizer step)
  }
  Tensor base = zeros({1, 3});
  Tensor expanded = base.expand({2, 3});
  EXPECT_NE(error_of([&] { mul_(expanded, 2.0); }).find("more than one element"),
            std::string::npos);
}

TEST(Inplace, WritesIntoViewsOfGraphTensorsRewriteTheBase) {
  Tensor x = leaf(random_f64({4, 6}, 6)), s = leaf(random_f64({2, 3}, 7));
  // y = x * 2, then y[1:3, ::2] *= s and y[0] = 5: gradients as for the out-of-place version.
  auto inplace = [](const Xs& v) {
    Tensor y = v[0] * 2.0;
    Tensor region = y.slice(0, 1, 3).slice(1, 0, 6, 2);
    mul_(region, v[1]);
    y.select(0, 0).fill_(5.0);
    return y;
  };
  auto reference = [](const Xs& v) {
    Tensor y = v[0] * 2.0;
    Tensor rows = y.slice(0, 1, 3);
    Tensor scaled = stack({rows.select(1, 0) * v[1].select(1, 0), rows.select(1, 1),
                           rows.select(1, 2) * v[1].select(1, 1), rows.select(1, 3),
                           rows.select(1, 4) * v[1].select(1, 2), rows.select(1, 5)},
                          1);
    return cat({full({1, 6}, 5.0, {.dtype = DType::f64}), scaled, y.slice(0, 3, 4)}, 0);
  };
  EXPECT_TRUE(ops::allclose(inplace({x, s}), reference({x, s}), 1e-15, 0));
  EXPECT_TRUE(gradcheck(inplace, {x, s}));
  // copy_ into a view of a graph tensor, then using the view afterwards.
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        Tensor y = sin(v[0]);
        Tensor column = y.select(1, 2);
        column.copy_(v[1].select(0, 0) * 3.0);
        return column * y.select(1, 3);
      },
      {leaf(random_f64({3, 5}, 8)), leaf(random_f64({1, 3}, 9))}));
  // A view of a leaf that requires grad is still refused, before anything is written.
  Tensor leaf_x = leaf(random_f64({2, 2}, 10));
  const double before = ops::sum(leaf_x).item();
  Tensor view = leaf_x.select(0, 1);
  EXPECT_NE(error_of([&] { mul_(view, 2.0); }).find("leaf"), std::string::npos);
  EXPECT_EQ(ops::sum(leaf_x).item(), before);
}

}  // namespace
}  // namespace tessera
