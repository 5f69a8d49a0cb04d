// scaled_dot_product_attention (composed path: finite differences in float64 and an
// independent loop reference; CUDA: flash kernels against the composed path in bf16),
// AutocastGuard, and the fused CUDA cross-entropy against the CPU cross_entropy.
#include <cmath>
#include <limits>

#include "gradcheck.h"
#include "tessera/autograd/autocast.h"
#include "tessera/kernels/ops.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using Xs = std::vector<Tensor>;

// softmax(q kᵀ/√D [+ causal]) v with plain loops in double; queries are the last Tq of
// the Tk positions.
std::vector<double> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                        bool causal) {
  const auto qv = testing::detail::values(q), kv = testing::detail::values(k),
             vv = testing::detail::values(v);
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  std::vector<double> out(B * H * Tq * D, 0.0);
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < Tq; ++i) {
      std::vector<double> s(Tk, -std::numeric_limits<double>::infinity());
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < Tk; ++j) {
        if (causal && j > Tk - Tq + i) continue;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += qv[(bh * Tq + i) * D + d] * kv[(bh * Tk + j) * D + d];
        s[j] = dot / std::sqrt(double(D));
        mx = std::max(mx, s[j]);
      }
      double total = 0;
      for (auto& x : s) total += (x = std::exp(x - mx));
      for (int64_t j = 0; j < Tk; ++j)
        for (int64_t d = 0; d < D; ++d)
          out[(bh * Tq + i) * D + d] += s[j] / total * vv[(bh * Tk + j) * D + d];
    }
  return out;
}

// A float64 [B, H, T, D] leaf that is a non-contiguous view of a [B, T, H, D] tensor
// (how attention sees the heads of a projection).
Tensor heads_view(int64_t B, int64_t H, int64_t T, int64_t D, uint64_t seed) {
  Tensor t = leaf(random_f64({B, T, H, D}, seed).transpose(1, 2));
  EXPECT_TRUE(T == 1 || !t.is_contiguous());  // one position: the transpose is contiguous
  return t;
}

TEST(Attention, ForwardMatchesLoopReference) {
  for (bool causal : {true, false}) {
    for (auto [Tq, Tk] : std::vector<std::pair<int64_t, int64_t>>{{7, 7}, {1, 1}, {3, 7}}) {
      SCOPED_TRACE(::testing::Message() << "causal " << causal << " Tq " << Tq << " Tk " << Tk);
      const Tensor q = heads_view(2, 3, Tq, 5, 1), k = heads_view(2, 3, Tk, 5, 2),
                   v = heads_view(2, 3, Tk, 5, 3);
      const auto got = testing::detail::values(scaled_dot_product_attention(q, k, v, causal));
      const auto want = reference_attention(q, k, v, causal);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-12) << "element " << i;
    }
  }
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  const Tensor q = heads_view(2, 3, 7, 5, 4), k = heads_view(2, 3, 7, 5, 5),
               v = heads_view(2, 3, 7, 5, 6);
  for (bool causal : {true, false})
    EXPECT_TRUE(gradcheck(
        [causal](const Xs& x) { return scaled_dot_product_attention(x[0], x[1], x[2], causal); },
        {q, k, v}))
        << "causal " << causal;
  // A KV cache: 2 new queries over 7 keys.
  const Tensor q2 = leaf(random_f64({1, 2, 2, 4}, 7));
  const Tensor k2 = leaf(random_f64({1, 2, 7, 4}, 8)), v2 = leaf(random_f64({1, 2, 7, 4}, 9));
  EXPECT_TRUE(
      gradcheck([](const Xs& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); },
                {q2, k2, v2}));
}

TEST(Attention, DropoutFollowsTheGenerator) {
  const Tensor q = heads_view(1, 2, 7, 4, 10), k = heads_view(1, 2, 7, 4, 11),
               v = heads_view(1, 2, 7, 4, 12);
  Generator g1(5), g2(5), g3(6);
  const auto a = testing::detail::values(scaled_dot_product_attention(q, k, v, true, 0.5, &g1));
  const auto b = testing::detail::values(scaled_dot_product_attention(q, k, v, true, 0.5, &g2));
  const auto c = testing::detail::values(scaled_dot_product_attention(q, k, v, true, 0.5, &g3));
  const auto plain = testing::detail::values(scaled_dot_product_attention(q, k, v, true));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, plain);
}

TEST(Attention, BadInputsRaise) {
  const Tensor q = random_f64({1, 2, 3, 4}, 1), k = random_f64({1, 2, 5, 4}, 2);
  EXPECT_THROW(scaled_dot_product_attention(random_f64({2, 3, 4}, 3), k, k, false), Error);
  EXPECT_THROW(scaled_dot_product_attention(q, random_f64({1, 2, 5, 3}, 4), k, false), Error);
  EXPECT_THROW(scaled_dot_product_attention(k, q, q, true), Error);  // 5 queries, 3 keys
  EXPECT_THROW(scaled_dot_product_attention(q, k.to(DType::f32), k, false), Error);
  EXPECT_THROW(scaled_dot_product_attention(q, k, k, false, 1.0), Error);
}

TEST(Autocast, CastsAttentionOperandsAndGradientsFlowBackInF32) {
  Generator gen(3);
  Tensor q = leaf(randn({1, 2, 33, 8}, {.dtype = DType::f32}, &gen));
  Tensor k = leaf(randn({1, 2, 33, 8}, {.dtype = DType::f32}, &gen));
  Tensor v = leaf(randn({1, 2, 33, 8}, {.dtype = DType::f32}, &gen));
  EXPECT_FALSE(autograd::autocast_dtype().has_value());
  Tensor out;
  {
    autograd::AutocastGuard guard(DType::bf16);
    EXPECT_EQ(autograd::autocast_dtype(), DType::bf16);
    {
      autograd::AutocastGuard off(DType::f32);
      EXPECT_FALSE(autograd::autocast_dtype().has_value());
    }
    EXPECT_EQ(autograd::autocast_dtype(), DType::bf16);
    out = scaled_dot_product_attention(q, k, v, true);
    // f64 asks for precision: left alone.
    EXPECT_EQ(autograd::autocast(random_f64({2}, 1)).dtype(), DType::f64);
  }
  EXPECT_FALSE(autograd::autocast_dtype().has_value());
  EXPECT_EQ(out.dtype(), DType::bf16);
  sum(out.to(DType::f32)).backward();
  for (const Tensor& t : {q, k, v}) {
    ASSERT_TRUE(t.grad().defined());
    EXPECT_EQ(t.grad().dtype(), DType::f32);
  }
  // Close to the f32 computation within bf16 precision.
  const auto want = testing::detail::values(
      scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), true));
  const auto got = testing::detail::values(out);
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 3e-2 * (1 + std::abs(want[i])));
  EXPECT_THROW(autograd::AutocastGuard(DType::f64), Error);
}

// Largest |a - b| relative to the largest |b|.
double relative_error(const Tensor& a, const Tensor& b) {
  const auto av = testing::detail::values(a), bv = testing::detail::values(b);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < av.size(); ++i) {
    diff = std::max(diff, std::abs(av[i] - bv[i]));
    scale = std::max(scale, std::abs(bv[i]));
  }
  return diff / scale;
}

TEST(AttentionCuda, FlashMatchesComposedInBf16) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  for (int64_t D : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "D " << D);
    const int64_t B = 2, H = 3, T = 257;
    Generator gen{static_cast<uint64_t>(D)};
    // [B, T, 3, H, D] as a fused projection would lay out q|k|v: non-contiguous heads.
    const Tensor qkv =
        randn({B, T, 3, H, D}, {.dtype = DType::bf16, .device = Device::cuda(0)}, &gen);
    auto head = [&](int64_t i) { return leaf(qkv.select(2, i).transpose(1, 2)); };
    const Tensor dout =
        randn({B, H, T, D}, {.dtype = DType::bf16, .device = Device::cuda(0)}, &gen);
    std::vector<Tensor> outs, grads;
    for (bool flash : {true, false}) {
      Tensor q = head(0), k = head(1), v = head(2);
      EXPECT_EQ(attention_takes(q, k, v, true), true);
      Tensor out = scaled_dot_product_attention(q, k, v, true, 0.0, nullptr, flash);
      EXPECT_EQ(autograd::meta_of(out).grad_fn->name == "FlashAttentionBackward", flash);
      sum(out.to(DType::f32) * dout.to(DType::f32)).backward();
      outs.push_back(out);
      for (const Tensor& t : {q, k, v}) grads.push_back(t.grad());
    }
    EXPECT_LT(relative_error(outs[0], outs[1]), 2e-2);
    for (int i = 0; i < 3; ++i)
      EXPECT_LT(relative_error(grads[i], grads[i + 3]), 3e-2) << "input " << i;
  }
}

// The mean/sum backward scales the gradient buffer in place by the incoming gradient on the
// device (skipped when it is 1): a scale other than 1, and a graph kept for a second backward
// (which must not see the first one's scaling), both still give the CPU's gradient.
TEST(FusedCrossEntropyCuda, IncomingGradientScalesTheGradientOnce) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 2, T = 5, V = 131;
  Generator gen(12);
  const Tensor logits_cpu = randn({B, T, V}, {.dtype = DType::f32}, &gen) * 2.0;
  const Tensor targets_cpu = randint(0, V, {B, T}, {.dtype = DType::i64}, &gen);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Reduction reduction : {Reduction::Mean, Reduction::Sum}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " reduction " << int(reduction));
      Tensor ref_in = leaf(logits_cpu.to(dtype).to(DType::f32));
      (cross_entropy(ref_in, targets_cpu, -100, reduction) * 0.37).backward();
      Tensor gpu_in = leaf(logits_cpu.to(Device::cuda(0), dtype));
      Tensor loss = fused_cross_entropy(gpu_in, targets_cpu.to(Device::cuda(0)), -100, reduction);
      (loss * 0.37).backward({}, /*retain_graph=*/true);
      const Tensor first = gpu_in.grad().cpu().to(DType::f32);
      const double tol = dtype == DType::f32 ? 1e-5 : 2e-2;
      EXPECT_LT(relative_error(first, ref_in.grad()), tol);
      gpu_in.set_grad(Tensor());
      (loss * 0.37).backward();  // the kept graph again: the same gradient
      EXPECT_EQ(relative_error(gpu_in.grad().cpu().to(DType::f32), first), 0.0);
    }
  }
}

TEST(FusedCrossEntropyCuda, MatchesTheCpuCrossEntropy) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 3, T = 7, V = 257;
  Generator gen(11);
  const Tensor logits_cpu = randn({B, T, V}, {.dtype = DType::f32}, &gen) * 3.0;
  Tensor targets_cpu = randint(0, V, {B, T}, {.dtype = DType::i64}, &gen);
  targets_cpu = ops::contiguous(targets_cpu);
  targets_cpu.data<int64_t>()[4] = -100;  // one ignored position
  const Tensor weights = randn({B, T}, {.dtype = DType::f32}, &gen);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (Reduction reduction : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " reduction " << int(reduction));
      Tensor ref_in = leaf(logits_cpu.to(dtype).to(DType::f32));
      Tensor ref = cross_entropy(ref_in, targets_cpu, -100, reduction);
      Tensor gpu_in = leaf(logits_cpu.to(Device::cuda(0), dtype));
      Tensor loss = fused_cross_entropy(gpu_in, targets_cpu.to(Device::cuda(0)), -100, reduction);
      EXPECT_EQ(loss.dtype(), DType::f32);
      const double tol = dtype == DType::f32 ? 1e-5 : 2e-2;
      EXPECT_LT(relative_error(loss.cpu(), ref), tol);
      // Loss-scaled backward (as fp16 training does): the gradient still matches.
      const double scale = dtype == DType::f16 ? 1024.0 : 1.0;
      if (reduction == Reduction::None) {
        sum(ref * weights * scale).backward();
        sum(loss * weights.to(Device::cuda(0)) * scale).backward();
      } else {
        (ref * scale).backward();
        (loss * scale).backward();
      }
      EXPECT_LT(relative_error(gpu_in.grad().cpu(), ref_in.grad()),
                dtype == DType::f32 ? 1e-5 : 2e-2);
      // The input logits were not consumed (consume_logits is off).
      EXPECT_LT(relative_error(gpu_in.detach().cpu(), ref_in.detach()), 1e-6);
    }
  }
  EXPECT_THROW(fused_cross_entropy(logits_cpu, targets_cpu), Error);
  EXPECT_THROW(fused_cross_entropy(logits_cpu.to(Device::cuda(0)), targets_cpu),
               Error);  // targets on the CPU
}

// linear and matmul under autocast: bf16 products, f32 gradients for f32 leaves, and values
// within bf16 rounding of the f32 computation.
TEST(Autocast, LinearAndMatmulComputeInBf16WithF32Gradients) {
  Generator gen(11);
  Tensor x = leaf(randn({7, 33}, {.dtype = DType::f32}, &gen));
  Tensor w = leaf(randn({33, 9}, {.dtype = DType::f32}, &gen));
  Tensor b = leaf(randn({9}, {.dtype = DType::f32}, &gen));
  Tensor m = leaf(randn({9, 5}, {.dtype = DType::f32}, &gen));
  Tensor y;
  {
    autograd::AutocastGuard guard(DType::bf16);
    y = matmul(linear(x, w, b), m);
  }
  EXPECT_EQ(y.dtype(), DType::bf16);
  sum(y.to(DType::f32)).backward();
  std::vector<Tensor> grads;
  for (const Tensor& t : {x, w, b, m}) {
    ASSERT_TRUE(t.grad().defined());
    EXPECT_EQ(t.grad().dtype(), DType::f32);
    grads.push_back(t.grad().clone());
    t.set_grad(Tensor());
  }
  Tensor ref = matmul(linear(x, w, b), m);
  EXPECT_LT(ops::max_rel_error(y.to(DType::f32), ref), 3e-2);
  sum(ref).backward();
  const std::vector<Tensor> leaves = {x, w, b, m};
  for (size_t i = 0; i < leaves.size(); ++i) {
    EXPECT_LT(ops::max_rel_error(grads[i], leaves[i].grad()), 3e-2) << i;
  }
}

}  // namespace
}  // namespace tessera
