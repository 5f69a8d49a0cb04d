// Attention without layout copies: causal_attention_qkv on the GPU against its float64
// composition on the CPU; the attention kernels writing out / dq / dk / dv through strided
// views (bitwise equal to contiguous outputs, nothing written outside the views); the checks
// on those views; the cuDNN backend against the flash one, or its refusal saying why.
#include <cmath>
#include <string>
#include <vector>

#include "tessera/autograd/functions.h"
#include "cuda_test_util.h"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {

using namespace cuda_test;

// The [B, H, T, D] heads of channels [which C, which C + C) of x [B, T, *], as a view.
Tensor heads(const Tensor& x, int64_t which, int64_t C, int64_t n_head) {
  const Tensor part = raw::narrow(x, 2, which * C, C);
  return raw::permute(raw::view(part, {x.size(0), x.size(1), n_head, C / n_head}), {0, 2, 1, 3});
}

// y and d(qkv) of causal attention in float64 on the CPU through the composed path (itself
// checked against loops and finite differences in tests/autograd/test_attention_qkv.cpp).
struct Reference {
  std::vector<double> y, dqkv;
};
Reference reference(const Tensor& qkv_host, const Tensor& dy_host, int64_t n_head) {
  const Tensor qkv = requiring_grad(raw::to(qkv_host, Device::cpu(), DType::f64));
  const Tensor y = causal_attention_qkv(qkv, n_head, 0.0, nullptr, /*allow_fused=*/false);
  autograd::backward({y}, {raw::to(dy_host, Device::cpu(), DType::f64)});
  return {host_values(y), host_values(qkv.grad())};
}

// y and d(qkv) of causal_attention_qkv on the GPU.
Reference on_gpu(const Tensor& qkv_host, const Tensor& dy_host, int64_t n_head) {
  const Tensor qkv = requiring_grad(to_gpu(qkv_host));
  EXPECT_TRUE(attention_qkv_takes(qkv, n_head));
  const Tensor y = causal_attention_qkv(qkv, n_head);
  EXPECT_EQ(autograd::meta_of(y).grad_fn->name, "CausalAttentionQkvBackward");
  EXPECT_EQ(y.shape(), (Shape{qkv.size(0), qkv.size(1), qkv.size(2) / 3}));
  autograd::backward({y}, {to_gpu(dy_host)});
  return {host_values(y), host_values(qkv.grad())};
}

struct Case {
  DType dtype;
  int64_t T, D;
};
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t T : {77, 256})
      for (int64_t D : {64, 128}) cases.push_back({t, T, D});
  return cases;
}
constexpr int64_t kB = 2, kH = 3;

TEST(AttentionQkvCuda, MatchesTheFloat64Composition) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Flash);
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.dtype) << " T " << c.T << " D " << c.D);
    const int64_t C = kH * c.D;
    const Tensor qkv_h = host_randn({kB, c.T, 3 * C}, c.dtype), dy_h = host_randn({kB, c.T, C}, c.dtype);
    const Reference want = reference(qkv_h, dy_h, kH), got = on_gpu(qkv_h, dy_h, kH);
    expect_close(got.y, want.y, tolerance(c.dtype), "y");
    expect_close(got.dqkv, want.dqkv, 2 * tolerance(c.dtype), "d(qkv)");
  }
}

// The incoming gradient read through a non-contiguous view as it is, and an expanded one
// (which the kernels cannot read) copied first: both give the right d(qkv).
TEST(AttentionQkvCuda, StridedAndExpandedOutputGradients) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Flash);
  const DType t = DType::bf16;
  const int64_t T = 77, D = 64, C = kH * D;
  const Tensor qkv_h = host_randn({kB, T, 3 * C}, t);
  const Tensor w_h = host_randn({T, kB, C}, t);  // the gradient of y.transpose(0, 1)
  for (bool expanded : {false, true}) {
    SCOPED_TRACE(expanded ? "expanded gradient" : "transposed gradient");
    const Tensor qkv = requiring_grad(to_gpu(qkv_h));
    const Tensor y = causal_attention_qkv(qkv, kH);
    Tensor dy_h;
    if (expanded) {
      sum(y).backward();  // dy: ones broadcast from a scalar
      dy_h = full({kB, T, C}, 1.0, {.dtype = t});
    } else {
      sum(y.transpose(0, 1) * to_gpu(w_h)).backward();  // dy: a [B, T, C] view with strides (C, B C, 1)
      dy_h = raw::contiguous(raw::transpose(w_h, 0, 1));
    }
    const Reference want = reference(qkv_h, dy_h, kH);
    expect_close(host_values(qkv.grad()), want.dqkv, 2 * tolerance(t), "d(qkv)");
  }
}

// Outputs as views into padded, NaN-poisoned buffers ([B, T, C + 8] for out, [B, T, 3C + 8]
// for dq | dk | dv): the same bits as contiguous outputs, the padding untouched.
TEST(AttentionQkvCuda, KernelsWriteThroughStridedViews) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f16}) {
    for (int64_t D : {64, 128}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " D " << D);
      const int64_t T = 77, C = kH * D, pad = 8;
      const double scale = 1.0 / std::sqrt(double(D));
      const Tensor qkv_h = host_randn({kB, T, 3 * C}, t), dy_h = host_randn({kB, T, C}, t);
      const Tensor qkv = to_gpu(qkv_h), dy = to_gpu(dy_h);
      const Tensor q = heads(qkv, 0, C, kH), k = heads(qkv, 1, C, kH), v = heads(qkv, 2, C, kH);
      const Shape bhtd{kB, kH, T, D}, bht{kB, kH, T};

      Tensor out_c = poisoned(bhtd, t), lse_c = poisoned(bht, DType::f32);
      cuda::flash_attention_forward(q, k, v, scale, out_c, lse_c);
      Tensor y_buf = poisoned({kB, T, C + pad}, t), lse_s = poisoned(bht, DType::f32);
      const Tensor out_s = heads(y_buf, 0, C, kH);
      ASSERT_FALSE(out_s.is_contiguous());
      cuda::flash_attention_forward(q, k, v, scale, out_s, lse_s);
      EXPECT_EQ(host_values(out_s), host_values(out_c)) << "out";
      EXPECT_EQ(host_values(lse_s), host_values(lse_c)) << "lse";
      const Reference want = reference(qkv_h, dy_h, kH);
      expect_close(host_values(raw::narrow(y_buf, 2, 0, C)), want.y, tolerance(t), "y through the view");
      for (double x : host_values(raw::narrow(y_buf, 2, C, pad))) ASSERT_TRUE(std::isnan(x)) << "out padding written";

      Tensor naive_buf = poisoned({kB, T, C + pad}, t), naive_lse = poisoned(bht, DType::f32);
      cuda::naive_attention_forward(q, k, v, scale, heads(naive_buf, 0, C, kH), naive_lse);
      expect_close(host_values(raw::narrow(naive_buf, 2, 0, C)), want.y, tolerance(t), "naive y");
      for (double x : host_values(raw::narrow(naive_buf, 2, C, pad))) ASSERT_TRUE(std::isnan(x)) << "naive padding";

      const Tensor dout_s = heads(dy, 0, C, kH), dout_c = raw::contiguous(dout_s);
      Tensor dq_c = poisoned(bhtd, t), dk_c = poisoned(bhtd, t), dv_c = poisoned(bhtd, t);
      cuda::flash_attention_backward(q, k, v, out_c, dout_c, lse_c, scale, dq_c, dk_c, dv_c);
      Tensor dqkv_buf = poisoned({kB, T, 3 * C + pad}, t);
      const Tensor dq_s = heads(dqkv_buf, 0, C, kH), dk_s = heads(dqkv_buf, 1, C, kH),
                   dv_s = heads(dqkv_buf, 2, C, kH);
      cuda::flash_attention_backward(q, k, v, out_s, dout_s, lse_s, scale, dq_s, dk_s, dv_s);
      EXPECT_EQ(host_values(dq_s), host_values(dq_c)) << "dq";
      EXPECT_EQ(host_values(dk_s), host_values(dk_c)) << "dk";
      EXPECT_EQ(host_values(dv_s), host_values(dv_c)) << "dv";
      expect_close(host_values(raw::narrow(dqkv_buf, 2, 0, 3 * C)), want.dqkv, 2 * tolerance(t),
                   "d(qkv) through the views");
      for (double x : host_values(raw::narrow(dqkv_buf, 2, 3 * C, pad)))
        ASSERT_TRUE(std::isnan(x)) << "d(qkv) padding written";
    }
  }
}

// The backward reads O only for its row term delta = rowsum(dO * O): an O whose rows do not
// start on 16-byte boundaries (allowed there, unlike for the written tensors) takes the
// element-wise reduction instead of the 16-byte packs, with the same gradients up to the
// order of that f32 sum.
TEST(AttentionQkvCuda, BackwardReadsOutputRowsOffSixteenBytes) {
  TESSERA_REQUIRE_GPU();
  for (DType t : {DType::bf16, DType::f16}) {
    for (int64_t D : {64, 128}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " D " << D);
      const int64_t T = 77, C = kH * D;
      const double scale = 1.0 / std::sqrt(double(D));
      const Tensor qkv_h = host_randn({kB, T, 3 * C}, t), dy_h = host_randn({kB, T, C}, t);
      const Tensor qkv = to_gpu(qkv_h);
      const Tensor q = heads(qkv, 0, C, kH), k = heads(qkv, 1, C, kH), v = heads(qkv, 2, C, kH);
      const Shape bhtd{kB, kH, T, D}, bht{kB, kH, T};
      Tensor out = poisoned(bhtd, t), lse = poisoned(bht, DType::f32);
      cuda::flash_attention_forward(q, k, v, scale, out, lse);
      const Tensor dout = raw::contiguous(heads(to_gpu(dy_h), 0, C, kH));
      // The same values one element past a 16-byte boundary.
      const Tensor flat = poisoned({out.numel() + 1}, t);
      const Tensor out_odd = raw::as_strided(flat, bhtd, out.strides(), 1);
      raw::copy_(out_odd, out);
      ASSERT_EQ(host_values(out_odd), host_values(out));

      Tensor dq = poisoned(bhtd, t), dk = poisoned(bhtd, t), dv = poisoned(bhtd, t);
      cuda::flash_attention_backward(q, k, v, out, dout, lse, scale, dq, dk, dv);
      Tensor dq_o = poisoned(bhtd, t), dk_o = poisoned(bhtd, t), dv_o = poisoned(bhtd, t);
      cuda::flash_attention_backward(q, k, v, out_odd, dout, lse, scale, dq_o, dk_o, dv_o);
      expect_close(host_values(dq_o), host_values(dq), tolerance(t), "dq");
      expect_close(host_values(dk_o), host_values(dk), tolerance(t), "dk");
      EXPECT_EQ(host_values(dv_o), host_values(dv)) << "dv = P^T dO does not read delta";
      const Reference want = reference(qkv_h, dy_h, kH);
      Tensor dqkv = poisoned({kB, T, 3 * C}, t);
      raw::copy_(heads(dqkv, 0, C, kH), dq_o);
      raw::copy_(heads(dqkv, 1, C, kH), dk_o);
      raw::copy_(heads(dqkv, 2, C, kH), dv_o);
      expect_close(host_values(dqkv), want.dqkv, 2 * tolerance(t), "d(qkv) against float64");
    }
  }
}

// The message of the Error fn raises (empty when it raises none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(AttentionQkvCuda, BadViewsAndInputsRaiseClearly) {
  TESSERA_REQUIRE_GPU();
  const DType t = DType::bf16;
  const int64_t B = 1, H = 2, T = 16, D = 64;
  const Shape bhtd{B, H, T, D};
  const Tensor q = to_gpu(host_randn(bhtd, t)), k = to_gpu(host_randn(bhtd, t)), v = to_gpu(host_randn(bhtd, t));
  const Tensor lse = poisoned({B, H, T}, DType::f32), good = poisoned(bhtd, t);
  auto forward_error = [&](const Tensor& out) {
    return error_of([&] { cuda::flash_attention_forward(q, k, v, 0.125, out, lse); });
  };
  auto expect_error = [](const std::string& message, const char* part) {
    EXPECT_NE(message.find(part), std::string::npos) << "expected '" << part << "' in: " << message;
  };
  EXPECT_EQ(forward_error(good), "");
  expect_error(forward_error(raw::transpose(poisoned({B, H, D, T}, t), 2, 3)), "out must have a contiguous head dimension");
  const Tensor flat = poisoned({B * H * T * D + 8}, t);
  expect_error(forward_error(raw::as_strided(flat, bhtd, {H * T * D, T * D, D, 1}, 1)), "out rows must start on 16-byte");
  expect_error(forward_error(raw::expand(poisoned({B, 1, T, D}, t), bhtd)), "must not overlap");
  expect_error(forward_error(poisoned(bhtd, DType::f16)), "out must be a [1, 2, 16, 64] bfloat16");
  expect_error(forward_error(poisoned({B, H, T + 1, D}, t)), "out must be a");

  Tensor o = poisoned(bhtd, t);
  cuda::flash_attention_forward(q, k, v, 0.125, o, lse);
  const Tensor dout = to_gpu(host_randn(bhtd, t));
  auto backward_error = [&](const Tensor& dout_arg, const Tensor& dq) {
    return error_of([&] {
      cuda::flash_attention_backward(q, k, v, o, dout_arg, lse, 0.125, dq, poisoned(bhtd, t), poisoned(bhtd, t));
    });
  };
  EXPECT_EQ(backward_error(dout, poisoned(bhtd, t)), "");
  expect_error(backward_error(dout, raw::expand(poisoned({B, H, 1, D}, t), bhtd)), "dq is written and must not overlap");
  expect_error(backward_error(raw::as_strided(flat, bhtd, {H * T * D, T * D, D, 1}, 1), poisoned(bhtd, t)),
               "dout rows must start on 16-byte");
  expect_error(backward_error(raw::transpose(poisoned({B, H, D, T}, t), 2, 3), poisoned(bhtd, t)),
               "dout must have a contiguous head dimension");

  // The qkv function's own checks, on the device too.
  const Tensor qkv = to_gpu(host_randn({2, 5, 3 * 128 + 1}, t));
  expect_error(error_of([&] { causal_attention_qkv(qkv, 2); }), "[B, T, 3C]");
  expect_error(error_of([&] { causal_attention_qkv(to_gpu(host_randn({2, 5, 3 * 128}, t)), 3); }), "n_head (3)");
}

TEST(AttentionQkvCuda, CudnnBackendMatchesFlash) {
  TESSERA_REQUIRE_GPU();
  std::string why;
  if (!cuda::cudnn_attention_available(&why)) GTEST_SKIP() << "cuDNN attention unavailable: " << why;
  AttentionBackendRestorer restore;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.dtype) << " T " << c.T << " D " << c.D);
    const int64_t C = kH * c.D;
    const Tensor qkv_h = host_randn({kB, c.T, 3 * C}, c.dtype), dy_h = host_randn({kB, c.T, C}, c.dtype);
    set_attention_backend(AttentionBackend::Flash);
    const Reference flash = on_gpu(qkv_h, dy_h, kH);
    set_attention_backend(AttentionBackend::Cudnn);
    const Reference cudnn = on_gpu(qkv_h, dy_h, kH);
    const Reference want = reference(qkv_h, dy_h, kH);
    expect_close(cudnn.y, want.y, tolerance(c.dtype), "cudnn y");
    expect_close(cudnn.dqkv, want.dqkv, 2 * tolerance(c.dtype), "cudnn d(qkv)");
    expect_close(cudnn.y, flash.y, tolerance(c.dtype), "cudnn y vs flash");
    expect_close(cudnn.dqkv, flash.dqkv, 2 * tolerance(c.dtype), "cudnn d(qkv) vs flash");

    // scaled_dot_product_attention follows the switch as well.
    const Tensor qkv = to_gpu(qkv_h);
    std::vector<std::vector<double>> outs;
    for (AttentionBackend backend : {AttentionBackend::Flash, AttentionBackend::Cudnn}) {
      set_attention_backend(backend);
      const Tensor qh = requiring_grad(heads(qkv, 0, C, kH).detach());
      const Tensor out = scaled_dot_product_attention(qh, heads(qkv, 1, C, kH), heads(qkv, 2, C, kH), true);
      EXPECT_EQ(autograd::meta_of(out).grad_fn->name, "FlashAttentionBackward");
      sum(out).backward();
      outs.push_back(host_values(out));
      outs.push_back(host_values(qh.grad()));
    }
    expect_close(outs[2], outs[0], tolerance(c.dtype), "sdpa out, cudnn vs flash");
    expect_close(outs[3], outs[1], 2 * tolerance(c.dtype), "sdpa dq, cudnn vs flash");
  }
}

TEST(AttentionQkvCuda, UnavailableCudnnRaisesSayingWhy) {
  TESSERA_REQUIRE_GPU();
  std::string why;
  if (cuda::cudnn_attention_available(&why)) GTEST_SKIP() << "cuDNN attention is available here";
  AttentionBackendRestorer restore;
  set_attention_backend(AttentionBackend::Cudnn);
  const Tensor qkv = to_gpu(host_randn({1, 9, 3 * 128}, DType::bf16));
  const std::string message = error_of([&] { causal_attention_qkv(qkv, 2); });
  EXPECT_NE(message.find("cudnn"), std::string::npos) << message;
  EXPECT_NE(message.find(why), std::string::npos) << message << " (reason: " << why << ")";
  const Tensor q = heads(qkv, 0, 256, 2);
  EXPECT_NE(error_of([&] { scaled_dot_product_attention(q, q, q, true); }).find(why), std::string::npos);
  // The composed path (here: dropout) runs no fused kernel and is unaffected.
  EXPECT_EQ(error_of([&] { causal_attention_qkv(qkv, 2, 0.1); }), "");
}

}  // namespace
}  // namespace tessera
