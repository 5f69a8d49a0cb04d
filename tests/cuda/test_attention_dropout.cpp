// Dropout inside the flash attention kernels (flash_attention_dropout_forward/backward, which
// scaled_dot_product_attention takes on a GPU for dropout_p > 0). Checked against the float64
// host reference with the mask recomputed on the host from the same Philox numbers (so the
// kernels drop exactly the probabilities the numbering says, and the backward regenerates the
// forward's mask), and against the composed route (matmul, softmax, dropout) started from the
// same generator state: the same outputs and gradients to the dtype's rounding, and the
// generator left at the same offset. Odd T, grouped-query attention, both head sizes, views of
// [B, T, H, D] buffers.
#include <cmath>
#include <cstdio>
#include <string>

#include "attention_reference.h"
#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/philox.h"
#include "tessera/kernels/cuda/fused.h"

namespace tessera {
namespace {
using namespace cuda_test;

struct DropoutCase {
  DType dtype;
  int64_t D, T, H, Hkv;
  double p;
};

std::string describe(const DropoutCase& c) {
  return std::string(dtype_name(c.dtype)) + " D=" + std::to_string(c.D) +
         " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " Hkv=" + std::to_string(c.Hkv) + " p=" + std::to_string(c.p);
}

Tensor heads_of(const Tensor& bthd) { return raw::permute(bthd, {0, 2, 1, 3}); }
std::vector<double> host_bhtd(const Tensor& bthd) {
  return values(raw::contiguous(heads_of(bthd)));
}

// The factor of each of the n probabilities: 1 / (1 - p) where rand()'s number u of a draw at
// block `offset`, rounded to f32, is >= p (composed dropout keeps it), else 0.
std::vector<double> host_mask(int64_t n, double p, uint64_t seed, uint64_t offset) {
  std::vector<double> f(n);
  for (int64_t u = 0; u < n; ++u)
    f[u] = static_cast<float>(philox_uniform_at(seed, offset, u)) >= static_cast<float>(p)
               ? 1.0 / (1.0 - p)
               : 0.0;
  return f;
}

TEST(AttentionDropoutCuda, KernelsMatchFloat64WithTheMaskOfTheSamePhiloxNumbers) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 2;
  for (const DropoutCase& c :
       {DropoutCase{DType::bf16, 64, 77, 3, 3, 0.2}, DropoutCase{DType::f16, 128, 130, 4, 2, 0.1},
        DropoutCase{DType::bf16, 64, 200, 6, 2, 0.5}}) {
    SCOPED_TRACE(describe(c));
    std::printf("%s\n", describe(c).c_str());
    const Tensor q_host = host_randn({B, c.T, c.H, c.D}, c.dtype);
    const Tensor k_host = host_randn({B, c.T, c.Hkv, c.D}, c.dtype);
    const Tensor v_host = host_randn({B, c.T, c.Hkv, c.D}, c.dtype);
    const Tensor dout_host = host_randn({B, c.T, c.H, c.D}, c.dtype);
    const Tensor q = heads_of(to_gpu(q_host)), k = heads_of(to_gpu(k_host)),
                 v = heads_of(to_gpu(v_host)), dout = heads_of(to_gpu(dout_host));
    const double scale = 1.0 / std::sqrt(double(c.D));
    // An offset that is not a multiple of anything the kernels tile by.
    const DropoutDraw dropout{c.p, 0x5eed0000ull + uint64_t(c.T), 1234567};
    const std::vector<double> mask =
        host_mask(B * c.H * c.T * c.T, c.p, dropout.seed, dropout.offset);
    int64_t dropped = 0, causal = 0;  // among the probabilities the causal mask leaves
    for (int64_t z = 0; z < B * c.H; ++z)
      for (int64_t i = 0; i < c.T; ++i)
        for (int64_t j = 0; j <= i; ++j, ++causal) dropped += mask[(z * c.T + i) * c.T + j] == 0;
    EXPECT_NEAR(double(dropped) / double(causal), c.p, 0.02) << "the host mask's drop rate";
    const AttentionReference ref =
        reference_attention(host_bhtd(q_host), host_bhtd(k_host), host_bhtd(v_host),
                            host_bhtd(dout_host), B, c.H, c.Hkv, c.T, c.D, scale, mask);
    const double tol = tolerance(c.dtype);

    const Tensor out = heads_of(poisoned({B, c.T, c.H, c.D}, c.dtype));
    const Tensor lse = poisoned({B, c.H, c.T}, DType::f32);
    cuda::flash_attention_dropout_forward(q, k, v, scale, dropout, out, lse);
    expect_within(values(raw::contiguous(out)), ref.out, tol, "out");
    expect_within(values(lse), ref.lse, 2e-5, "lse (of the undropped probabilities)");

    const Tensor dq = heads_of(poisoned({B, c.T, c.H, c.D}, c.dtype));
    const Tensor dk = heads_of(poisoned({B, c.T, c.Hkv, c.D}, c.dtype));
    const Tensor dv = heads_of(poisoned({B, c.T, c.Hkv, c.D}, c.dtype));
    cuda::flash_attention_dropout_backward(q, k, v, out, dout, lse, scale, dropout, dq, dk, dv);
    expect_within(values(raw::contiguous(dq)), ref.dq, 2 * tol, "dq");
    expect_within(values(raw::contiguous(dk)), ref.dk, 2 * tol, "dk (summed over the group)");
    expect_within(values(raw::contiguous(dv)), ref.dv, 2 * tol, "dv (summed over the group)");

    // Another draw drops other probabilities: the kernels read the seed and the offset.
    const Tensor out2 = heads_of(poisoned({B, c.T, c.H, c.D}, c.dtype));
    cuda::flash_attention_dropout_forward(q, k, v, scale, {c.p, dropout.seed, dropout.offset + 1},
                                          out2, lse);
    EXPECT_GT(max_rel_error(values(raw::contiguous(out2)), ref.out), 10 * tol);
  }
}

// scaled_dot_product_attention with dropout on the GPU takes the kernels (its backward node
// says so) and gives what the composed route gives from the same generator state, leaving the
// generator where the composed route leaves it.
TEST(AttentionDropoutCuda, AutogradTakesTheKernelsAndMatchesComposedDropout) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 2, H = 4, T = 150, D = 64;
  const double p = 0.2;
  const Tensor q_host = host_randn({B, T, H, D}, DType::bf16);
  const Tensor k_host = host_randn({B, T, H, D}, DType::bf16);
  const Tensor v_host = host_randn({B, T, H, D}, DType::bf16);
  const Tensor dout = to_gpu(host_randn({B, H, T, D}, DType::bf16));
  std::vector<std::vector<double>> outs, grads;
  std::vector<uint64_t> offsets;
  for (bool flash : {true, false}) {
    Generator gen(2024);
    gen.reserve(5);  // a draw that starts past zero
    Tensor q_leaf = to_gpu(q_host).requires_grad_(), k_leaf = to_gpu(k_host).requires_grad_(),
           v_leaf = to_gpu(v_host).requires_grad_();
    const Tensor q = q_leaf.transpose(1, 2), k = k_leaf.transpose(1, 2), v = v_leaf.transpose(1, 2);
    const Tensor out = scaled_dot_product_attention(q, k, v, /*causal=*/true, p, &gen, flash);
    EXPECT_EQ(autograd::meta_of(out).grad_fn->name == "FlashAttentionDropoutBackward", flash);
    out.backward(dout);
    offsets.push_back(gen.offset());
    outs.push_back(host_values(out));
    for (const Tensor& t : {q_leaf, k_leaf, v_leaf}) grads.push_back(host_values(t.grad()));
  }
  EXPECT_EQ(offsets[0], offsets[1]) << "both routes reserve the same Philox blocks";
  expect_within(outs[0], outs[1], 2 * tolerance(DType::bf16), "out, kernels vs composed");
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i)
    expect_within(grads[i], grads[i + 3], 4 * tolerance(DType::bf16),
                  std::string(names[i]) + ", kernels vs composed");
}

TEST(AttentionDropoutCuda, ProbabilitiesOutsideTheOpenIntervalAreRefused) {
  TESSERA_REQUIRE_GPU();
  const Tensor q = to_gpu(host_randn({1, 2, 33, 64}, DType::bf16));
  const Tensor out = empty(q.shape(), {.dtype = DType::bf16, .device = dev()});
  const Tensor lse = empty({1, 2, 33}, {.dtype = DType::f32, .device = dev()});
  for (double p : {0.0, 1.0, -0.5}) {
    try {
      cuda::flash_attention_dropout_forward(q, q, q, 0.125, {p, 1, 0}, out, lse);
      ADD_FAILURE() << "p = " << p << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("must lie in (0, 1)"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tessera
