// scaled_dot_product_attention with an attn_mask: against PyTorch
// (tests/autograd/masked_attention_reference.py: torch 1.13 has no SDPA, so the explicit
// softmax it documents) with boolean and additive masks, causal on top, grouped-query heads,
// odd lengths and rows with no key left (0, where the plain composition gives NaN), forward and
// backward; the padding invariance of a key-padding mask; and the errors for a bad mask.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>

#include "../nn/python_reference.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"

namespace tessera {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor leaf_randn(const Shape& shape, Generator& gen, double scale = 1.0) {
  Tensor t = ops::mul(randn(shape, {.dtype = DType::f32}, &gen), scale);
  t.requires_grad_(true);
  return t;
}

// [B, 1, 1, Tk] bool: key j of row b is a token when j < lengths[b].
Tensor key_padding(const std::vector<int64_t>& lengths, int64_t Tk) {
  std::vector<uint8_t> keep;
  for (int64_t n : lengths)
    for (int64_t j = 0; j < Tk; ++j) keep.push_back(j < n);
  const Tensor bytes = from_vector(keep, {int64_t(lengths.size()), 1, 1, Tk}, {.dtype = DType::u8});
  return ops::binary(BinaryOp::Ne, bytes, 0.0);
}

struct MaskCase {
  std::string name;
  int64_t B, H, Hkv, Tq, Tk, D;
  bool causal;
  std::function<Tensor(Generator&)> mask;
  bool has_empty_row;  // some query row has every key masked
};

std::vector<MaskCase> mask_cases() {
  return {
      {"key_padding", 2, 3, 3, 7, 7, 5, false,
       [](Generator&) {
         return key_padding({7, 3}, 7);
       },
       false},
      {"bool_full_with_empty_rows", 2, 2, 2, 5, 9, 3, false,
       [](Generator& g) {
         // Random keep pattern; query row 1 of batch 0 and row 4 of batch 1 keep no key.
         Tensor keep =
             ops::binary(BinaryOp::Gt, rand({2, 1, 5, 9}, {.dtype = DType::f32}, &g), 0.4);
         ops::fill_(ops::select(ops::select(ops::select(keep, 0, 0), 0, 0), 0, 1), 0.0);
         ops::fill_(ops::select(ops::select(ops::select(keep, 0, 1), 0, 0), 0, 4), 0.0);
         return keep;
       },
       true},
      {"additive_with_minus_inf", 1, 3, 3, 6, 5, 4, false,
       [](Generator& g) {
         // Per-head additive biases, some keys -inf, and query row 2 of head 1 all -inf.
         Tensor bias = randn({1, 3, 6, 5}, {.dtype = DType::f32}, &g);
         ops::fill_(ops::select(ops::select(ops::select(bias, 0, 0), 0, 0), 1, 3), -kInf);
         ops::fill_(ops::select(ops::select(ops::select(bias, 0, 0), 0, 1), 0, 2), -kInf);
         return bias;
       },
       true},
      {"causal_and_key_padding_gqa", 2, 4, 2, 5, 5, 3, true,
       // Row 1's first two keys are padding too (left padding): its first two queries, which
       // causally see only them, have no key left.
       [](Generator&) {
         Tensor keep = key_padding({5, 5}, 5);
         ops::fill_(ops::narrow(ops::select(keep, 0, 1), 2, 0, 2), 0.0);
         return keep;
       },
       true},
      {"causal_kv_cache_broadcast_mask", 1, 2, 1, 3, 8, 4, true,
       [](Generator&) { return key_padding({6}, 8); }, false},
  };
}

TEST(MaskedAttention, MatchesPyTorchForwardAndBackward) {
  if (!test::python_can_import("torch, numpy")) GTEST_SKIP() << "no torch for the reference";
  const auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "masked_attention";
  std::filesystem::create_directories(dir);
  struct Result {
    Tensor out, dq, dk, dv;
  };
  std::map<std::string, Result> results;
  std::vector<std::pair<std::string, Tensor>> files;
  std::string cases = "[";
  Generator gen(2024);
  for (const MaskCase& c : mask_cases()) {
    Tensor q = leaf_randn({c.B, c.H, c.Tq, c.D}, gen), k = leaf_randn({c.B, c.Hkv, c.Tk, c.D}, gen),
           v = leaf_randn({c.B, c.Hkv, c.Tk, c.D}, gen);
    const Tensor mask = c.mask(gen), dy = randn({c.B, c.H, c.Tq, c.D}, {.dtype = DType::f32}, &gen);
    Tensor out = scaled_dot_product_attention(q, k, v, mask, c.causal);
    out.backward(dy);
    results[c.name] = {out.detach(), q.grad(), k.grad(), v.grad()};
    for (const auto& [key, t] : {std::pair{"q", q.detach()},
                                 {"k", k.detach()},
                                 {"v", v.detach()},
                                 {"mask", mask},
                                 {"dy", dy}})
      files.emplace_back(c.name + "/" + key, t);
    cases += std::string(cases.size() > 1 ? ", " : "") + "{\"name\": \"" + c.name +
             "\", \"causal\": " + (c.causal ? "true" : "false") + "}";
  }
  std::ofstream((dir / "cases.json").string()) << cases + "]";
  save_safetensors((dir / "inputs.safetensors").string(), files);
  const std::string cmd = test::python_interpreter() +
                          " " TESSERA_SOURCE_DIR "/tests/autograd/masked_attention_reference.py " +
                          (dir / "cases.json").string() + " " +
                          (dir / "inputs.safetensors").string() + " " +
                          (dir / "ref.safetensors").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const SafetensorsContents ref = load_safetensors((dir / "ref.safetensors").string());
  for (const MaskCase& c : mask_cases()) {
    const Result& r = results[c.name];
    EXPECT_LT(ops::max_rel_error(r.out, ref.at(c.name + "/out")), 1e-5) << c.name;
    for (const auto& [key, grad] : {std::pair{"dq", r.dq}, {"dk", r.dk}, {"dv", r.dv}}) {
      ASSERT_TRUE(grad.defined()) << c.name << " " << key;
      EXPECT_EQ(
          ops::sum(ops::unary(UnaryOp::LogicalNot, ops::binary(BinaryOp::Eq, grad, grad))).item(),
          0)
          << c.name << ": NaN in " << key;
      EXPECT_LT(ops::max_rel_error(grad, ref.at(c.name + "/" + key)), 1e-5) << c.name << " " << key;
    }
    // Against the plain composition (torch 1.13): the same wherever it is a number; 0 where
    // it gives NaN, which is exactly the rows with no key.
    const std::vector<float> naive = ref.at(c.name + "/naive_out").to_vector<float>();
    const std::vector<float> mine = r.out.contiguous().to_vector<float>();
    int64_t nan_count = 0;
    for (size_t i = 0; i < naive.size(); ++i) {
      if (std::isnan(naive[i])) {
        ++nan_count;
        EXPECT_EQ(mine[i], 0.0f) << c.name << " element " << i;
      } else {
        EXPECT_NEAR(mine[i], naive[i], 1e-5 * (1 + std::abs(naive[i])))
            << c.name << " element " << i;
      }
    }
    EXPECT_EQ(nan_count > 0, c.has_empty_row) << c.name;
  }
}

// The same sequences with and without k trailing pad tokens (holding large garbage) under a
// key-padding mask: the real queries' outputs and every real position's gradient agree to
// fp32 rounding, and the pad positions get no gradient.
TEST(MaskedAttention, PaddingChangesNothingForRealTokens) {
  const int64_t B = 2, H = 3, T = 5, pad = 4, D = 6;
  Generator gen(7);
  const Tensor q = randn({B, H, T, D}, {.dtype = DType::f32}, &gen),
               k = randn({B, H, T, D}, {.dtype = DType::f32}, &gen),
               v = randn({B, H, T, D}, {.dtype = DType::f32}, &gen),
               dy = randn({B, H, T, D}, {.dtype = DType::f32}, &gen);
  auto padded = [&](const Tensor& x) {
    Tensor garbage = ops::mul(randn({B, H, pad, D}, {.dtype = DType::f32}, &gen), 1e3);
    Tensor t = ops::cat({x, garbage}, 2);
    t.requires_grad_(true);
    return t;
  };
  Tensor q0 = q.clone(), k0 = k.clone(), v0 = v.clone();
  for (Tensor* t : {&q0, &k0, &v0}) t->requires_grad_(true);
  Tensor out0 = scaled_dot_product_attention(q0, k0, v0, key_padding({T, T}, T));
  out0.backward(dy);
  Tensor q1 = padded(q), k1 = padded(k), v1 = padded(v);
  Tensor out1 = scaled_dot_product_attention(q1, k1, v1, key_padding({T, T}, T + pad));
  // The loss reads only the real queries (as a model's does through its pooled token).
  out1.backward(ops::cat({dy, zeros({B, H, pad, D}, {.dtype = DType::f32})}, 2));
  auto real = [&](const Tensor& t) { return ops::narrow(t, 2, 0, T); };
  auto pads = [&](const Tensor& t) { return ops::narrow(t, 2, T, pad); };
  EXPECT_LT(ops::max_rel_error(real(out1), out0), 1e-6);
  EXPECT_LT(ops::max_rel_error(real(q1.grad()), q0.grad()), 1e-6);
  EXPECT_LT(ops::max_rel_error(real(k1.grad()), k0.grad()), 1e-6);
  EXPECT_LT(ops::max_rel_error(real(v1.grad()), v0.grad()), 1e-6);
  for (const Tensor& g : {q1.grad(), k1.grad(), v1.grad()})
    EXPECT_EQ(ops::amax(ops::unary(UnaryOp::Abs, pads(g))).item(), 0.0);
}

TEST(MaskedAttention, AnUndefinedMaskIsTheUnmaskedCall) {
  Generator gen(3);
  const Tensor q = randn({1, 2, 4, 3}, {.dtype = DType::f32}, &gen),
               k = randn({1, 2, 6, 3}, {.dtype = DType::f32}, &gen),
               v = randn({1, 2, 6, 3}, {.dtype = DType::f32}, &gen);
  const Tensor masked = scaled_dot_product_attention(q, k, v, Tensor(), true);
  EXPECT_EQ(ops::max_rel_error(masked, scaled_dot_product_attention(q, k, v, true)), 0.0);
  // An all-true mask gives the unmasked result up to rounding.
  const Tensor all = ops::binary(BinaryOp::Eq, zeros({1, 1, 1, 6}), 0.0);
  EXPECT_LT(ops::max_rel_error(scaled_dot_product_attention(q, k, v, all, true),
                               scaled_dot_product_attention(q, k, v, true)),
            1e-6);
}

TEST(MaskedAttention, BadMasksAreRefusedNamingTheProblem) {
  const Tensor q = zeros({2, 2, 4, 3}), k = zeros({2, 2, 5, 3}), v = zeros({2, 2, 5, 3});
  auto message = [&](const Tensor& mask) {
    try {
      scaled_dot_product_attention(q, k, v, mask);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(zeros({2, 1, 1, 4})).find("does not broadcast"), std::string::npos);
  EXPECT_NE(message(zeros({3, 1, 4, 5})).find("does not broadcast"), std::string::npos);
  EXPECT_NE(message(zeros({1, 1, 1, 1, 5})).find("does not broadcast"), std::string::npos);
  EXPECT_NE(message(zeros({2, 1, 1, 5}, {.dtype = DType::f64})).find("must be bool"),
            std::string::npos);
  EXPECT_NE(message(zeros({2, 1, 1, 5}, {.dtype = DType::i64})).find("must be bool"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera
