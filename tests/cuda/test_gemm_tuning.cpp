// cuBLASLt plan choices of gemm_tuning.h: autotuned plans write exactly the heuristic's first
// pick's bits (and match float64).
#include <array>
#include <cmath>

#include "cuda_test_util.h"
#include "tessera/kernels/cuda/gemm_tuning.h"
#include "tessera/kernels/cuda/linear.h"

namespace tessera {
namespace {
using namespace cuda_test;

// Bitwise equality of two device tensors of one dtype, through their float64 values (every
// f32/f16/bf16 value is exact in float64, NaNs aside, and there are none here).
void expect_same_bits(const Tensor& a, const Tensor& b, const char* what) {
  const auto va = values(a), vb = values(b);
  ASSERT_EQ(va.size(), vb.size()) << what;
  size_t differing = 0;
  for (size_t i = 0; i < va.size(); ++i) differing += va[i] != vb[i];
  EXPECT_EQ(differing, 0u) << what << ": " << differing << " of " << va.size() << " differ";
}

// Plans of at least 1 GFLOP, as matmul and as the MLP's up-projection with cuBLASLt's GELU
// epilogue (GELU_AUX_BIAS writes a second buffer, the GELU input), autotuned and not.
TEST(CudaGemmTuning, TunedPlansWriteTheFirstPicksBits) {
  TESSERA_REQUIRE_GPU();
  const bool was = cuda::gemm_autotune_enabled();
  const auto before = cuda::gemm_tuning_counts();
  // {M, K, N}, 2MNK >= 1e9; odd M, and a transposed b.
  const std::vector<std::array<int64_t, 3>> shapes = {{1027, 512, 1040}, {2048, 768, 384}};
  for (DType t : {DType::bf16, DType::f16, DType::f32}) {
    for (const auto& [M, K, N] : shapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " M=" + std::to_string(M) +
                   " K=" + std::to_string(K) + " N=" + std::to_string(N));
      const Tensor ah = host_randn({M, K}, t), bth = host_randn({N, K}, t);
      const Tensor a = to_gpu(ah), b = raw::transpose(to_gpu(bth), 0, 1);
      Tensor first = poisoned({M, N}, t), tuned = poisoned({M, N}, t);
      cuda::set_gemm_autotune_enabled(false);
      gpu().matmul(a, b, first);
      cuda::set_gemm_autotune_enabled(true);
      gpu().matmul(a, b, tuned);
      expect_same_bits(first, tuned, "matmul");
      const auto ref = ref_matmul(values(ah), values(raw::contiguous(raw::transpose(bth, 0, 1))), 1,
                                  M, K, N, false, false);
      expect_close(values(tuned), ref, t == DType::f32 ? 1e-5 : 1e-2, "float64");

      // act = gelu(pre), pre = a b + bias, both written by the GEMM's epilogue.
      const Tensor bias = to_gpu(host_randn({N}, t));
      Tensor act_first = poisoned({M, N}, t), pre_first = poisoned({M, N}, t);
      Tensor act_tuned = poisoned({M, N}, t), pre_tuned = poisoned({M, N}, t);
      cuda::set_gelu_epilogues_enabled(true);
      cuda::set_gemm_autotune_enabled(false);
      cuda::linear_gelu_forward(a, b, bias, act_first, pre_first);
      cuda::set_gemm_autotune_enabled(true);
      cuda::linear_gelu_forward(a, b, bias, act_tuned, pre_tuned);
      cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);  // the default
      expect_same_bits(act_first, act_tuned, "GELU output");
      expect_same_bits(pre_first, pre_tuned, "GELU input (the epilogue's second buffer)");
    }
  }
  cuda::set_gemm_autotune_enabled(was);
  const auto after = cuda::gemm_tuning_counts();
  // cuBLASLt offers several algorithms for these shapes on any recent GPU; a build where the
  // tuning never ran would pass the bit checks above trivially.
  EXPECT_GT(after.plans_tuned, before.plans_tuned);
  std::printf(
      "[gemm autotune] plans compared %lld, now on another algorithm %lld, candidates "
      "dropped for other bits %lld\n",
      static_cast<long long>(after.plans_tuned - before.plans_tuned),
      static_cast<long long>(after.faster_than_first - before.faster_than_first),
      static_cast<long long>(after.candidates_rejected - before.candidates_rejected));
}

}  // namespace
}  // namespace tessera
