// The hand-written flash kernels beyond causal self-attention (flash_masked_attention_*,
// kernels/cuda/fused.h): bidirectional attention and keys padded on the right, causal or not,
// through key_padded_attention and scaled_dot_product_attention. Every case is checked against
// the CPU composition in float64 (the same inputs, rounded to the kernels' dtype first) and
// prints its max errors, so one run on a GPU tells everything: f16 and bf16, head sizes 64 and
// 128, odd lengths, grouped-query heads, q, k, v read through strided views, random lengths
// with a row of length 0 and a full row. Padded keys get exactly zero dk, dv, a row of length 0
// exactly zero outputs and dq, and what the padded keys and values hold (NaN here) changes no
// bit of any output or gradient. The autograd node's name says which kernels ran.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {
namespace {

using cuda_test::dev;
using cuda_test::expect_within;
using cuda_test::host_randn;
using cuda_test::host_values;
using cuda_test::tolerance;

constexpr const char* kFlashNode = "FlashMaskedAttentionBackward";

struct Problem {
  DType dtype;
  int64_t B, H, Hkv, T, D;
  bool causal;
  std::vector<int32_t> lengths;  // [B]; empty: no padding (plain scaled_dot_product_attention)

  std::string str() const {
    std::string s = std::string(dtype_name(dtype)) + " B " + std::to_string(B) + " H " +
                    std::to_string(H) + "/" + std::to_string(Hkv) + " T " + std::to_string(T) +
                    " D " + std::to_string(D) + (causal ? " causal" : " bidirectional") +
                    " lengths";
    for (int32_t n : lengths) s += " " + std::to_string(n);
    return s;
  }
};

// Lengths for B rows of T keys: one full row, one of length 0, the others random in [1, T].
std::vector<int32_t> random_lengths(int64_t B, int64_t T, Generator& gen) {
  std::vector<int32_t> lengths(B);
  for (int64_t b = 0; b < B; ++b) {
    const double u = uniform({1}, 0.0, 1.0, {.dtype = DType::f64}, &gen).item();
    lengths[b] = 1 + static_cast<int32_t>(std::min<double>(u * T, T - 1));
  }
  lengths[0] = static_cast<int32_t>(T);
  if (B > 1) lengths[1] = 0;
  return lengths;
}

// Host inputs in the problem's dtype: q [B, T, H, D], k and v [B, T, Hkv, D] (the projections'
// layout: their [B, H, T, D] heads are strided views) and the output's gradient [B, H, T, D].
struct Inputs {
  Tensor q, k, v, dout;
};
Inputs random_inputs(const Problem& p) {
  return {host_randn({p.B, p.T, p.H, p.D}, p.dtype), host_randn({p.B, p.T, p.Hkv, p.D}, p.dtype),
          host_randn({p.B, p.T, p.Hkv, p.D}, p.dtype), host_randn({p.B, p.H, p.T, p.D}, p.dtype)};
}

// The key-padding mask [B, 1, 1, T] (true = attend) and the lengths of p on `where`.
Tensor padding_mask(const Problem& p, Device where) {
  std::vector<uint8_t> keep(static_cast<size_t>(p.B * p.T), 0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t j = 0; j < p.lengths[b]; ++j) keep[b * p.T + j] = 1;
  return raw::to(from_vector(keep, {p.B, 1, 1, p.T}, {.dtype = DType::u8}), where, DType::boolean);
}

// out [B, H, T, D] and the gradients of q, k, v ([B, T, H(kv), D], the leaves' layout), as
// doubles, and the name of the node the forward recorded.
struct Results {
  std::vector<double> out, dq, dk, dv;
  std::string node;
};
Results run(const Problem& p, const Inputs& in, Device where, DType dtype) {
  auto leaf = [&](const Tensor& h) { return cuda_test::requiring_grad(raw::to(h, where, dtype)); };
  const Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  auto heads = [](const Tensor& x) { return x.transpose(1, 2); };
  Tensor out;
  if (p.lengths.empty()) {
    out = scaled_dot_product_attention(heads(q), heads(k), heads(v), p.causal);
  } else {
    const Tensor kv_lengths =
        raw::to(from_vector(p.lengths, {p.B}, {.dtype = DType::i32}), where, DType::i32);
    out = key_padded_attention(heads(q), heads(k), heads(v), padding_mask(p, where), kv_lengths,
                               p.causal);
  }
  const std::string node = autograd::meta_of(out).grad_fn->name;
  out.backward(raw::to(in.dout, where, dtype));
  return {host_values(out), host_values(q.grad()), host_values(k.grad()), host_values(v.grad()),
          node};
}

// Compares the GPU's results with the float64 composition's, printing each max error. Errors
// are relative to the reference's largest value, or to 1 (the size of the N(0, 1) inputs and of
// the gradients they give) where that is smaller: with a single key (T = 1) dq and dk are exactly
// 0 in float64 and a rounding residue of 1e-6 on the GPU.
void expect_matches(const Results& gpu, const Results& ref, DType dtype) {
  const double tol = tolerance(dtype);
  expect_within(gpu.out, ref.out, tol, "out", 1.0);
  expect_within(gpu.dq, ref.dq, 2 * tol, "dq", 1.0);
  expect_within(gpu.dk, ref.dk, 2 * tol, "dk", 1.0);
  expect_within(gpu.dv, ref.dv, 2 * tol, "dv", 1.0);
}

// The exact zeros the masking promises: a row of length 0 has out = 0 and dq = 0, and every
// key at j >= length gets dk = dv = 0 (in [B, T, Hkv, D] order).
void expect_exact_zeros(const Problem& p, const Results& gpu) {
  const int64_t HD = p.H * p.D, HkvD = p.Hkv * p.D;
  for (int64_t b = 0; b < p.B; ++b) {
    if (p.lengths[b] == 0) {
      for (int64_t e = 0; e < p.H * p.T * p.D; ++e)
        ASSERT_EQ(gpu.out[b * p.H * p.T * p.D + e], 0.0) << "out of empty row " << b;
      for (int64_t e = 0; e < p.T * HD; ++e)
        ASSERT_EQ(gpu.dq[b * p.T * HD + e], 0.0) << "dq of empty row " << b;
    }
    for (int64_t j = p.lengths[b]; j < p.T; ++j)
      for (int64_t e = 0; e < HkvD; ++e) {
        ASSERT_EQ(gpu.dk[(b * p.T + j) * HkvD + e], 0.0)
            << "dk of padded key " << j << " row " << b;
        ASSERT_EQ(gpu.dv[(b * p.T + j) * HkvD + e], 0.0)
            << "dv of padded key " << j << " row " << b;
      }
  }
}

// p on the GPU against the float64 composition on the CPU, printing the problem and the max
// errors; the flash kernels must have run, and the masking's exact zeros hold.
void check_against_the_composition(const Problem& p) {
  SCOPED_TRACE(p.str());
  std::printf("%s\n", p.str().c_str());
  const Inputs in = random_inputs(p);
  const Results gpu = run(p, in, dev(), p.dtype);
  EXPECT_EQ(gpu.node, kFlashNode);
  expect_matches(gpu, run(p, in, Device::cpu(), DType::f64), p.dtype);
  if (!p.lengths.empty()) expect_exact_zeros(p, gpu);
}

TEST(FlashMaskedAttention, MatchesTheFloat64CompositionWithPaddedKeys) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Flash);
  Generator gen(40);
  for (DType dtype : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {1, 37, 129, 1000})
        for (bool causal : {false, true}) {
          // Grouped-query heads for the short sequences, plain heads for the long one.
          const int64_t H = T < 1000 ? 4 : 2, Hkv = 2;
          check_against_the_composition(
              {dtype, 4, H, Hkv, T, D, causal, random_lengths(4, T, gen)});
        }
}

// Bidirectional attention without a mask (scaled_dot_product_attention(causal = false)) takes
// the same kernels.
TEST(FlashMaskedAttention, UnmaskedBidirectionalAttentionRunsTheFlashKernels) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Flash);
  for (DType dtype : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128}) check_against_the_composition({dtype, 2, 3, 1, 200, D, false, {}});
}

// k and v with every padded key and value replaced by NaN: no bit of the outputs nor of any
// gradient changes (the kernels never read past a row's length), and padded keys still get 0.
TEST(FlashMaskedAttention, WhatThePaddingHoldsChangesNothing) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Flash);
  Generator gen(41);
  for (int64_t D : {64, 128})
    for (int64_t T : {129, 1000})
      for (bool causal : {false, true}) {
        const Problem p{DType::bf16, 3, 4, 2, T, D, causal, random_lengths(3, T, gen)};
        SCOPED_TRACE(p.str());
        const Inputs in = random_inputs(p);
        Inputs poisoned = in;
        for (Tensor* t : {&poisoned.k, &poisoned.v}) {
          std::vector<double> x = host_values(*t);
          const int64_t row = p.Hkv * p.D;  // elements of one key position
          for (int64_t b = 0; b < p.B; ++b)
            for (int64_t j = p.lengths[b]; j < p.T; ++j)
              for (int64_t e = 0; e < row; ++e)
                x[(b * p.T + j) * row + e] = std::numeric_limits<double>::quiet_NaN();
          *t = from_vector(x, t->shape(), {.dtype = p.dtype});
        }
        const Results clean = run(p, in, dev(), p.dtype), dirty = run(p, poisoned, dev(), p.dtype);
        EXPECT_EQ(dirty.node, kFlashNode);
        EXPECT_EQ(dirty.out, clean.out);
        EXPECT_EQ(dirty.dq, clean.dq);
        EXPECT_EQ(dirty.dk, clean.dk);
        EXPECT_EQ(dirty.dv, clean.dv);
        expect_exact_zeros(p, dirty);
      }
}

// The kernel entries themselves: lse is the float64 log-sum-exp over the attended keys, +inf
// for a row of length 0 (whose outputs are 0); plain causal attention through the masked entry
// is the dispatching flash_attention_forward, bit for bit; bad lengths are refused.
TEST(FlashMaskedAttention, KernelEntriesWriteTheLogSumExp) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 3, H = 2, T = 77, D = 64;
  Generator gen(42);
  const std::vector<int32_t> lengths = random_lengths(B, T, gen);
  const Tensor q_h = host_randn({B, H, T, D}, DType::bf16),
               k_h = host_randn({B, H, T, D}, DType::bf16),
               v_h = host_randn({B, H, T, D}, DType::bf16);
  const Tensor q = raw::to(q_h, dev(), DType::bf16), k = raw::to(k_h, dev(), DType::bf16),
               v = raw::to(v_h, dev(), DType::bf16);
  const Tensor kv_lengths =
      raw::to(from_vector(lengths, {B}, {.dtype = DType::i32}), dev(), DType::i32);
  const double scale = 1.0 / std::sqrt(double(D));
  const std::vector<double> qv = host_values(q_h), kv = host_values(k_h);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    Tensor out = cuda_test::poisoned({B, H, T, D}, DType::bf16);
    Tensor lse = cuda_test::poisoned({B, H, T}, DType::f32);
    cuda::flash_masked_attention_forward(q, k, v, scale, causal, kv_lengths, out, lse);
    std::vector<double> want(B * H * T);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < T; ++i) {
          double sum = 0;
          const int64_t end = causal ? std::min<int64_t>(i + 1, lengths[b]) : lengths[b];
          for (int64_t j = 0; j < end; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < D; ++d)
              dot += qv[((b * H + h) * T + i) * D + d] * kv[((b * H + h) * T + j) * D + d];
            sum += std::exp(dot * scale);
          }
          want[(b * H + h) * T + i] = end == 0 ? INFINITY : std::log(sum);
        }
    const std::vector<double> got = host_values(lse);
    std::vector<double> finite_got, finite_want;
    for (size_t e = 0; e < want.size(); ++e) {
      if (std::isinf(want[e])) {
        ASSERT_EQ(got[e], want[e]) << "lse " << e;
      } else {
        finite_got.push_back(got[e]);
        finite_want.push_back(want[e]);
      }
    }
    expect_within(finite_got, finite_want, 1e-3, causal ? "lse (causal)" : "lse (bidirectional)");
    for (double x : host_values(raw::select(out, 0, 1)))
      ASSERT_EQ(x, 0.0) << "out of the empty row";
  }
  // Causal without lengths: the dispatching entry's bits (the Hopper kernel where it runs).
  Tensor out_a = cuda_test::poisoned({B, H, T, D}, DType::bf16),
         lse_a = cuda_test::poisoned({B, H, T}, DType::f32);
  Tensor out_b = cuda_test::poisoned({B, H, T, D}, DType::bf16),
         lse_b = cuda_test::poisoned({B, H, T}, DType::f32);
  cuda::flash_masked_attention_forward(q, k, v, scale, true, Tensor(), out_a, lse_a);
  cuda::flash_attention_forward(q, k, v, scale, out_b, lse_b);
  EXPECT_EQ(host_values(out_a), host_values(out_b));
  EXPECT_EQ(host_values(lse_a), host_values(lse_b));
  // Lengths of the wrong dtype or size are refused before any work.
  Tensor out = cuda_test::poisoned({B, H, T, D}, DType::bf16),
         lse = cuda_test::poisoned({B, H, T}, DType::f32);
  const Tensor as_i64 = raw::to(kv_lengths, dev(), DType::i64);
  EXPECT_THROW(cuda::flash_masked_attention_forward(q, k, v, scale, false, as_i64, out, lse),
               Error);
  EXPECT_THROW(cuda::flash_masked_attention_forward(q, k, v, scale, false,
                                                    raw::narrow(kv_lengths, 0, 0, 2), out, lse),
               Error);
}

// Under the cudnn backend the same calls run cuDNN's masked graphs (the one choice, made by
// TESSERA_ATTENTION / set_attention_backend as for causal attention).
TEST(FlashMaskedAttention, TheCudnnBackendRunsCudnnsMaskedGraphs) {
  TESSERA_REQUIRE_GPU();
  const FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  if (!fused.cudnn_masked_attention_available || !fused.cudnn_masked_attention_available(nullptr))
    GTEST_SKIP() << "cuDNN masked attention is not available";
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Cudnn);
  Generator gen(43);
  std::vector<int32_t> lengths = random_lengths(3, 64, gen);
  lengths[1] = 5;  // cuDNN takes lengths of at least 1
  const Problem p{DType::bf16, 3, 2, 2, 64, 64, /*causal=*/false, lengths};
  const Results gpu = run(p, random_inputs(p), dev(), p.dtype);
  EXPECT_EQ(gpu.node, "CudnnMaskedAttentionBackward");
}

// Dropout with padded keys (BERT fine-tuning's attention, dropout 0.1): the kernels
// (key_padded_attention with kv_lengths) against the composition on the same GPU from the same
// generator state (the same mask without kv_lengths composes), forward and backward, under every
// backend built (cuDNN draws no dropout of Tessera's generator, so the kernels run there too); both
// routes leave the generator in the same state, and the dropout does drop (the outputs differ
// from p = 0's).
TEST(FlashMaskedAttention, DropoutWithPaddedKeysMatchesTheComposedDropout) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  Generator lengths_gen(44);
  // The p = 0 route under the cudnn backend runs cuDNN's masked graphs, which a build without
  // the cuDNN frontend refuses to choose: that backend is tested where it exists.
  const FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  std::vector<AttentionBackend> backends = {AttentionBackend::Flash};
  if (fused.cudnn_masked_attention_available && fused.cudnn_masked_attention_available(nullptr))
    backends.push_back(AttentionBackend::Cudnn);
  for (AttentionBackend backend : backends)
    for (int64_t D : {64, 128})
      for (bool causal : {false, true}) {
        set_attention_backend(backend);
        const Problem p{DType::bf16, 3, 4, 2, 97, D, causal, random_lengths(3, 97, lengths_gen)};
        SCOPED_TRACE(p.str());
        const Inputs in = random_inputs(p);
        const Tensor kv_lengths =
            raw::to(from_vector(p.lengths, {p.B}, {.dtype = DType::i32}), dev(), DType::i32);
        std::vector<std::vector<double>> results[3];
        uint64_t offsets[2] = {0, 0};
        for (int route = 0; route < 3; ++route) {  // kernels, composition, kernels with p = 0
          Generator gen(2025);
          gen.reserve(7);  // a draw that starts past zero
          auto leaf = [&](const Tensor& h) { return cuda_test::requiring_grad(raw::to(h, dev(), p.dtype)); };
          const Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
          const Tensor out = key_padded_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  padding_mask(p, dev()), route == 1 ? Tensor() : kv_lengths,
                                                  p.causal, route == 2 ? 0.0 : 0.1, &gen);
          if (route == 0) EXPECT_EQ(autograd::meta_of(out).grad_fn->name, "FlashMaskedAttentionDropoutBackward");
          out.backward(raw::to(in.dout, dev(), p.dtype));
          if (route < 2) offsets[route] = gen.offset();
          results[route] = {host_values(out), host_values(q.grad()), host_values(k.grad()),
                            host_values(v.grad())};
        }
        EXPECT_EQ(offsets[0], offsets[1]) << "both routes reserve the same Philox blocks";
        const char* names[] = {"out", "dq", "dk", "dv"};
        for (int i = 0; i < 4; ++i)
          expect_within(results[0][i], results[1][i], (i == 0 ? 2 : 4) * tolerance(p.dtype),
                        std::string(names[i]) + ", kernels vs composed dropout", 1.0);
        double moved = 0;
        for (size_t e = 0; e < results[0][0].size(); ++e)
          moved = std::max(moved, std::abs(results[0][0][e] - results[2][0][e]));
        EXPECT_GT(moved, 0.05) << "dropout 0.1 changes the outputs";
      }
}

}  // namespace
}  // namespace tessera
