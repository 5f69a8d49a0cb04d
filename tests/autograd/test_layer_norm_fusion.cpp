// The residual add of GPT-2's pre-norm blocks fused into the LayerNorm after it, on the CPU
// (tests/cuda checks the kernels against these): gradients against finite differences in
// float64, the fused forms against the separate add and norm, the mixed dtypes of autocast,
// and bad operands.
#include <cmath>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using testing::transposed_leaf;
using Xs = std::vector<Tensor>;

TEST(LayerNormFusion, ResidualLayerNormGradientsMatchFiniteDifferences) {
  Tensor x = transposed_leaf({3, 5, 11}, 21), r = transposed_leaf({3, 5, 11}, 22);
  Tensor w = leaf(random_f64({11}, 23)), b = leaf(random_f64({11}, 24));
  // Both outputs carry gradient (the residual stream and the norm's consumer).
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        const auto [sum, normed] = residual_layer_norm(v[0], v[1], v[2], v[3], 1e-5);
        return Xs{sum, normed};
      },
      {x, r, w, b}));
  // Weight without bias (GPTConfig.bias false keeps neither; a weight alone is allowed too).
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        const auto [sum, normed] = residual_layer_norm(v[0], v[1], v[2], Tensor(), 1e-5);
        return Xs{sum, normed};
      },
      {x, r, w}));
  // Neither, and only the normed output used (a final norm): the sum's gradient is absent
  // (the backward gets it undefined: takes_undefined_grads).
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) { return residual_layer_norm(v[0], v[1], Tensor(), Tensor(), 1e-5).second; },
      {x, r}));
  // Only the sum used, times a weight (the norm's output discarded): the norm adds nothing.
  const Tensor scale = random_f64({11}, 29);
  EXPECT_TRUE(gradcheck(
      [&](const Xs& v) {
        return residual_layer_norm(v[0], v[1], w.detach(), b.detach(), 1e-5).first * scale;
      },
      {x, r}));
  // One row of odd length, contiguous operands.
  Tensor x1 = leaf(random_f64({1, 7}, 25)), r1 = leaf(random_f64({1, 7}, 26));
  Tensor w1 = leaf(random_f64({7}, 27)), b1 = leaf(random_f64({7}, 28));
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        const auto [sum, normed] = residual_layer_norm(v[0], v[1], v[2], v[3], 1e-5);
        return Xs{sum, normed};
      },
      {x1, r1, w1, b1}));
}

TEST(LayerNormFusion, DeferredProjectionBiasGradientsMatchFiniteDifferences) {
  // x_bias: a projection's bias added inside the norm; its gradient is the column sums of the
  // sum's total gradient (both outputs used), from the same backward pass.
  Tensor x = transposed_leaf({3, 5, 11}, 61), r = transposed_leaf({3, 5, 11}, 62);
  Tensor w = leaf(random_f64({11}, 63)), b = leaf(random_f64({11}, 64));
  Tensor xb = leaf(random_f64({11}, 65));
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        const auto [sum, normed] = residual_layer_norm(v[0], v[1], v[2], v[3], 1e-5, v[4]);
        return Xs{sum, normed};
      },
      {x, r, w, b, xb}));
  // Only the normed output used (ln_f), no norm parameters, a 2-D input.
  Tensor x2 = leaf(random_f64({4, 9}, 66)), r2 = leaf(random_f64({4, 9}, 67));
  Tensor xb2 = leaf(random_f64({9}, 68));
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        return residual_layer_norm(v[0], v[1], Tensor(), Tensor(), 1e-5, v[2]).second;
      },
      {x2, r2, xb2}));
}

TEST(LayerNormFusion, DeferredBiasEqualsAddingItFirst) {
  // (x + x_bias) + residual, each add rounded: bit for bit the composition, forward and
  // backward, in f64 and f32 (the CPU has no fused kernel; tests/cuda checks the GPU's).
  for (DType dt : {DType::f64, DType::f32}) {
    const Tensor x = leaf(random_f64({2, 3, 8}, 71).to(dt)),
                 r = leaf(random_f64({2, 3, 8}, 72).to(dt));
    const Tensor w = leaf(random_f64({8}, 73).to(dt)), xb = leaf(random_f64({8}, 74).to(dt));
    const Tensor g_sum = random_f64({2, 3, 8}, 75).to(dt), g_out = random_f64({2, 3, 8}, 76).to(dt);
    auto run = [&](bool deferred) {
      for (const Tensor* t : {&x, &r, &w, &xb}) t->set_grad(Tensor());
      Tensor s, n;
      if (deferred) {
        std::tie(s, n) = residual_layer_norm(x, r, w, Tensor(), 1e-5, xb);
      } else {
        std::tie(s, n) = residual_layer_norm(x + xb, r, w, Tensor(), 1e-5);
      }
      (sum(s * g_sum) + sum(n * g_out)).backward();
      return Xs{s.detach(), n.detach(), x.grad(), r.grad(), w.grad(), xb.grad()};
    };
    const Xs deferred = run(true), composed = run(false);
    for (size_t i = 0; i < deferred.size(); ++i) {
      if (i == 5) {  // column sums in another order than the broadcast add's backward
        EXPECT_LT(ops::max_rel_error(deferred[i].to(DType::f64), composed[i].to(DType::f64)),
                  dt == DType::f64 ? 1e-13 : 1e-5);
        continue;
      }
      EXPECT_EQ(testing::detail::values(deferred[i]), testing::detail::values(composed[i]))
          << dtype_name(dt) << " output " << i;
    }
  }
  const Tensor x = random_f64({2, 8}, 77);
  const std::string error = testing::error_of(
      [&] { residual_layer_norm(x, x, Tensor(), Tensor(), 1e-5, random_f64({7}, 78)); });
  EXPECT_NE(error.find("x_bias"), std::string::npos) << error;
}

TEST(LayerNormFusion, ResidualLayerNormEqualsTheComposition) {
  const Tensor x = transposed_leaf({4, 7, 9}, 31), r = transposed_leaf({4, 7, 9}, 32);
  const Tensor w = leaf(random_f64({9}, 33)), b = leaf(random_f64({9}, 36));
  const auto [fused_sum, normed] = residual_layer_norm(x, r, w, b, 1e-5);
  const Tensor composed_sum = x + r;
  EXPECT_LT(ops::max_rel_error(fused_sum, composed_sum), 1e-15);
  EXPECT_LT(ops::max_rel_error(normed, layer_norm(composed_sum, w, b, 1e-5)), 1e-14);
  // The gradients of both forms, with both outputs used, agree.
  const Tensor g_sum = random_f64({4, 7, 9}, 37), g_normed = random_f64({4, 7, 9}, 38);
  auto grads_of = [&](bool fused) {
    for (const Tensor* t : {&x, &r, &w, &b}) t->set_grad(Tensor());
    Tensor s, n;
    if (fused) {
      std::tie(s, n) = residual_layer_norm(x, r, w, b, 1e-5);
    } else {
      s = x + r;
      n = layer_norm(s, w, b, 1e-5);
    }
    (sum(s * g_sum) + sum(n * g_normed)).backward();
    return Xs{x.grad().clone(), r.grad().clone(), w.grad().clone(), b.grad().clone()};
  };
  const Xs fused = grads_of(true), composed = grads_of(false);
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_LT(ops::max_rel_error(fused[i], composed[i]), 1e-13) << "input " << i;
  // f32 and bf16 against the f64 result: the sum is rounded, then normalised.
  for (DType dt : {DType::f32, DType::bf16}) {
    const auto [s, n] = residual_layer_norm(x.detach().to(dt), r.detach().to(dt), w.detach().to(dt),
                                            b.detach().to(dt), 1e-5);
    EXPECT_LT(ops::max_rel_error(s.to(DType::f64), composed_sum), dt == DType::f32 ? 1e-6 : 1e-2);
    EXPECT_LT(ops::max_rel_error(n.to(DType::f64), normed), dt == DType::f32 ? 1e-5 : 3e-2);
  }
  // The backward's fused form: the norm's dx plus the residual gradient.
  const Tensor dy = random_f64({4, 7, 9}, 34), dres = random_f64({4, 7, 9}, 35);
  const ops::LayerNormOutput fwd =
      ops::layer_norm(composed_sum.detach(), w.detach(), b.detach(), 1e-5);
  const ops::LayerNormGrads plain =
      ops::layer_norm_backward(dy, composed_sum.detach(), w.detach(), fwd.mean, fwd.rstd, true);
  const ops::LayerNormGrads fused_grads = ops::layer_norm_backward_residual(
      dy, composed_sum.detach(), w.detach(), fwd.mean, fwd.rstd, dres, true);
  EXPECT_LT(ops::max_rel_error(fused_grads.dx, ops::binary(BinaryOp::Add, plain.dx, dres)), 1e-14);
  EXPECT_LT(ops::max_rel_error(fused_grads.dweight, plain.dweight), 1e-14);
  EXPECT_LT(ops::max_rel_error(fused_grads.dbias, plain.dbias), 1e-14);
}

TEST(LayerNormFusion, MixedDtypesAddInThePromotedDtypeAsTheComposition) {
  // Under autocast an f32 residual stream meets a bf16 block output.
  Tensor x = leaf(random_f64({3, 16}, 51).to(DType::f32));
  Tensor r = leaf(random_f64({3, 16}, 52).to(DType::bf16));
  Tensor w = leaf(random_f64({16}, 53).to(DType::f32)),
         b = leaf(random_f64({16}, 54).to(DType::f32));
  const auto [s, n] = residual_layer_norm(x, r, w, b, 1e-5);
  EXPECT_EQ(s.dtype(), DType::f32);
  const Tensor want_sum = x + r;
  EXPECT_EQ(testing::detail::values(s), testing::detail::values(want_sum));
  EXPECT_EQ(testing::detail::values(n), testing::detail::values(layer_norm(want_sum, w, b, 1e-5)));
  sum(n * random_f64({3, 16}, 55).to(DType::f32)).backward();
  EXPECT_EQ(r.grad().dtype(), DType::bf16);
  EXPECT_EQ(x.grad().dtype(), DType::f32);
}

TEST(LayerNormFusion, ResidualLayerNormRefusesMismatchedOperands) {
  const Tensor x = random_f64({2, 3, 8}, 41);
  const std::string shape_error = testing::error_of([&] {
    residual_layer_norm(x, random_f64({2, 4, 8}, 42), Tensor(), Tensor());
  });
  EXPECT_NE(shape_error.find("residual"), std::string::npos) << shape_error;
  EXPECT_NE(shape_error.find("[2, 4, 8]"), std::string::npos) << shape_error;
  // The tape-free op wants one dtype; the differentiable one refuses a non-float operand.
  const std::string dtype_error = testing::error_of(
      [&] { ops::residual_layer_norm(x, x.to(DType::f32), Tensor(), Tensor(), 1e-5); });
  EXPECT_NE(dtype_error.find("float32"), std::string::npos) << dtype_error;
  EXPECT_NE(
      testing::error_of([&] { residual_layer_norm(x, x.to(DType::i64), Tensor(), Tensor()); }), "");
  const std::string weight_error =
      testing::error_of([&] { residual_layer_norm(x, x, random_f64({7}, 44), Tensor()); });
  EXPECT_NE(weight_error.find("weight"), std::string::npos) << weight_error;
  const std::string bias_error = testing::error_of(
      [&] { residual_layer_norm(x, x, Tensor(), random_f64({8}, 45).to(DType::f32)); });
  EXPECT_NE(bias_error.find("bias"), std::string::npos) << bias_error;
  const ops::LayerNormOutput fwd = ops::layer_norm(x, Tensor(), Tensor(), 1e-5);
  const std::string grad_error = testing::error_of([&] {
    ops::layer_norm_backward_residual(x, x, Tensor(), fwd.mean, fwd.rstd, random_f64({2, 3, 7}, 43),
                                      false);
  });
  EXPECT_NE(grad_error.find("residual gradient"), std::string::npos) << grad_error;
}

}  // namespace
}  // namespace tessera
