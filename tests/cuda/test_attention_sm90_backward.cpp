// The Hopper flash-attention backward (kernels/cuda/attention_sm90_backward.cu: a wgmma + TMA
// dk/dv kernel and a dq kernel) called directly against the float64 reference
// (attention_reference.h): bf16 and f16, head sizes 64 and 128, lengths from 1 to past several
// tiles, plain and grouped-query attention, q/k/v as views of one fused [B, T, heads, D]
// projection, dout a head view of a [B, T, H, D] buffer and dq | dk | dv written through views of
// one NaN-poisoned fused gradient. Also: a second run repeats the first bitwise (no atomics);
// flash_attention_backward takes these kernels on an sm_90 device (bitwise the direct call) and
// the mma.sync kernels elsewhere or with TESSERA_ATTENTION_SM90_BWD=0. Every comparison prints
// its max error.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "attention_reference.h"
#include "attention_sm90_test_util.h"
#include "cuda_test_util.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {
using namespace cuda_test;
using namespace cuda_test::sm90;
using BwdCase = cuda_test::sm90::Case;

// q | k | v as views of one [B, T, H + 2 Hkv, D] buffer (T strides of (H + 2 Hkv) D, head
// strides of D), dout the heads of a [B, T, H, D] buffer, and the forward's out and lse.
struct Inputs {
  Tensor q, k, v, dout, out, lse;
  AttentionReference ref;
  double scale;
};

Inputs make_inputs(const BwdCase& c) {
  const int64_t Hkv = c.kv_heads();
  const Tensor qkv_host = host_randn({kB, c.T, kH + 2 * Hkv, c.D}, c.dtype);
  const Tensor dout_host = host_randn({kB, c.T, kH, c.D}, c.dtype);
  const Tensor qkv = to_gpu(qkv_host);
  Inputs in;
  in.q = heads(qkv, 0, kH);
  in.k = heads(qkv, kH, Hkv);
  in.v = heads(qkv, kH + Hkv, Hkv);
  in.dout = heads(to_gpu(dout_host), 0, kH);
  in.scale = 1.0 / std::sqrt(double(c.D));
  in.ref = reference_attention(host_bhtd(qkv_host, 0, kH), host_bhtd(qkv_host, kH, Hkv),
                               host_bhtd(qkv_host, kH + Hkv, Hkv), host_bhtd(dout_host, 0, kH), kB,
                               kH, Hkv, c.T, c.D, in.scale);
  in.out = poisoned({kB, kH, c.T, c.D}, c.dtype);
  in.lse = poisoned({kB, kH, c.T}, DType::f32);
  cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, in.out, in.lse);
  return in;
}

// dq | dk | dv as views of one NaN-poisoned [B, T, H + 2 Hkv, D] gradient buffer.
struct Gradients {
  Tensor dq, dk, dv;
  Gradients(const BwdCase& c) {
    const Tensor buf = poisoned({kB, c.T, kH + 2 * c.kv_heads(), c.D}, c.dtype);
    dq = heads(buf, 0, kH);
    dk = heads(buf, kH, c.kv_heads());
    dv = heads(buf, kH + c.kv_heads(), c.kv_heads());
  }
  std::vector<double> host(const Tensor& t) const { return values(raw::contiguous(t)); }
};

enum class Path { sm90, dispatch, mma_sync };

Gradients run_backward(const BwdCase& c, const Inputs& in, Path path) {
  Gradients g(c);
  if (path == Path::sm90)
    cuda::flash_attention_backward_sm90(in.q, in.k, in.v, in.out, in.dout, in.lse, in.scale, g.dq,
                                        g.dk, g.dv);
  else if (path == Path::dispatch)
    cuda::flash_attention_backward(in.q, in.k, in.v, in.out, in.dout, in.lse, in.scale, g.dq, g.dk,
                                   g.dv);
  else
    cuda::flash_attention_backward_mma_sync(in.q, in.k, in.v, in.out, in.dout, in.lse, in.scale,
                                            g.dq, g.dk, g.dv);
  return g;
}

// The tolerance of the existing backward tests (test_gqa_attention.cpp): twice the forward's.
// dq and dk are measured against the scale of the gradients (dv's largest element) as well as
// their own: with one key (T = 1) the softmax is 1 whatever the score, so dq and dk are exactly
// 0 and only the rounding of dP - delta (~1e-7 of |dO| |V|) is left to compare.
void expect_gradients(const BwdCase& c, const Gradients& g, const AttentionReference& ref,
                      const std::string& what) {
  const double tol = 2 * tolerance(c.dtype);
  double scale = 0;
  for (double x : ref.dv) scale = std::max(scale, std::fabs(x));
  expect_within(g.host(g.dq), ref.dq, tol, what + " dq", scale);
  expect_within(g.host(g.dk), ref.dk, tol, what + " dk (summed over the group)", scale);
  expect_within(g.host(g.dv), ref.dv, tol, what + " dv (summed over the group)");
}

void expect_bitwise(const Gradients& a, const Gradients& b, const std::string& what) {
  EXPECT_EQ(a.host(a.dq), b.host(b.dq)) << what << ": dq differs";
  EXPECT_EQ(a.host(a.dk), b.host(b.dk)) << what << ": dk differs";
  EXPECT_EQ(a.host(a.dv), b.host(b.dv)) << what << ": dv differs";
}

TEST(AttentionSm90BackwardCuda, DirectAgainstFloat64AndRepeatable) {
  REQUIRE_SM90_DEVICE();
  // 1 query; a partial tile (the block's second warpgroup has no rows below T); exactly one
  // 128-row block; one and a half (the second warpgroup holds 8 valid rows, the column tiles end
  // inside T); past 1024 (several blocks and many steps through both pipeline stages, and for
  // GQA several query heads per dk/dv block).
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {1, 17, 128, 200, 1024 + 37})
        for (int64_t group : {1, 3}) {
          const BwdCase c{t, D, T, group};
          SCOPED_TRACE(describe(c));
          std::printf("%s\n", describe(c).c_str());
          const Inputs in = make_inputs(c);
          const Gradients first = run_backward(c, in, Path::sm90);
          expect_gradients(c, first, in.ref, "sm90 backward");
          // Each block owns its rows and sums its group in registers: no atomics, so a second
          // run repeats the first bitwise.
          expect_bitwise(run_backward(c, in, Path::sm90), first, "a second sm90 run");
          if (HasFailure()) return;
        }
}

// On an sm_90 device flash_attention_backward takes the Hopper kernels: the query (the
// dispatch's own decision) says so, and its result is bitwise that of the direct call. The
// mma.sync kernels still match the reference; their dk can agree with the Hopper kernels' bit
// for bit (both sum the same 64-query tiles in the same order: seen on an H100), so whether
// they differ is only printed.
TEST(AttentionSm90BackwardCuda, DispatchTakesItOnHopper) {
  REQUIRE_SM90_DEVICE();
  for (int64_t D : {64, 128}) {
    const BwdCase c{DType::bf16, D, 300, 3};
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    std::string why;
    EXPECT_TRUE(cuda::flash_attention_backward_uses_sm90(in.q, in.k, in.v, in.dout, &why)) << why;
    const Gradients direct = run_backward(c, in, Path::sm90);
    const Gradients dispatched = run_backward(c, in, Path::dispatch);
    const Gradients mma = run_backward(c, in, Path::mma_sync);
    expect_bitwise(dispatched, direct, "dispatch vs direct");
    std::printf("  mma.sync vs Hopper bitwise equal: dq %d, dk %d, dv %d\n",
                mma.host(mma.dq) == direct.host(direct.dq), mma.host(mma.dk) == direct.host(direct.dk),
                mma.host(mma.dv) == direct.host(direct.dv));
    expect_gradients(c, mma, in.ref, "mma.sync backward");
    expect_gradients(c, dispatched, in.ref, "dispatched backward");
  }
}

// Elsewhere the query and the direct call say why, and flash_attention_backward still computes
// the right thing with the mma.sync kernels.
TEST(AttentionSm90BackwardCuda, OtherDevicesKeepTheMmaSyncKernels) {
  TESSERA_REQUIRE_GPU();
  if (device_arch() == "sm_90") GTEST_SKIP() << "an sm_90 device runs the Hopper kernels";
  const BwdCase c{DType::f16, 64, 77, 3};
  const Inputs in = make_inputs(c);
  std::string why;
  EXPECT_FALSE(cuda::flash_attention_backward_uses_sm90(in.q, in.k, in.v, in.dout, &why));
  EXPECT_NE(why.find("sm_90"), std::string::npos) << why;
  try {
    run_backward(c, in, Path::sm90);
    ADD_FAILURE() << "the Hopper backward ran on " << device_arch();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run here"), std::string::npos) << e.what();
  }
  expect_gradients(c, run_backward(c, in, Path::dispatch), in.ref, "dispatched backward");
}

// TESSERA_ATTENTION_SM90_BWD=0 keeps the dispatch on the mma.sync kernels (on any device): the
// result is bitwise theirs and right; a value other than 0 or 1 is an error naming the variable.
TEST(AttentionSm90BackwardCuda, EnvironmentSwitch) {
  TESSERA_REQUIRE_GPU();
  const char* saved = std::getenv("TESSERA_ATTENTION_SM90_BWD");
  const std::string before = saved ? saved : "";
  const BwdCase c{DType::bf16, 128, 130, 1};
  const Inputs in = make_inputs(c);
  ::setenv("TESSERA_ATTENTION_SM90_BWD", "0", 1);
  std::string why;
  EXPECT_FALSE(cuda::flash_attention_backward_uses_sm90(in.q, in.k, in.v, in.dout, &why));
  EXPECT_NE(why.find("TESSERA_ATTENTION_SM90_BWD=0"), std::string::npos) << why;
  const Gradients switched = run_backward(c, in, Path::dispatch);
  expect_gradients(c, switched, in.ref, "backward with TESSERA_ATTENTION_SM90_BWD=0");
  expect_bitwise(switched, run_backward(c, in, Path::mma_sync), "switched off vs mma.sync");
  ::setenv("TESSERA_ATTENTION_SM90_BWD", "yes", 1);
  try {
    run_backward(c, in, Path::dispatch);
    ADD_FAILURE() << "TESSERA_ATTENTION_SM90_BWD=yes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TESSERA_ATTENTION_SM90_BWD='yes' must be 0 or 1"),
              std::string::npos)
        << e.what();
  }
  if (saved)
    ::setenv("TESSERA_ATTENTION_SM90_BWD", before.c_str(), 1);
  else
    ::unsetenv("TESSERA_ATTENTION_SM90_BWD");
}

}  // namespace
}  // namespace tessera
