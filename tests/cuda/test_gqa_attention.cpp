// Grouped-query attention (k, v with Hkv < H heads) in the fused CUDA attention paths: the
// hand-written flash kernels, the naive reference kernel and cuDNN's graph, forward and
// backward, against the float64 host reference (tests/cuda/attention_reference.h), in the
// layouts Llama hands them (q, k, v as [B, H, T, D] views of [B, T, H, D] buffers). Also the
// autograd path (scaled_dot_product_attention takes the fused kernels for GQA, no repeated
// K/V) and a bf16 Llama on the GPU against the CPU. Every comparison reports its max error.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

#include "attention_reference.h"
#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/nn/llama.h"

namespace tessera {
namespace {
using namespace cuda_test;

struct GqaCase {
  DType dtype;
  int64_t D, T, H, Hkv;
};

std::string describe(const GqaCase& c) {
  return std::string(dtype_name(c.dtype)) + " D=" + std::to_string(c.D) +
         " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " Hkv=" + std::to_string(c.Hkv);
}

// [B, heads, T, D] view of a [B, T, heads, D] buffer (Llama's q, k, v after the projections).
Tensor heads_of(const Tensor& bthd) { return raw::permute(bthd, {0, 2, 1, 3}); }
std::vector<double> host_bhtd(const Tensor& bthd) {
  return values(raw::contiguous(heads_of(bthd)));
}

struct Inputs {
  Tensor q_host, k_host, v_host, dout_host;  // [B, T, heads, D] host buffers
  Tensor q, k, v, dout;                      // [B, heads, T, D] GPU views
  AttentionReference ref;
  double scale;
};

Inputs make_inputs(const GqaCase& c) {
  const int64_t B = 2;
  Inputs in;
  in.q_host = host_randn({B, c.T, c.H, c.D}, c.dtype);
  in.k_host = host_randn({B, c.T, c.Hkv, c.D}, c.dtype);
  in.v_host = host_randn({B, c.T, c.Hkv, c.D}, c.dtype);
  in.dout_host = host_randn({B, c.T, c.H, c.D}, c.dtype);
  in.q = heads_of(to_gpu(in.q_host));
  in.k = heads_of(to_gpu(in.k_host));
  in.v = heads_of(to_gpu(in.v_host));
  in.dout = heads_of(to_gpu(in.dout_host));
  in.scale = 1.0 / std::sqrt(double(c.D));
  in.ref = reference_attention(host_bhtd(in.q_host), host_bhtd(in.k_host), host_bhtd(in.v_host),
                               host_bhtd(in.dout_host), B, c.H, c.Hkv, c.T, c.D, in.scale);
  return in;
}

struct Gradients {
  Tensor dq, dk, dv;
};

// dk, dv written through [B, Hkv, T, D] views of [B, T, Hkv, D] buffers (strided writes).
Gradients poisoned_gradients(const GqaCase& c) {
  return {poisoned({2, c.H, c.T, c.D}, c.dtype), heads_of(poisoned({2, c.T, c.Hkv, c.D}, c.dtype)),
          heads_of(poisoned({2, c.T, c.Hkv, c.D}, c.dtype))};
}

void expect_gradients(const Gradients& g, const AttentionReference& ref, double tol,
                      const std::string& what) {
  expect_within(values(g.dq), ref.dq, tol, what + " dq");
  expect_within(values(raw::contiguous(g.dk)), ref.dk, tol, what + " dk (summed over the group)");
  expect_within(values(raw::contiguous(g.dv)), ref.dv, tol, what + " dv (summed over the group)");
}

void check_flash_case(const GqaCase& c) {
  std::printf("%s\n", describe(c).c_str());
  const Inputs in = make_inputs(c);
  const double tol = tolerance(c.dtype);
  Tensor out = poisoned({2, c.H, c.T, c.D}, c.dtype), lse = poisoned({2, c.H, c.T}, DType::f32);
  cuda::flash_attention_forward(in.q, in.k, in.v, in.scale, out, lse);
  expect_within(values(out), in.ref.out, tol, "flash out");
  expect_within(values(lse), in.ref.lse, 2e-5, "flash lse");

  Tensor naive_out = poisoned({2, c.H, c.T, c.D}, c.dtype);
  Tensor naive_lse = poisoned({2, c.H, c.T}, DType::f32);
  cuda::naive_attention_forward(in.q, in.k, in.v, in.scale, naive_out, naive_lse);
  expect_within(values(naive_out), in.ref.out, tol, "naive out");

  const Gradients g = poisoned_gradients(c);
  cuda::flash_attention_backward(in.q, in.k, in.v, out, raw::contiguous(in.dout), lse, in.scale,
                                 g.dq, g.dk, g.dv);
  expect_gradients(g, in.ref, 2 * tol, "flash backward");
  // One block owns each key tile of a kv head and sums its group in registers: no atomics,
  // so a second run repeats the first bitwise.
  const Gradients again = poisoned_gradients(c);
  cuda::flash_attention_backward(in.q, in.k, in.v, out, raw::contiguous(in.dout), lse, in.scale,
                                 again.dq, again.dk, again.dv);
  EXPECT_EQ(values(again.dk), values(g.dk)) << describe(c) << ": flash dk not repeatable";
  EXPECT_EQ(values(again.dv), values(g.dv)) << describe(c) << ": flash dv not repeatable";

  std::string why;
  if (!cuda::cudnn_attention_available(&why)) {
    std::printf("  cuDNN attention unavailable (%s): its GQA graphs are not checked\n",
                why.c_str());
    return;
  }
  Tensor cudnn_out = heads_of(poisoned({2, c.T, c.H, c.D}, c.dtype));
  Tensor cudnn_lse = poisoned({2, c.H, c.T}, DType::f32);
  cuda::cudnn_attention_forward(in.q, in.k, in.v, in.scale, cudnn_out, cudnn_lse);
  expect_within(values(raw::contiguous(cudnn_out)), in.ref.out, tol, "cudnn out");
  expect_within(values(cudnn_lse), in.ref.lse, 2e-5, "cudnn lse");
  const Gradients cg = poisoned_gradients(c);
  cuda::cudnn_attention_backward(in.q, in.k, in.v, cudnn_out, in.dout, cudnn_lse, in.scale, cg.dq,
                                 cg.dk, cg.dv);
  expect_gradients(cg, in.ref, 2 * tol, "cudnn backward");
  // Each backward from the other's forward: one lse convention for GQA too.
  const Gradients cross = poisoned_gradients(c);
  cuda::cudnn_attention_backward(in.q, in.k, in.v, out, in.dout, lse, in.scale, cross.dq, cross.dk,
                                 cross.dv);
  expect_gradients(cross, in.ref, 2 * tol, "cudnn backward from the flash forward");
}

TEST(GqaAttentionCuda, FlashNaiveAndCudnnAgainstFloat64) {
  TESSERA_REQUIRE_GPU();
  // (T, H, Hkv): groups of 3 with a partial last tile, one kv head for all (MQA), and no
  // grouping at all (Hkv = H) through the same kernels.
  const std::tuple<int64_t, int64_t, int64_t> shapes[] = {{77, 6, 2}, {300, 4, 1}, {130, 3, 3}};
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (auto [T, H, Hkv] : shapes) {
        const GqaCase c{t, D, T, H, Hkv};
        SCOPED_TRACE(describe(c));
        check_flash_case(c);
        if (HasFatalFailure()) return;
      }
}

// scaled_dot_product_attention with GQA on the GPU runs the fused kernels (no repeated K/V)
// for either backend; its output and its gradients, through the transposes Llama applies,
// match the float64 reference.
TEST(GqaAttentionCuda, AutogradPathTakesTheFusedKernels) {
  TESSERA_REQUIRE_GPU();
  const GqaCase c{DType::bf16, 64, 200, 8, 2};
  const Inputs in = make_inputs(c);
  std::vector<AttentionBackend> backends{AttentionBackend::Flash};
  if (cuda::cudnn_attention_available()) backends.push_back(AttentionBackend::Cudnn);
  const AttentionBackendRestorer restore_backend;
  for (AttentionBackend backend : backends) {
    set_attention_backend(backend);
    const std::string what = std::string("sdpa (") + attention_backend_name(backend) + ")";
    std::printf("%s, %s\n", describe(c).c_str(), what.c_str());
    Tensor q_leaf = to_gpu(in.q_host).requires_grad_(), k_leaf = to_gpu(in.k_host).requires_grad_(),
           v_leaf = to_gpu(in.v_host).requires_grad_();
    const Tensor q = q_leaf.transpose(1, 2), k = k_leaf.transpose(1, 2), v = v_leaf.transpose(1, 2);
    EXPECT_TRUE(attention_takes(q, k, v, /*causal=*/true)) << what;
    const Tensor out = scaled_dot_product_attention(q, k, v, /*causal=*/true);
    ASSERT_EQ(out.shape(), (Shape{2, c.H, c.T, c.D}));
    expect_within(values(raw::contiguous(out)), in.ref.out, tolerance(c.dtype), what + " out");
    out.backward(in.dout);
    ASSERT_EQ(k_leaf.grad().shape(), k_leaf.shape()) << what;
    expect_within(host_bhtd(q_leaf.grad()), in.ref.dq, 2 * tolerance(c.dtype), what + " dq");
    expect_within(host_bhtd(k_leaf.grad()), in.ref.dk, 2 * tolerance(c.dtype), what + " dk");
    expect_within(host_bhtd(v_leaf.grad()), in.ref.dv, 2 * tolerance(c.dtype), what + " dv");
  }
}

TEST(GqaAttentionCuda, BadHeadCountsAndGradientShapesRaiseClearly) {
  TESSERA_REQUIRE_GPU();
  const int64_t B = 1, T = 33, D = 64;
  Tensor q = to_gpu(host_randn({B, 6, T, D}, DType::bf16));
  Tensor k4 = to_gpu(host_randn({B, 4, T, D}, DType::bf16));
  Tensor k2 = to_gpu(host_randn({B, 2, T, D}, DType::bf16));
  Tensor out = poisoned({B, 6, T, D}, DType::bf16), lse = poisoned({B, 6, T}, DType::f32);
  auto expect_error = [](auto&& call, const std::string& needle) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { cuda::flash_attention_forward(q, k4, k4, 1.0, out, lse); },
               "not a multiple of the 4 key/value heads");
  cuda::flash_attention_forward(q, k2, k2, 0.125, out, lse);
  Tensor dq = poisoned({B, 6, T, D}, DType::bf16), dk_wrong = poisoned({B, 6, T, D}, DType::bf16);
  Tensor dv = poisoned({B, 2, T, D}, DType::bf16);
  expect_error(
      [&] { cuda::flash_attention_backward(q, k2, k2, out, out, lse, 0.125, dq, dk_wrong, dv); },
      "dk must be a [1, 2, 33, 64]");
}

// A bf16 Llama (head dim 64, 2 kv heads for 4 query heads) on the GPU, whose attention runs
// the GQA flash kernels, against the same model in f32 on the CPU.
TEST(GqaAttentionCuda, Bf16LlamaOnTheGpuMatchesTheCpu) {
  TESSERA_REQUIRE_GPU();
  nn::LlamaConfig cfg{.vocab_size = 67,
                      .hidden_size = 256,
                      .intermediate_size = 384,
                      .num_hidden_layers = 2,
                      .num_attention_heads = 4,
                      .num_key_value_heads = 2,
                      .max_position_embeddings = 160};
  Generator gen(11);
  nn::Llama cpu_model(cfg, &gen), gpu_model(cfg);
  const nn::NamedTensors state = cpu_model.state_dict();
  gpu_model.load_state_dict(std::map<std::string, Tensor>(state.begin(), state.end()));
  gpu_model.to(dev());
  gpu_model.to(DType::bf16);
  const Tensor idx = randint(0, 67, {2, 150}, {.dtype = DType::i64}, &gen);
  const Tensor cpu_logits = cpu_model.forward(idx);
  const Tensor gpu_logits = raw::to(gpu_model.forward(to_gpu(idx)), Device::cpu(), DType::f32);
  const double err = ops::max_rel_error(gpu_logits, cpu_logits);
  std::printf("bf16 Llama logits on the GPU vs f32 on the CPU: max rel error %.3e\n", err);
  EXPECT_LE(err, 3e-2) << "bf16 Llama logits: max rel error " << err;
}

}  // namespace
}  // namespace tessera
