// The Hopper flash-attention forward (kernels/cuda/attention_sm90.cu: wgmma + TMA, a producer
// warpgroup and 2 consumer warpgroups) called directly against the float64 reference
// (attention_reference.h): bf16 and f16, head sizes 64 and 128, lengths from 1 to past a
// multiple of the 128-key tile, plain and grouped-query attention, q/k/v as views of one fused
// [B, T, heads, D] projection and out written through a padded, NaN-poisoned view. Also that
// flash_attention_forward takes it on an sm_90 device (and the mma.sync kernel elsewhere, with a
// reason the query and the direct call both give). Every comparison prints its max error.
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
using Sm90Case = cuda_test::sm90::Case;

// q, k, v as [B, heads, T, D] views of one [B, T, H + 2 Hkv, D] buffer (heads()).
struct FusedInputs {
  Tensor q, k, v;
  AttentionReference ref;
  double scale;
};

// B batches of H query heads (the shared test shape unless given).
FusedInputs make_inputs(const Sm90Case& c, int64_t B = kB, int64_t H = kH) {
  const int64_t Hkv = H / c.group;
  const Tensor host = host_randn({B, c.T, H + 2 * Hkv, c.D}, c.dtype);
  const Tensor qkv = to_gpu(host);
  FusedInputs in;
  in.q = heads(qkv, 0, H);
  in.k = heads(qkv, H, Hkv);
  in.v = heads(qkv, H + Hkv, Hkv);
  in.scale = 1.0 / std::sqrt(double(c.D));
  in.ref = reference_attention(host_bhtd(host, 0, H), host_bhtd(host, H, Hkv),
                               host_bhtd(host, H + Hkv, Hkv), /*dout: forward only*/ {}, B, H, Hkv,
                               c.T, c.D, in.scale);
  return in;
}

// The [B, H, T, D] heads of the first H * D channels of a [B, T, H * D + pad] buffer.
Tensor out_view(const Tensor& buf, int64_t B, int64_t H, int64_t T, int64_t D) {
  return raw::permute(raw::view(raw::narrow(buf, 2, 0, H * D), {B, T, H, D}), {0, 2, 1, 3});
}

// describe() for B batches of H query heads.
std::string describe_heads(const Sm90Case& c, int64_t B, int64_t H) {
  return std::string(dtype_name(c.dtype)) + " D=" + std::to_string(c.D) +
         " T=" + std::to_string(c.T) + " B=" + std::to_string(B) + " H=" + std::to_string(H) +
         " Hkv=" + std::to_string(H / c.group);
}

void check_direct(const Sm90Case& c, int64_t B = kB, int64_t H = kH) {
  std::printf("%s\n", describe_heads(c, B, H).c_str());
  const FusedInputs in = make_inputs(c, B, H);
  constexpr int64_t kPad = 8;
  const Tensor y_buf = poisoned({B, c.T, H * c.D + kPad}, c.dtype);
  const Tensor lse = poisoned({B, H, c.T}, DType::f32);
  const Tensor out = out_view(y_buf, B, H, c.T, c.D);
  cuda::flash_attention_forward_sm90(in.q, in.k, in.v, in.scale, out, lse);
  expect_within(values(raw::contiguous(out)), in.ref.out, tolerance(c.dtype), "sm90 out");
  expect_within(values(lse), in.ref.lse, 2e-5, "sm90 lse");
  for (double x : values(raw::contiguous(raw::narrow(y_buf, 2, H * c.D, kPad))))
    ASSERT_TRUE(std::isnan(x)) << describe_heads(c, B, H)
                               << ": the padding next to out was written";
}

TEST(AttentionSm90Cuda, DirectAgainstFloat64) {
  REQUIRE_SM90_DEVICE();
  // 1 query; a partial tile (the block's second consumer warpgroup has no rows below T and only
  // releases the tiles); exactly one tile; one and a half (the second warpgroup holds 8 valid
  // rows); past 1024 (9 tiles through both register sets of P, an odd number of steps).
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {1, 17, 128, 200, 1024 + 37})
        for (int64_t group : {1, 3}) {
          const Sm90Case c{t, D, T, group};
          SCOPED_TRACE(describe(c));
          check_direct(c);
          if (HasFatalFailure()) return;
        }
}

// The grid is persistent: one block per SM walks over units (two query tiles of one batch and
// head), so with more units than SMs a block takes several, of different heads and batches, its
// K/V ring and Q buffers running on from one to the next. Here the head count is derived from the
// device's SM count so that every block walks over two or three units and the last round is
// partial: T below one tile (a unit of one query tile), T = 300 (three query tiles: the middle
// one is a unit alone, the last one partial, grouped-query heads) and T = 520 (five).
TEST(AttentionSm90Cuda, PersistentGridWalksOverManyHeads) {
  REQUIRE_SM90_DEVICE();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  struct Walk {
    Sm90Case c;
    int64_t B;
  };
  for (const Walk& walk : {Walk{{DType::bf16, 128, 77, 1}, 3}, Walk{{DType::f16, 64, 300, 2}, 2},
                           Walk{{DType::bf16, 128, 300, 1}, 2}, Walk{{DType::f16, 128, 520, 1}, 2},
                           Walk{{DType::bf16, 64, 520, 2}, 1}}) {
    const Sm90Case& c = walk.c;
    const int64_t units_per_head = ((c.T + 127) / 128 + 1) / 2;
    int64_t H = c.group * ((2 * sms) / (walk.B * units_per_head * c.group) + 1);
    while ((walk.B * H * units_per_head) % sms == 0) H += c.group;  // a partial last round
    ASSERT_GT(walk.B * H * units_per_head, 2 * sms);
    SCOPED_TRACE(describe_heads(c, walk.B, H));
    check_direct(c, walk.B, H);
    if (HasFatalFailure()) return;
  }
}

// On an sm_90 device flash_attention_forward takes the Hopper kernel: the query says so, and its
// result is bitwise that of the direct call, not that of the mma.sync kernel (whose different
// tiling rounds differently), which still matches the reference.
TEST(AttentionSm90Cuda, DispatchTakesItOnHopper) {
  REQUIRE_SM90_DEVICE();
  for (int64_t D : {64, 128}) {
    const Sm90Case c{DType::bf16, D, 300, 1};
    SCOPED_TRACE(describe(c));
    const FusedInputs in = make_inputs(c);
    std::string why;
    EXPECT_TRUE(cuda::flash_attention_forward_uses_sm90(in.q, in.k, in.v, in.scale, &why)) << why;
    // A scale that is not positive stays with the mma.sync kernel (the Hopper one takes the row
    // max of the unscaled scores), saying so.
    EXPECT_FALSE(cuda::flash_attention_forward_uses_sm90(in.q, in.k, in.v, -in.scale, &why));
    EXPECT_NE(why.find("scale"), std::string::npos) << why;
    const Shape bhtd{kB, kH, c.T, c.D}, bht{kB, kH, c.T};
    Tensor out_direct = poisoned(bhtd, c.dtype), lse_direct = poisoned(bht, DType::f32);
    Tensor out_dispatch = poisoned(bhtd, c.dtype), lse_dispatch = poisoned(bht, DType::f32);
    Tensor out_mma = poisoned(bhtd, c.dtype), lse_mma = poisoned(bht, DType::f32);
    cuda::flash_attention_forward_sm90(in.q, in.k, in.v, in.scale, out_direct, lse_direct);
    cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, out_dispatch, lse_dispatch);
    cuda::flash_attention_forward_mma_sync(in.q, in.k, in.v, in.scale, out_mma, lse_mma);
    EXPECT_EQ(values(out_dispatch), values(out_direct));
    EXPECT_EQ(values(lse_dispatch), values(lse_direct));
    EXPECT_NE(values(out_mma), values(out_direct)) << "the two kernels agreed bitwise everywhere";
    expect_within(values(out_mma), in.ref.out, tolerance(c.dtype), "mma.sync out");
    expect_within(values(out_dispatch), in.ref.out, tolerance(c.dtype), "dispatched out");
  }
}

// Elsewhere the query and the direct call say why, and flash_attention_forward still computes
// the right thing with the mma.sync kernel.
TEST(AttentionSm90Cuda, OtherDevicesKeepTheMmaSyncKernel) {
  TESSERA_REQUIRE_GPU();
  if (device_arch() == "sm_90") GTEST_SKIP() << "an sm_90 device runs the Hopper kernel";
  const Sm90Case c{DType::f16, 64, 77, 3};
  const FusedInputs in = make_inputs(c);
  std::string why;
  EXPECT_FALSE(cuda::flash_attention_forward_uses_sm90(in.q, in.k, in.v, in.scale, &why));
  EXPECT_NE(why.find("sm_90"), std::string::npos) << why;
  Tensor out = poisoned({kB, kH, c.T, c.D}, c.dtype), lse = poisoned({kB, kH, c.T}, DType::f32);
  try {
    cuda::flash_attention_forward_sm90(in.q, in.k, in.v, in.scale, out, lse);
    ADD_FAILURE() << "the Hopper kernel ran on " << device_arch();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run here"), std::string::npos) << e.what();
  }
  cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, out, lse);
  expect_within(values(out), in.ref.out, tolerance(c.dtype), "mma.sync out");
  expect_within(values(lse), in.ref.lse, 2e-5, "mma.sync lse");
}

// TESSERA_ATTENTION_SM90=0 keeps the dispatch on the mma.sync kernel (on any device), which still
// computes the right thing; a value other than 0 or 1 is an error naming the variable.
TEST(AttentionSm90Cuda, EnvironmentSwitch) {
  TESSERA_REQUIRE_GPU();
  const char* saved = std::getenv("TESSERA_ATTENTION_SM90");
  const std::string before = saved ? saved : "";
  const Sm90Case c{DType::bf16, 128, 130, 1};
  const FusedInputs in = make_inputs(c);
  ::setenv("TESSERA_ATTENTION_SM90", "0", 1);
  std::string why;
  EXPECT_FALSE(cuda::flash_attention_forward_uses_sm90(in.q, in.k, in.v, in.scale, &why));
  EXPECT_NE(why.find("TESSERA_ATTENTION_SM90=0"), std::string::npos) << why;
  Tensor out = poisoned({kB, kH, c.T, c.D}, c.dtype), lse = poisoned({kB, kH, c.T}, DType::f32);
  cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, out, lse);
  expect_within(values(out), in.ref.out, tolerance(c.dtype), "out with TESSERA_ATTENTION_SM90=0");
  ::setenv("TESSERA_ATTENTION_SM90", "yes", 1);
  try {
    cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, out, lse);
    ADD_FAILURE() << "TESSERA_ATTENTION_SM90=yes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TESSERA_ATTENTION_SM90='yes' must be 0 or 1"),
              std::string::npos)
        << e.what();
  }
  if (saved)
    ::setenv("TESSERA_ATTENTION_SM90", before.c_str(), 1);
  else
    ::unsetenv("TESSERA_ATTENTION_SM90");
}

}  // namespace
}  // namespace tessera
