// cuDNN fused attention (kernels/cuda/cudnn_attention.h) against a float64 CPU reference and
// against the hand-written flash kernels, in the layouts the training path uses: q, k, v as
// strided views of one fused [B, T, 3C] projection, the output a view of a [B, T, C] buffer,
// dq/dk/dv views of the fused [B, T, 3C] gradient. The lse of each implementation is fed to
// the other's backward, which checks that both use the same log-sum-exp convention.
#include <cmath>
#include <string>

#include "tessera/core/cuda/cuda_runtime.h"
#include "attention_reference.h"
#include "cuda_test_util.h"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {
using namespace cuda_test;

#define REQUIRE_CUDNN_ATTENTION()                                               \
  do {                                                                          \
    TESSERA_REQUIRE_GPU();                                                      \
    std::string why_unavailable;                                                \
    if (!cuda::cudnn_attention_available(&why_unavailable))                     \
      GTEST_SKIP() << "cuDNN attention unavailable: " << why_unavailable;       \
  } while (0)

// [B, H, T, D] view `which` (0 = q, 1 = k, 2 = v) of a [B, T, 3, H, D] (= [B, T, 3C]) buffer.
Tensor head_view(const Tensor& fused, int64_t which) {
  return raw::permute(raw::select(fused, 2, which), {0, 2, 1, 3});
}
// [B, H, T, D] view of a [B, T, H, D] (= [B, T, C]) buffer.
Tensor heads_of(const Tensor& btc) { return raw::permute(btc, {0, 2, 1, 3}); }

struct Case {
  DType dtype;
  int64_t D, T;
};

std::string describe(const Case& c, const char* what) {
  return std::string(dtype_name(c.dtype)) + " D=" + std::to_string(c.D) + " T=" +
         std::to_string(c.T) + ": " + what;
}

void check_case(const Case& c) {
  const int64_t B = 2, H = 3, T = c.T, D = c.D, C = H * D;
  const DType t = c.dtype;
  const double scale = 1.0 / std::sqrt(double(D));
  const double tol = tolerance(t);
  const auto label = [&](const std::string& what) { return describe(c, what.c_str()); };

  Tensor qkv_host = host_randn({B, T, 3, H, D}, t);
  Tensor qkv = to_gpu(qkv_host);
  Tensor q = head_view(qkv, 0), k = head_view(qkv, 1), v = head_view(qkv, 2);
  ASSERT_EQ(q.strides(), (Shape{T * 3 * C, D, 3 * C, 1}));
  Tensor dout_host = host_randn({B, T, H, D}, t);
  Tensor dout = heads_of(to_gpu(dout_host));  // the gradient of a [B, T, C] output: strided

  const auto host_bhtd = [](const Tensor& x) { return values(raw::contiguous(x)); };
  const AttentionReference ref =
      reference_attention(host_bhtd(head_view(qkv_host, 0)), host_bhtd(head_view(qkv_host, 1)),
                          host_bhtd(head_view(qkv_host, 2)), host_bhtd(heads_of(dout_host)), B,
                          H, H, T, D, scale);

  // cuDNN forward into a view of a [B, T, C] buffer.
  Tensor out = heads_of(poisoned({B, T, H, D}, t));
  Tensor lse = poisoned({B, H, T}, DType::f32);
  cuda::cudnn_attention_forward(q, k, v, scale, out, lse);
  expect_close(values(out), ref.out, tol, label("cudnn out vs float64").c_str());
  expect_close(values(lse), ref.lse, 2e-5, label("cudnn lse vs float64").c_str());

  // The hand-written kernels on the same inputs (contiguous outputs).
  Tensor flash_out = poisoned({B, H, T, D}, t), flash_lse = poisoned({B, H, T}, DType::f32);
  cuda::flash_attention_forward(q, k, v, scale, flash_out, flash_lse);
  expect_close(values(out), values(flash_out), tol, label("cudnn out vs flash").c_str());
  expect_close(values(lse), values(flash_lse), 2e-5, label("cudnn lse vs flash").c_str());

  // A second call hits the cached graph and must reproduce the first bitwise.
  Tensor out_again = heads_of(poisoned({B, T, H, D}, t));
  Tensor lse_again = poisoned({B, H, T}, DType::f32);
  cuda::cudnn_attention_forward(q, k, v, scale, out_again, lse_again);
  EXPECT_EQ(values(out_again), values(out)) << describe(c, "cached forward out");
  EXPECT_EQ(values(lse_again), values(lse)) << describe(c, "cached forward lse");

  // cuDNN backward into views of the fused [B, T, 3C] gradient, from cuDNN's own forward.
  auto backward = [&](const Tensor& fwd_out, const Tensor& fwd_lse, const char* what) {
    Tensor dqkv = poisoned({B, T, 3, H, D}, t);
    Tensor dq = head_view(dqkv, 0), dk = head_view(dqkv, 1), dv = head_view(dqkv, 2);
    cuda::cudnn_attention_backward(q, k, v, fwd_out, dout, fwd_lse, scale, dq, dk, dv);
    expect_close(values(dq), ref.dq, 2 * tol, label(std::string(what) + " dq").c_str());
    expect_close(values(dk), ref.dk, 2 * tol, label(std::string(what) + " dk").c_str());
    expect_close(values(dv), ref.dv, 2 * tol, label(std::string(what) + " dv").c_str());
    return dqkv;
  };
  Tensor dqkv = backward(out, lse, "cudnn backward (cudnn forward)");
  // ... and from the flash forward's out and lse: same lse convention or this fails.
  backward(flash_out, flash_lse, "cudnn backward (flash forward)");

  // The flash backward from cuDNN's forward (contiguous out/dout, as its contract asks).
  Tensor fdq = poisoned({B, H, T, D}, t), fdk = poisoned({B, H, T, D}, t),
         fdv = poisoned({B, H, T, D}, t);
  cuda::flash_attention_backward(q, k, v, raw::contiguous(out), raw::contiguous(dout), lse, scale,
                                 fdq, fdk, fdv);
  expect_close(values(fdq), ref.dq, 2 * tol, label("flash dq from cudnn lse").c_str());
  expect_close(values(fdk), ref.dk, 2 * tol, label("flash dk from cudnn lse").c_str());
  expect_close(values(fdv), ref.dv, 2 * tol, label("flash dv from cudnn lse").c_str());
  const Tensor flash_grads[] = {fdq, fdk, fdv};
  for (int64_t which = 0; which < 3; ++which)
    expect_close(values(head_view(dqkv, which)), values(flash_grads[which]), 2 * tol,
                 label("cudnn d" + std::string(1, "qkv"[which]) + " vs flash").c_str());
}

TEST(CudnnAttention, ForwardBackwardAgainstFloat64AndFlashKernels) {
  REQUIRE_CUDNN_ATTENTION();
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {77, 300, 1024}) {
        SCOPED_TRACE(describe({t, D, T}, "case"));
        check_case({t, D, T});
        if (HasFatalFailure()) return;
      }
}

TEST(CudnnAttention, DeterministicBackwardIsBitwiseRepeatable) {
  REQUIRE_CUDNN_ATTENTION();
  const int64_t B = 2, H = 3, T = 300, D = 64;
  const double scale = 1.0 / std::sqrt(double(D));
  Tensor qkv = to_gpu(host_randn({B, T, 3, H, D}, DType::bf16));
  Tensor q = head_view(qkv, 0), k = head_view(qkv, 1), v = head_view(qkv, 2);
  Tensor dout = to_gpu(host_randn({B, H, T, D}, DType::bf16));
  Tensor out = poisoned({B, H, T, D}, DType::bf16), lse = poisoned({B, H, T}, DType::f32);
  cuda::cudnn_attention_forward(q, k, v, scale, out, lse);
  const bool was_deterministic = cuda::deterministic();
  cuda::set_deterministic(true);
  std::vector<std::vector<double>> runs;
  for (int run = 0; run < 2; ++run) {
    Tensor dqkv = poisoned({B, T, 3, H, D}, DType::bf16);
    cuda::cudnn_attention_backward(q, k, v, out, dout, lse, scale, head_view(dqkv, 0),
                                   head_view(dqkv, 1), head_view(dqkv, 2));
    runs.push_back(values(dqkv));
  }
  cuda::set_deterministic(was_deterministic);
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(CudnnAttention, RejectsBadArgumentsWithClearErrors) {
  REQUIRE_CUDNN_ATTENTION();
  const int64_t B = 1, H = 2, T = 33, D = 64;
  Tensor q = to_gpu(host_randn({B, H, T, D}, DType::bf16));
  Tensor out = poisoned({B, H, T, D}, DType::bf16), lse = poisoned({B, H, T}, DType::f32);
  auto expect_error = [](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  Tensor d32 = to_gpu(host_randn({B, H, T, 32}, DType::bf16));
  Tensor d32_out = poisoned({B, H, T, 32}, DType::bf16);
  expect_error([&] { cuda::cudnn_attention_forward(d32, d32, d32, 1.0, d32_out, lse); },
               "head size must be 64 or 128");
  Tensor f32_q = to_gpu(host_randn({B, H, T, D}, DType::f32));
  expect_error([&] { cuda::cudnn_attention_forward(f32_q, f32_q, f32_q, 1.0, out, lse); },
               "bfloat16 or float16");
  // Rows of 65 elements: the head dim is contiguous but rows are not 16-byte aligned.
  Tensor wide = to_gpu(host_randn({B, H, T, D + 1}, DType::bf16));
  Tensor misaligned = raw::narrow(wide, 3, 0, D);
  expect_error([&] { cuda::cudnn_attention_forward(misaligned, q, q, 1.0, out, lse); },
               "16-byte");
  Tensor bad_lse = poisoned({B, H, T}, DType::bf16);
  expect_error([&] { cuda::cudnn_attention_forward(q, q, q, 1.0, out, bad_lse); },
               "lse must be a contiguous float32");
  Tensor dq = poisoned({B, H, T, D}, DType::f16);
  expect_error(
      [&] { cuda::cudnn_attention_backward(q, q, q, out, out, lse, 1.0, dq, out, out); },
      "dq must be a");
}

}  // namespace
}  // namespace tessera
