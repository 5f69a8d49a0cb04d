// causal_attention_qkv on the CPU (its composed path): against a loop reference read straight
// from qkv, against the split/heads/sdpa/merge composition, finite differences in float64;
// bad inputs; dropout; CausalSelfAttention built on it; the attention backend switch.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "gradcheck.h"
#include "tessera/core/settings.h"
#include "tessera/nn/nn.h"

namespace tessera {
namespace {

using testing::gradcheck;
using testing::error_of;
using testing::leaf;
using testing::random_f64;
using Xs = std::vector<Tensor>;

// Causal attention with plain loops in double, indexing qkv [B, T, 3C] directly: q of head h
// is channels [h D, h D + D), k the same plus C, v plus 2C. Returns y [B, T, C] row-major.
std::vector<double> loop_reference(const Tensor& qkv, int64_t n_head) {
  const auto x = testing::detail::values(qkv);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / n_head;
  auto at = [&](int64_t b, int64_t t, int64_t channel) { return x[(b * T + t) * 3 * C + channel]; };
  std::vector<double> y(B * T * C, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < n_head; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += at(b, i, h * D + d) * at(b, j, C + h * D + d);
          s[j] = dot / std::sqrt(double(D));
          mx = std::max(mx, s[j]);
        }
        double total = 0;
        for (double& e : s) total += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < D; ++d)
            y[(b * T + i) * C + h * D + d] += s[j] / total * at(b, j, 2 * C + h * D + d);
      }
  return y;
}

// The composition causal_attention_qkv stands for, written out here.
Tensor composed(const Tensor& qkv, int64_t n_head, double dropout_p = 0, Generator* gen = nullptr) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  const auto parts = split(qkv, C, -1);
  auto heads = [&](const Tensor& t) { return t.reshape({B, T, n_head, C / n_head}).transpose(1, 2); };
  return scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), true,
                                      dropout_p, gen)
      .transpose(1, 2)
      .reshape({B, T, C});
}

// qkv [B, T, 3C] as a non-contiguous view: the transpose of a [T, B, 3C] tensor.
Tensor strided_qkv(int64_t B, int64_t T, int64_t C, uint64_t seed) {
  Tensor t = random_f64({T, B, 3 * C}, seed).transpose(0, 1);
  EXPECT_TRUE(B == 1 || T == 1 || !t.is_contiguous());
  return t;
}

struct Case {
  int64_t B, T, H, D;
};

TEST(AttentionQkv, MatchesLoopReferenceAndComposition) {
  for (Case c : {Case{2, 7, 3, 5}, Case{1, 1, 1, 4}, Case{3, 33, 2, 3}, Case{1, 17, 4, 1}}) {
    SCOPED_TRACE(::testing::Message() << "B " << c.B << " T " << c.T << " H " << c.H << " D " << c.D);
    const int64_t C = c.H * c.D;
    for (const Tensor& qkv : {random_f64({c.B, c.T, 3 * C}, 1), strided_qkv(c.B, c.T, C, 2)}) {
      EXPECT_FALSE(attention_qkv_takes(qkv, c.H));  // CPU: always composed
      const Tensor y = causal_attention_qkv(qkv, c.H);
      ASSERT_EQ(y.shape(), (Shape{c.B, c.T, C}));
      EXPECT_EQ(y.dtype(), DType::f64);
      const auto got = testing::detail::values(y);
      const auto want = loop_reference(qkv, c.H);
      const auto comp = testing::detail::values(composed(qkv, c.H));
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-12) << "element " << i;
        ASSERT_EQ(got[i], comp[i]) << "element " << i;
      }
    }
  }
  // f32 too (the CPU training dtype), against the same reference.
  const Tensor qkv32 = random_f64({2, 9, 3 * 8}, 3).to(DType::f32);
  const auto got = testing::detail::values(causal_attention_qkv(qkv32, 2));
  const auto want = loop_reference(qkv32, 2);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << "element " << i;
}

TEST(AttentionQkv, GradientsMatchFiniteDifferences) {
  auto fn = [](int64_t H) { return [H](const Xs& x) { return causal_attention_qkv(x[0], H); }; };
  EXPECT_TRUE(gradcheck(fn(3), {leaf(random_f64({2, 7, 3 * 6}, 4))}));
  EXPECT_TRUE(gradcheck(fn(2), {leaf(strided_qkv(2, 5, 4, 5))})) << "non-contiguous qkv";
  EXPECT_TRUE(gradcheck(fn(1), {leaf(random_f64({1, 1, 3 * 3}, 6))})) << "one position";
  EXPECT_TRUE(gradcheck(fn(4), {leaf(random_f64({1, 3, 3 * 4}, 7))})) << "head size 1";
}

TEST(AttentionQkv, GradientEqualsTheComposition) {
  const Tensor a = leaf(random_f64({2, 7, 3 * 6}, 8)), b = leaf(random_f64({2, 7, 3 * 6}, 8));
  const Tensor w = random_f64({2, 7, 6}, 9);
  sum(causal_attention_qkv(a, 3) * w).backward();
  sum(composed(b, 3) * w).backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(testing::detail::values(a.grad()), testing::detail::values(b.grad()));
}

TEST(AttentionQkv, DropoutFollowsTheGenerator) {
  const Tensor qkv = random_f64({2, 7, 3 * 8}, 10);
  Generator g1(5), g2(5), g3(6);
  const auto a = testing::detail::values(causal_attention_qkv(qkv, 2, 0.5, &g1));
  const auto b = testing::detail::values(composed(qkv, 2, 0.5, &g2));
  const auto c = testing::detail::values(causal_attention_qkv(qkv, 2, 0.5, &g3));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, testing::detail::values(causal_attention_qkv(qkv, 2)));
}

TEST(AttentionQkv, BadInputsRaiseClearly) {
  const Tensor qkv = random_f64({2, 5, 3 * 6}, 11);
  EXPECT_NE(error_of([&] { causal_attention_qkv(random_f64({2, 5, 17}, 1), 1); }).find("[B, T, 3C]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { causal_attention_qkv(random_f64({5, 18}, 1), 1); }).find("[B, T, 3C]"),
            std::string::npos);
  const std::string not_dividing = error_of([&] { causal_attention_qkv(qkv, 4); });
  EXPECT_NE(not_dividing.find("n_head (4)"), std::string::npos) << not_dividing;
  EXPECT_NE(not_dividing.find("C = 6"), std::string::npos) << not_dividing;
  EXPECT_THROW(causal_attention_qkv(qkv, 0), Error);
  EXPECT_THROW(causal_attention_qkv(qkv, -2), Error);
  EXPECT_THROW(causal_attention_qkv(qkv, 2, 1.0), Error);
  EXPECT_THROW(causal_attention_qkv(qkv, 2, -0.1), Error);
  EXPECT_THROW(causal_attention_qkv(randint(0, 5, {2, 5, 18}, {.dtype = DType::i64}), 2), Error);
  EXPECT_FALSE(attention_qkv_takes(qkv, 4));
  EXPECT_FALSE(attention_qkv_takes(random_f64({5, 18}, 1), 1));
}

// CausalSelfAttention::forward (the reference) and the fast block's attention (on
// causal_attention_qkv) equal the projection, the composition and the output projection
// written out, and their KV-cache paths agree.
TEST(AttentionQkv, CausalSelfAttentionUsesIt) {
  const nn::GPTConfig cfg{.vocab_size = 11, .block_size = 9, .n_layer = 1, .n_head = 3, .n_embd = 12};
  Generator gen(12);
  nn::Block block(cfg, &gen, {.dtype = DType::f64});
  nn::CausalSelfAttention& attn = block.attn;
  nn::GPTFastBlock fast(block);
  const Tensor x = random_f64({2, 9, 12}, 13);
  const Tensor y = attn.forward(x);
  const Tensor want = attn.c_proj(composed(attn.c_attn(x), 3));
  EXPECT_EQ(testing::detail::values(y), testing::detail::values(want));
  EXPECT_EQ(testing::detail::values(fast.attention(x, false)), testing::detail::values(want));
  EXPECT_EQ(fast.fused_attention_calls(), 0);
  const auto full = testing::detail::values(y);
  for (bool fast_path : {false, true}) {
    SCOPED_TRACE(fast_path ? "fast" : "reference");
    nn::KVCache::Layer layer{zeros({2, 3, 9, 4}, {.dtype = DType::f64}), zeros({2, 3, 9, 4}, {.dtype = DType::f64})};
    auto step = [&](int64_t past, int64_t n) {
      const Tensor piece = x.narrow(1, past, n);
      return fast_path ? fast.attention_cached(piece, layer, past) : attn.forward(piece, &layer, past);
    };
    const Tensor first = step(0, 5), rest = step(5, 4);
    const auto cached = testing::detail::values(cat({first, rest}, 1));
    for (size_t i = 0; i < full.size(); ++i) ASSERT_NEAR(cached[i], full[i], 1e-12) << "element " << i;
  }
  EXPECT_THROW(attn.forward(random_f64({1, 10, 12}, 14)), Error);  // past block_size
  EXPECT_THROW(fast.attention(random_f64({1, 10, 12}, 14), false), Error);
}

TEST(AttentionBackendSwitch, ParsesNamesAndRejectsUnknownOnes) {
  EXPECT_EQ(parse_attention_backend("flash"), AttentionBackend::Flash);
  EXPECT_EQ(parse_attention_backend("cudnn"), AttentionBackend::Cudnn);
  EXPECT_EQ(parse_attention_backend("CuDNN"), AttentionBackend::Cudnn);
  EXPECT_STREQ(attention_backend_name(AttentionBackend::Flash), "flash");
  EXPECT_STREQ(attention_backend_name(AttentionBackend::Cudnn), "cudnn");
  const std::string message = error_of([] { parse_attention_backend("flashy", "TESSERA_ATTENTION"); });
  EXPECT_NE(message.find("TESSERA_ATTENTION"), std::string::npos) << message;
  EXPECT_NE(message.find("'flashy'"), std::string::npos) << message;
  EXPECT_NE(message.find("'cudnn'"), std::string::npos) << message;
  EXPECT_THROW(parse_attention_backend(""), Error);
}

TEST(AttentionBackendSwitch, ReadsTheEnvironmentAndCanBeSet) {
  AttentionBackendRestorer restore;
  const char* before = std::getenv("TESSERA_ATTENTION");
  const std::string saved_env = before ? before : "";
  ::setenv("TESSERA_ATTENTION", "cudnn", 1);
  EXPECT_EQ(attention_backend_from_environment(), AttentionBackend::Cudnn);
  ::setenv("TESSERA_ATTENTION", "Flash", 1);
  EXPECT_EQ(attention_backend_from_environment(), AttentionBackend::Flash);
  ::setenv("TESSERA_ATTENTION", "", 1);
  EXPECT_EQ(attention_backend_from_environment(), AttentionBackend::Flash);
  ::setenv("TESSERA_ATTENTION", "tensorrt", 1);
  EXPECT_NE(error_of([] { attention_backend_from_environment(); }).find("'tensorrt'"), std::string::npos);
  ::unsetenv("TESSERA_ATTENTION");
  EXPECT_EQ(attention_backend_from_environment(), AttentionBackend::Flash);
  if (before) ::setenv("TESSERA_ATTENTION", saved_env.c_str(), 1);

  set_attention_backend(AttentionBackend::Cudnn);
  EXPECT_EQ(attention_backend(), AttentionBackend::Cudnn);
  // The composed (CPU) path ignores the switch: it runs no fused kernel.
  const Tensor qkv = random_f64({1, 4, 3 * 4}, 15);
  EXPECT_EQ(testing::detail::values(causal_attention_qkv(qkv, 2)), testing::detail::values(composed(qkv, 2)));
  set_attention_backend(AttentionBackend::Flash);
  EXPECT_EQ(attention_backend(), AttentionBackend::Flash);
}

TEST(AttentionBackendSwitch, TheRestorerGivesTheChoiceBackToWhereItCameFrom) {
  ::unsetenv("TESSERA_ATTENTION");
  {
    AttentionBackendRestorer outer;  // the test leaves the process's choice as it found it
    clear_setting_option(Setting::Attention);
    set_attention_backend(AttentionBackend::Flash);
    clear_setting_option(Setting::Attention);
    ASSERT_EQ(setting_value(Setting::Attention).source, SettingSource::Default);
    {
      AttentionBackendRestorer restore;
      set_attention_backend(AttentionBackend::Cudnn);
      EXPECT_EQ(setting_value(Setting::Attention).source, SettingSource::Option);
    }
    // Left to the default again (masked attention tells the two apart), with its backend.
    EXPECT_EQ(setting_value(Setting::Attention).source, SettingSource::Default);
    EXPECT_EQ(attention_backend(), AttentionBackend::Flash);
    set_attention_backend(AttentionBackend::Cudnn);
    {
      AttentionBackendRestorer restore;
      set_attention_backend(AttentionBackend::Flash);
    }
    // Named before: named again.
    EXPECT_EQ(setting_value(Setting::Attention).source, SettingSource::Option);
    EXPECT_EQ(attention_backend(), AttentionBackend::Cudnn);
  }
}

}  // namespace
}  // namespace tessera
