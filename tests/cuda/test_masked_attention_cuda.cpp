// Masked attention on a GPU. A general mask (here left padding under causal, which leaves
// rows with no key) takes the composed path: the result and the gradients match the CPU's
// masked composition of the same inputs, a row with no key left is exactly 0 and masked keys
// get no gradient. Keys padded on the right with their lengths (key_padded_attention) and
// unmasked non-causal attention run the fused masked kernels: here cuDNN's, under the cudnn
// backend (test_flash_masked_attention.cpp tests the hand-written ones, the default); they match
// the CPU composition, padded keys get no gradient, and what the padded keys hold changes no
// output.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/nn/bert.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::host_randn;
using cuda_test::host_values;

TEST(CudaMaskedAttention, TakesTheComposedPathWhereFlashWouldApply) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 2, H = 2, T = 33, D = 64;
  std::vector<Tensor> host, device;
  for (int i = 0; i < 4; ++i) host.push_back(host_randn({B, H, T, D}, DType::bf16));
  ASSERT_TRUE(attention_takes(raw::to(host[0], dev(), DType::bf16),
                              raw::to(host[1], dev(), DType::bf16),
                              raw::to(host[2], dev(), DType::bf16), true));
  // Row 1 is left-padded by 5: its first 5 queries see only padding under causal.
  std::vector<uint8_t> keep(B * T, 1);
  for (int64_t j = 0; j < 5; ++j) keep[T + j] = 0;
  const Tensor mask_host = ops::binary(
      BinaryOp::Ne, from_vector(keep, {B, 1, 1, T}, {.dtype = DType::u8}), 0.0);
  auto run = [&](Device where, DType dtype) {
    std::vector<Tensor> qkv;
    for (int i = 0; i < 3; ++i) {
      qkv.push_back(raw::to(host[i], where, dtype));
      qkv.back().requires_grad_(true);
    }
    const Tensor mask = raw::to(mask_host, where, DType::boolean);
    Tensor out = scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], mask, /*causal=*/true);
    out.backward(raw::to(host[3], where, dtype));
    return std::vector<Tensor>{out, qkv[0].grad(), qkv[1].grad(), qkv[2].grad()};
  };
  const std::vector<Tensor> gpu = run(dev(), DType::bf16), cpu = run(Device::cpu(), DType::f32);
  for (size_t i = 0; i < gpu.size(); ++i) {
    const std::vector<double> g = host_values(gpu[i]), c = host_values(cpu[i]);
    double worst = 0, scale = 0;
    for (size_t e = 0; e < g.size(); ++e) {
      worst = std::max(worst, std::abs(g[e] - c[e]));
      scale = std::max(scale, std::abs(c[e]));
    }
    EXPECT_LT(worst, 3e-2 * scale) << "output/dq/dk/dv " << i;
  }
  // The 5 queries of row 1 with no key: exactly 0, as on the CPU.
  const std::vector<double> out = host_values(raw::narrow(raw::select(gpu[0], 0, 1), 1, 0, 5));
  for (double x : out) EXPECT_EQ(x, 0.0);
  // Masked keys (row 1's first 5) get no gradient.
  for (int which : {2, 3})
    for (double x : host_values(raw::narrow(raw::select(gpu[which], 0, 1), 1, 0, 5)))
      EXPECT_EQ(x, 0.0);
}

// The largest |gpu - cpu| of each tensor against 3e-2 of the CPU's largest |value| (bf16).
void expect_close_to_cpu(const std::vector<Tensor>& gpu, const std::vector<Tensor>& cpu) {
  for (size_t i = 0; i < gpu.size(); ++i) {
    const std::vector<double> g = host_values(gpu[i]), c = host_values(cpu[i]);
    ASSERT_EQ(g.size(), c.size());
    double worst = 0, scale = 0;
    for (size_t e = 0; e < g.size(); ++e) {
      worst = std::max(worst, std::abs(g[e] - c[e]));
      scale = std::max(scale, std::abs(c[e]));
    }
    EXPECT_LT(worst, 3e-2 * scale) << "output/dq/dk/dv " << i;
  }
}

bool cudnn_masked_available() {
  const FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  return fused.cudnn_masked_attention_available && fused.cudnn_masked_attention_available(nullptr);
}

// out and the gradients of q, k, v of key_padded_attention on `where`, or of the unmasked
// call when lengths is empty; k, v have Hkv heads (grouped-query attention).
struct PaddedRun {
  std::vector<Tensor> results;
  std::string backward_name;
};
PaddedRun padded_run(const std::vector<Tensor>& host, const std::vector<int32_t>& lengths, bool causal,
                     Device where, DType dtype) {
  std::vector<Tensor> qkv;
  for (int i = 0; i < 3; ++i) {
    qkv.push_back(raw::to(host[i], where, dtype));
    qkv.back().requires_grad_(true);
  }
  Tensor out;
  if (lengths.empty()) {
    out = scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], causal);
  } else {
    const int64_t B = host[0].size(0), T = host[0].size(2);
    std::vector<uint8_t> keep(static_cast<size_t>(B * T), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < lengths[b]; ++j) keep[b * T + j] = 1;
    const Tensor mask = raw::to(from_vector(keep, {B, 1, 1, T}, {.dtype = DType::u8}), where, DType::boolean);
    const Tensor kv_lengths = raw::to(from_vector(lengths, {B}, {.dtype = DType::i32}), where, DType::i32);
    out = key_padded_attention(qkv[0], qkv[1], qkv[2], mask, kv_lengths, causal);
  }
  const std::string name = autograd::meta_of(out).grad_fn->name;
  out.backward(raw::to(host[3], where, dtype));
  return {{out, qkv[0].grad(), qkv[1].grad(), qkv[2].grad()}, name};
}

TEST(CudaMaskedAttention, RightPaddedKeysRunCudnnAndMatchTheComposition) {
  TESSERA_REQUIRE_GPU();
  if (!cudnn_masked_available()) GTEST_SKIP() << "cuDNN masked attention is not available";
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Cudnn);
  const int64_t B = 3, H = 4, Hkv = 2, T = 77;
  const std::vector<int32_t> lengths{77, 40, 1};
  for (int64_t D : {64, 128}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("D " + std::to_string(D) + (causal ? " causal" : " bidirectional"));
      std::vector<Tensor> host{host_randn({B, H, T, D}, DType::bf16), host_randn({B, Hkv, T, D}, DType::bf16),
                               host_randn({B, Hkv, T, D}, DType::bf16), host_randn({B, H, T, D}, DType::bf16)};
      const PaddedRun gpu = padded_run(host, lengths, causal, dev(), DType::bf16);
      EXPECT_EQ(gpu.backward_name, "CudnnMaskedAttentionBackward");
      expect_close_to_cpu(gpu.results, padded_run(host, lengths, causal, Device::cpu(), DType::f32).results);
      // Padded keys get no gradient.
      for (int which : {2, 3})
        for (int64_t b = 0; b < B; ++b)
          for (double x : host_values(raw::narrow(raw::select(gpu.results[which], 0, b), 1, lengths[b],
                                                  T - lengths[b])))
            ASSERT_EQ(x, 0.0) << "row " << b;
      // What the padded keys and values hold changes nothing.
      std::vector<Tensor> other = host;
      for (int i : {1, 2}) {
        std::vector<double> values = host_values(host[i]);
        const std::vector<double> noise = host_values(host_randn(host[i].shape(), DType::bf16));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t j = lengths[b]; j < T; ++j)
              for (int64_t d = 0; d < D; ++d) {
                const size_t at = static_cast<size_t>(((b * Hkv + h) * T + j) * D + d);
                values[at] = noise[at];
              }
        other[i] = from_vector(values, host[i].shape(), {.dtype = DType::bf16});
      }
      const PaddedRun changed = padded_run(other, lengths, causal, dev(), DType::bf16);
      for (int which : {0, 1})
        EXPECT_EQ(host_values(changed.results[which]), host_values(gpu.results[which])) << which;
    }
  }
}

TEST(CudaMaskedAttention, UnmaskedBidirectionalAttentionRunsCudnn) {
  TESSERA_REQUIRE_GPU();
  if (!cudnn_masked_available()) GTEST_SKIP() << "cuDNN masked attention is not available";
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Cudnn);
  const int64_t B = 2, H = 3, T = 130, D = 64;
  std::vector<Tensor> host;
  for (int i = 0; i < 4; ++i) host.push_back(host_randn({B, H, T, D}, DType::bf16));
  const PaddedRun gpu = padded_run(host, {}, /*causal=*/false, dev(), DType::bf16);
  EXPECT_EQ(gpu.backward_name, "CudnnMaskedAttentionBackward");
  expect_close_to_cpu(gpu.results, padded_run(host, {}, false, Device::cpu(), DType::f32).results);
}

// A BERT classifier in bf16 on the GPU over a right-padded batch: the logits of the CPU's f32
// model (the fused padded attention inside: the hand-written flash kernels, the default backend),
// and a row's logits do not depend on the padding of the others.
TEST(CudaMaskedAttention, BertOnAPaddedBatchMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  nn::BertConfig cfg;
  cfg.vocab_size = 97, cfg.hidden_size = 128, cfg.num_hidden_layers = 2, cfg.num_attention_heads = 2;
  cfg.intermediate_size = 256, cfg.max_position_embeddings = 64;
  cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0;
  cfg.labels.num_labels = 3;
  Generator cpu_gen(7), gpu_gen(7);  // the same initial weights
  nn::BertForSequenceClassification cpu_model(cfg, &cpu_gen);
  nn::BertForSequenceClassification gpu_model(cfg, &gpu_gen);
  gpu_model.to(dev(), DType::bf16);
  cpu_model.eval();
  gpu_model.eval();
  const int64_t B = 3, T = 29;
  const std::vector<int64_t> lengths{29, 17, 5};
  std::vector<int64_t> ids(B * T, 0), mask(B * T, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < lengths[b]; ++j) {
      ids[b * T + j] = 1 + (b * 31 + j * 7) % 96;
      mask[b * T + j] = 1;
    }
  const Tensor ids_cpu = from_vector(ids, {B, T}, {.dtype = DType::i64});
  const Tensor mask_cpu = from_vector(mask, {B, T}, {.dtype = DType::i64});
  autograd::NoGradGuard no_grad;
  const Tensor want = cpu_model.logits(ids_cpu, mask_cpu);
  const Tensor got = gpu_model.logits(raw::to(ids_cpu, dev(), DType::i64), raw::to(mask_cpu, dev(), DType::i64));
  expect_close_to_cpu({raw::to(got, Device::cpu(), DType::f32)}, {want});
}

}  // namespace
}  // namespace tessera
