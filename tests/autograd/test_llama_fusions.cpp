// The fusions the Llama training step relies on, on the CPU (tests/cuda checks the kernels
// against these): the residual add fused into RMSNorm, gradients of torch-layout weights
// (w.t()) produced in the weight's own layout, and leaf gradients adopted without a copy.
#include <cmath>

#include "gradcheck.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using testing::transposed_leaf;
using Xs = std::vector<Tensor>;

TEST(LlamaFusions, ResidualRmsNormGradientsMatchFiniteDifferences) {
  Tensor x = transposed_leaf({3, 5, 11}, 21), r = transposed_leaf({3, 5, 11}, 22);
  Tensor w = leaf(random_f64({11}, 23));
  // Both outputs carry gradient (the residual stream and the norm's consumer).
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) {
        const auto [sum, normed] = residual_rms_norm(v[0], v[1], v[2], 1e-5);
        return Xs{sum, normed};
      },
      {x, r, w}));
  // Only the normed output used (a final norm): the sum's gradient is absent.
  EXPECT_TRUE(gradcheck(
      [](const Xs& v) { return residual_rms_norm(v[0], v[1], Tensor(), 1e-5).second; }, {x, r}));
}

TEST(LlamaFusions, ResidualRmsNormEqualsTheComposition) {
  const Tensor x = transposed_leaf({4, 7, 9}, 31), r = transposed_leaf({4, 7, 9}, 32);
  const Tensor w = leaf(random_f64({9}, 33));
  const auto [sum, normed] = residual_rms_norm(x, r, w, 1e-6);
  const Tensor composed_sum = x + r;
  EXPECT_LT(ops::max_rel_error(sum, composed_sum), 1e-15);
  EXPECT_LT(ops::max_rel_error(normed, rms_norm(composed_sum, w, 1e-6)), 1e-14);
  // f32 and bf16 against the f64 result: the sum is rounded, then normalised.
  for (DType dt : {DType::f32, DType::bf16}) {
    const auto [s, n] = residual_rms_norm(x.detach().to(dt), r.detach().to(dt), w.detach().to(dt));
    EXPECT_LT(ops::max_rel_error(s.to(DType::f64), composed_sum), dt == DType::f32 ? 1e-6 : 1e-2);
    EXPECT_LT(ops::max_rel_error(n.to(DType::f64), normed), dt == DType::f32 ? 1e-5 : 3e-2);
  }
  // The backward's fused form: the norm's dx plus the residual gradient.
  const Tensor dy = random_f64({4, 7, 9}, 34), dres = random_f64({4, 7, 9}, 35);
  const ops::RmsNormOutput fwd = ops::rms_norm(composed_sum.detach(), w.detach(), 1e-6);
  const ops::RmsNormGrads plain =
      ops::rms_norm_backward(dy, composed_sum.detach(), w.detach(), fwd.rstd, true);
  const ops::RmsNormGrads fused =
      ops::rms_norm_backward_residual(dy, composed_sum.detach(), w.detach(), fwd.rstd, dres, true);
  EXPECT_LT(ops::max_rel_error(fused.dx, ops::binary(BinaryOp::Add, plain.dx, dres)), 1e-14);
  EXPECT_LT(ops::max_rel_error(fused.dweight, plain.dweight), 1e-14);
}

TEST(LlamaFusions, ResidualRmsNormRefusesMismatchedOperands) {
  const Tensor x = random_f64({2, 3, 8}, 41);
  const std::string shape_error = testing::error_of([&] {
    residual_rms_norm(x, random_f64({2, 4, 8}, 42), Tensor());
  });
  EXPECT_NE(shape_error.find("residual"), std::string::npos) << shape_error;
  EXPECT_NE(testing::error_of([&] { residual_rms_norm(x, x.to(DType::f32), Tensor()); }), "");
  EXPECT_NE(testing::error_of([&] {
              ops::rms_norm_backward_residual(x, x, Tensor(), ops::rms_norm(x, Tensor(), 1e-6).rstd,
                                              random_f64({2, 3, 7}, 43), false);
            }),
            "");
}

TEST(LlamaFusions, RotaryAttentionFromAFusedProjectionMatchesSeparateHeads) {
  const int64_t B = 2, T = 4, H = 2, Hkv = 1, D = 4;
  // A non-contiguous projection: [B, T, W] seen through a transpose of [B, W, T].
  Tensor qkv = transposed_leaf({B, T, (H + 2 * Hkv) * D}, 71);
  const ops::RopeTables tables = ops::rope_tables(0, T, D, 10000.0, DType::f64);
  EXPECT_TRUE(gradcheck(
      [&](const Xs& v) { return rotary_causal_attention_qkv(v[0], H, Hkv, tables); }, {qkv}));
  // The same from separate heads: rotate q and k, attend with grouped-query heads, merge.
  auto heads = [&](int64_t first, int64_t n) {
    return qkv.narrow(2, first * D, n * D).reshape({B, T, n, D});
  };
  const Tensor q = rotary_embedding(heads(0, H), tables).transpose(1, 2);
  const Tensor k = rotary_embedding(heads(H, Hkv), tables).transpose(1, 2);
  const Tensor v = heads(H + Hkv, Hkv).transpose(1, 2);
  const Tensor expected =
      scaled_dot_product_attention(q, k, v, true).transpose(1, 2).reshape({B, T, H * D});
  EXPECT_LT(ops::max_rel_error(rotary_causal_attention_qkv(qkv, H, Hkv, tables), expected), 1e-14);
  // Bad head counts and widths name the problem.
  EXPECT_NE(
      testing::error_of([&] { rotary_causal_attention_qkv(qkv, 4, 3, tables); }).find("n_kv_head"),
      std::string::npos);
  EXPECT_NE(testing::error_of([&] { rotary_causal_attention_qkv(qkv, 5, 1, tables); }), "");
}

TEST(LlamaFusions, RopeIntoWritesAStridedOutputAndLeavesTheRestAlone) {
  const Tensor x = random_f64({2, 5, 3, 8}, 81);
  const ops::RopeTables tables = ops::rope_tables(2, 5, 8, 500.0, DType::f64);
  // Heads 3..5 of a [2, 5, 7, 8] buffer: a strided destination.
  Tensor buffer = random_f64({2, 5, 7, 8}, 82);
  const Tensor untouched = buffer.clone();
  const Tensor out = ops::narrow(buffer, 2, 3, 3);
  for (bool inverse : {false, true}) {
    ops::rope_into(x, tables, inverse, out);
    EXPECT_LT(ops::max_rel_error(out, ops::rope(x, tables, inverse)), 1e-15);
    EXPECT_TRUE(ops::allclose(ops::narrow(buffer, 2, 0, 3), ops::narrow(untouched, 2, 0, 3), 0, 0));
    EXPECT_TRUE(ops::allclose(ops::narrow(buffer, 2, 6, 1), ops::narrow(untouched, 2, 6, 1), 0, 0));
  }
  EXPECT_NE(testing::error_of([&] {
              ops::rope_into(x, tables, false, random_f64({2, 5, 3, 6}, 83));
            }),
            "");
  EXPECT_NE(
      testing::error_of([&] {
        ops::rope_into(x, tables, false, ops::expand(random_f64({2, 5, 1, 8}, 84), {2, 5, 3, 8}));
      }),
      "");
}

TEST(LlamaFusions, TransposedWeightGradientsMatchFiniteDifferencesAndAreContiguous) {
  // A torch-layout weight [out, in] used as w.t(), as Llama's projections and head use it.
  Tensor x = transposed_leaf({2, 3, 5}, 51), w = leaf(random_f64({7, 5}, 52));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return linear(v[0], v[1].t()); }, {x, w}));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return matmul(v[0], v[1].t()); }, {x, w}));
  Tensor x2 = leaf(random_f64({6, 5}, 53));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return matmul(v[0], v[1].t()); }, {x2, w}));
  // The weight's gradient arrives in its own layout.
  Tensor wl = leaf(random_f64({7, 5}, 54));
  sum(linear(x, wl.t())).backward();
  EXPECT_TRUE(wl.grad().is_contiguous());
  // With a bias the (in, out) form runs; still right.
  Tensor b = leaf(random_f64({7}, 55));
  EXPECT_TRUE(gradcheck([](const Xs& v) { return linear(v[0], v[1].t(), v[2]); }, {x, w, b}));
}

TEST(LlamaFusions, AdoptedLeafGradientsNeverShareMemory) {
  // x + y hands the same gradient tensor to both leaves: at most one may keep it.
  Tensor x = leaf(random_f64({4, 3}, 61)), y = leaf(random_f64({4, 3}, 62));
  Tensor upstream = random_f64({4, 3}, 63);
  (x + y).backward(upstream);
  EXPECT_NE(x.grad().raw_data(), y.grad().raw_data());
  EXPECT_NE(x.grad().raw_data(), upstream.raw_data());
  EXPECT_NE(y.grad().raw_data(), upstream.raw_data());
  const std::vector<double> before = testing::detail::values(y.grad());
  ops::fill_(x.grad(), 5.0);
  EXPECT_EQ(testing::detail::values(y.grad()), before);
  EXPECT_EQ(testing::detail::values(y.grad()), testing::detail::values(upstream));
  // A second backward accumulates into the adopted tensors.
  Tensor w = leaf(random_f64({3, 2}, 64));
  sum(matmul(random_f64({5, 3}, 65), w)).backward();
  const std::vector<double> once = testing::detail::values(w.grad());
  sum(matmul(random_f64({5, 3}, 65), w)).backward();
  const std::vector<double> twice = testing::detail::values(w.grad());
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(twice[i], 2 * once[i], 1e-12);
}

}  // namespace
}  // namespace tessera
