// GPT-2's MLP GEMMs with the GELU in cuBLASLt epilogues (kernels/cuda/linear.h):
// linear_gelu_forward (GELU_AUX_BIAS / GELU_AUX) and linear_input_grad_dgelu (DGELU, then a
// column sum for the bias gradient) against float64 CPU references, for f32, bf16 and f16, on the fused path and on the
// forced fallback; shapes cuBLASLt refuses (an aux leading dimension not divisible by 8) fall
// back and are counted; GPT-2 124M's shapes really take the fused path. Then mlp_gelu and a
// small GPT's forward and backward on CUDA against the composed MLP.
#include <cmath>
#include <cstdio>

#include "cuda_test_util.h"
#include "tessera/autograd/functions.h"
#include "tessera/kernels/cuda/linear.h"
#include "tessera/nn/gpt.h"
#include "tests/gelu_reference.h"

namespace tessera {
namespace {
using namespace cuda_test;

using test::gelu_tanh;
using test::gelu_tanh_grad;

// The outputs are rounded once to the dtype; f32 allows for the epilogue's own tanh.
double mlp_tolerance(DType t) {
  switch (t) {
    case DType::f32:
      return 1e-4;
    case DType::f16:
      return 4e-3;
    default:
      return 1.6e-2;
  }
}

// [M, K] @ [K, N] (+ bias) in float64, from the (rounded) host inputs.
std::vector<double> ref_affine(const Tensor& xh, const Tensor& wh, const Tensor& bh) {
  const int64_t M = xh.size(0), K = xh.size(1), N = wh.size(1);
  std::vector<double> out = ref_matmul(values(xh), values(wh), 1, M, K, N, false, false);
  if (bh.defined()) {
    const std::vector<double> b = values(bh);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) out[i * N + j] += b[j];
  }
  return out;
}

struct GemmShape {
  int64_t M, K, N;
  bool aux_ok;  // N (the aux matrix's leading dimension) divisible by 8
};
// GPT-2 124M's c_fc at 512 rows; a small accepted shape; odd sizes cuBLASLt refuses.
const std::vector<GemmShape> kShapes = {
    {512, 768, 3072, true}, {33, 64, 40, true}, {37, 19, 53, false}, {5, 24, 9, false}};

int64_t fused_delta(const cuda::LinearPathCounts& a, const cuda::LinearPathCounts& b) {
  return b.fused - a.fused;
}

// The routes `calls` GELU calls took: with the epilogues off (or for a shape cuBLASLt refuses)
// all took the default passes (counted as fallback); with them on bf16 (the training dtype)
// must take the epilogue, while for f32/f16 it is cuBLASLt's choice.
void expect_routes(bool epilogues, DType t, const cuda::LinearPathCounts& before,
                   const cuda::LinearPathCounts& after, int64_t calls, const std::string& what) {
  if (!epilogues) {
    EXPECT_EQ(fused_delta(before, after), 0) << what;
    EXPECT_EQ(after.fallback - before.fallback, calls) << "the default GELU passes for " << what;
  } else if (t == DType::bf16) {
    EXPECT_EQ(fused_delta(before, after), calls)
        << "cuBLASLt refused the GELU epilogue for " << what;
  }
}

// For the report: which route one call took where the epilogue was possible.
void report_route(const std::string& what, const cuda::LinearPathCounts& before,
                  const cuda::LinearPathCounts& after) {
  std::printf("  %-58s %s\n", what.c_str(),
              fused_delta(before, after) == 1 ? "took the epilogue" : "fell back");
}

// linear_gelu_forward for every dtype, shape and bias choice against float64; returns nothing,
// checks counts: refused shapes and forced fallbacks count as fallback, and with epilogues bf16
// at accepted shapes must take the fused path.
void check_forward(bool epilogues) {
  cuda::set_linear_epilogues_enabled(epilogues);
  cuda::set_gelu_epilogues_enabled(epilogues);
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const GemmShape& s : kShapes) {
      Tensor xh = host_randn({s.M, s.K}, t), wh = host_randn({s.K, s.N}, t, 0.0, 0.05),
             bh = host_randn({s.N}, t, 0.0, 0.5);
      const std::vector<double> gemm = ref_affine(xh, wh, Tensor());
      for (bool with_bias : {true, false}) {
        const std::string what = std::string(dtype_name(t)) + " M=" + std::to_string(s.M) +
                                 " K=" + std::to_string(s.K) + " N=" + std::to_string(s.N) +
                                 (with_bias ? " bias" : "") + (epilogues ? " fused" : " fallback");
        SCOPED_TRACE(what);
        std::vector<double> pre = gemm;
        if (with_bias) {
          const std::vector<double> b = values(bh);
          for (int64_t i = 0; i < s.M; ++i)
            for (int64_t j = 0; j < s.N; ++j) pre[i * s.N + j] += b[j];
        }
        std::vector<double> act(pre.size());
        for (size_t i = 0; i < pre.size(); ++i) act[i] = gelu_tanh(pre[i]);
        Tensor out = poisoned({s.M, s.N}, t), pre_out = poisoned({s.M, s.N}, t);
        const auto before = cuda::linear_gelu_path_counts();
        cuda::linear_gelu_forward(to_gpu(xh), to_gpu(wh), with_bias ? to_gpu(bh) : Tensor(), out,
                                  pre_out);
        const auto after = cuda::linear_gelu_path_counts();
        expect_within(values(pre_out), pre, mlp_tolerance(t), what + " pre_activation");
        expect_within(values(out), act, mlp_tolerance(t), what + " gelu");
        expect_routes(epilogues && s.aux_ok, t, before, after, 1, what);
        if (epilogues && s.aux_ok) report_route(what, before, after);
      }
    }
  }
  cuda::set_linear_epilogues_enabled(true);
  cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);  // the default
}

// linear_input_grad_dgelu: g [M, N] with w [H, N], pre [M, H] (H = s.N here, the aux ld).
void check_backward(bool epilogues) {
  cuda::set_linear_epilogues_enabled(epilogues);
  cuda::set_gelu_epilogues_enabled(epilogues);
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    for (const GemmShape& s : kShapes) {
      // The 124M shape's backward: g [512, 768], w_proj [3072, 768], pre [512, 3072].
      const int64_t M = s.M, N = s.K, H = s.N;
      Tensor gh = host_randn({M, N}, t), wh = host_randn({H, N}, t, 0.0, 0.05),
             preh = host_randn({M, H}, t);
      const std::vector<double> w = values(wh), p = values(preh);
      std::vector<double> wT(N * H);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t n = 0; n < N; ++n) wT[n * H + h] = w[h * N + n];
      std::vector<double> dpre = ref_matmul(values(gh), wT, 1, M, N, H, false, false);
      std::vector<double> dbias(H, 0.0);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t h = 0; h < H; ++h) {
          dpre[i * H + h] *= gelu_tanh_grad(p[i * H + h]);
          dbias[h] += dpre[i * H + h];
        }
      for (bool with_db : {true, false}) {
        const std::string what = std::string(dtype_name(t)) + " M=" + std::to_string(M) +
                                 " N=" + std::to_string(N) + " H=" + std::to_string(H) +
                                 (with_db ? " dbias" : "") + (epilogues ? " fused" : " fallback");
        SCOPED_TRACE(what);
        Tensor out = poisoned({M, H}, t), db = with_db ? poisoned({H}, t) : Tensor();
        const auto before = cuda::linear_gelu_path_counts();
        cuda::linear_input_grad_dgelu(to_gpu(gh), to_gpu(wh), to_gpu(preh), out, db);
        const auto after = cuda::linear_gelu_path_counts();
        expect_within(values(out), dpre, mlp_tolerance(t), what + " dpre");
        if (!epilogues) {
          // The default route's dpre is the GEMM then binary(GeluBackward), bit for bit.
          const Tensor dact = empty({M, H}, {.dtype = t, .device = dev()});
          cuda::linear_forward(to_gpu(gh), raw::transpose(to_gpu(wh), 0, 1), Tensor(), dact);
          EXPECT_EQ(values(out), values(ops::gelu_backward(to_gpu(preh), dact)));
        }
        // The bias gradient sums M rounded-or-not terms: relative to its largest element.
        if (with_db) expect_within(values(db), dbias, 2 * mlp_tolerance(t), what + " dbias");
        expect_routes(epilogues && s.aux_ok, t, before, after, 1, what);
        if (epilogues && s.aux_ok) report_route(what, before, after);
      }
    }
  }
  cuda::set_linear_epilogues_enabled(true);
  cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);  // the default
}

TEST(CudaMlpGeluLt, ForwardFusedAndFallbackMatchFloat64) {
  TESSERA_REQUIRE_GPU();
  check_forward(/*epilogues=*/true);
  check_forward(/*epilogues=*/false);
}

TEST(CudaMlpGeluLt, InputGradThroughGeluFusedAndFallbackMatchFloat64) {
  TESSERA_REQUIRE_GPU();
  check_backward(/*epilogues=*/true);
  check_backward(/*epilogues=*/false);
}

TEST(CudaMlpGeluLt, Float32BiasUnderAutocastAndEmptyRows) {
  TESSERA_REQUIRE_GPU();
  const int64_t M = 65, K = 64, N = 96;
  Tensor xh = host_randn({M, K}, DType::bf16), wh = host_randn({K, N}, DType::bf16, 0.0, 0.1),
         bh = host_randn({N}, DType::f32);
  std::vector<double> pre = ref_affine(xh, wh, bh), act(pre.size());
  for (size_t i = 0; i < pre.size(); ++i) act[i] = gelu_tanh(pre[i]);
  Tensor out = poisoned({M, N}, DType::bf16), pre_out = poisoned({M, N}, DType::bf16);
  cuda::linear_gelu_forward(to_gpu(xh), to_gpu(wh), to_gpu(bh), out, pre_out);
  expect_within(values(out), act, mlp_tolerance(DType::bf16), "bf16 out, f32 bias: gelu");
  expect_within(values(pre_out), pre, mlp_tolerance(DType::bf16), "bf16 out, f32 bias: pre");
  // No rows: nothing to write, and the bias gradient is zeros.
  Tensor dpre = poisoned({0, N}, DType::bf16), db = poisoned({N}, DType::bf16);
  cuda::linear_input_grad_dgelu(empty({0, K}, {.dtype = DType::bf16, .device = dev()}),
                                to_gpu(host_randn({N, K}, DType::bf16)),
                                empty({0, N}, {.dtype = DType::bf16, .device = dev()}), dpre, db);
  for (double v : values(db)) EXPECT_EQ(v, 0.0);
}

TEST(CudaMlpGeluLt, BadInputsRaise) {
  TESSERA_REQUIRE_GPU();
  const Tensor x = to_gpu(host_randn({5, 4})), w = to_gpu(host_randn({4, 8}));
  Tensor out = poisoned({5, 8}, DType::f32);
  EXPECT_THROW(cuda::linear_gelu_forward(x, w, Tensor(), out, poisoned({5, 7}, DType::f32)), Error);
  EXPECT_THROW(cuda::linear_gelu_forward(x, w, Tensor(), out, poisoned({5, 8}, DType::bf16)),
               Error);
  EXPECT_THROW(
      cuda::linear_gelu_forward(x, w, to_gpu(host_randn({4})), out, poisoned({5, 8}, DType::f32)),
      Error);
  const Tensor g = to_gpu(host_randn({5, 3})), wp = to_gpu(host_randn({8, 3}));
  EXPECT_THROW(cuda::linear_input_grad_dgelu(g, wp, poisoned({5, 7}, DType::f32), out, Tensor()),
               Error);
  EXPECT_THROW(cuda::linear_input_grad_dgelu(g, wp, poisoned({5, 8}, DType::f32), out,
                                             poisoned({7}, DType::f32)),
               Error);
}

// mlp_gelu on CUDA (one fused node) against the composed Linear -> GELU -> Linear on CUDA,
// forward and all five gradients, at GPT-2 124M's MLP shape on 512 rows, through the default
// GELU passes and through cuBLASLt's epilogues.
TEST(CudaMlpGeluLt, AutogradMlpMatchesTheComposedMlp) {
  TESSERA_REQUIRE_GPU();
  for (const bool epilogues : {false, true})
    for (DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + (epilogues ? " epilogues" : " default passes"));
      cuda::set_gelu_epilogues_enabled(epilogues);
      const int64_t B = 2, T = 256, C = 768, H = 3072;
      std::vector<Tensor> host = {host_randn({B, T, C}, t), host_randn({C, H}, t, 0.0, 0.02),
                                  host_randn({H}, t, 0.0, 0.1), host_randn({H, C}, t, 0.0, 0.02),
                                  host_randn({C}, t, 0.0, 0.1)};
      std::vector<Tensor> fused, plain;
      for (const Tensor& h : host) {
        fused.push_back(to_gpu(h).requires_grad_());
        plain.push_back(to_gpu(h).requires_grad_());
      }
      const auto before = cuda::linear_gelu_path_counts();
      const Tensor yf = mlp_gelu(fused[0], fused[1], fused[2], fused[3], fused[4]);
      const Tensor yp = linear(gelu(linear(plain[0], plain[1], plain[2])), plain[3], plain[4]);
      const Tensor dy = to_gpu(host_randn({B, T, C}, t));
      autograd::backward({yf}, {dy});
      autograd::backward({yp}, {dy});
      const auto after = cuda::linear_gelu_path_counts();
      cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);  // the default
      expect_routes(epilogues, t, before, after, 2, "the MLP node");
      expect_within(values(yf), values(yp), mlp_tolerance(t), "y");
      const char* names[] = {"dx", "dw_fc", "db_fc", "dw_proj", "db_proj"};
      for (int i = 0; i < 5; ++i)
        expect_within(values(fused[i].grad()), values(plain[i].grad()), 2 * mlp_tolerance(t),
                      names[i]);
    }
}

// A small GPT's loss and gradients on CUDA with the fused MLP against the composed one.
TEST(CudaMlpGeluLt, GptForwardBackwardMatchesTheComposedMlp) {
  TESSERA_REQUIRE_GPU();
  const nn::GPTConfig cfg{
      .vocab_size = 101, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 128};
  for (const bool epilogues : {false, true})
    for (DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + (epilogues ? " epilogues" : " default passes"));
      cuda::set_gelu_epilogues_enabled(epilogues);
      Generator g1(3), g2(3);
      nn::GPT fused(cfg, &g1), plain(cfg, &g2);
      for (nn::GPT* m : {&fused, &plain}) m->to(dev(), t);
      for (nn::GPTFastBlock& block : fused.fast_blocks) block.use_fused_mlp = true;
      for (nn::GPTFastBlock& block : plain.fast_blocks) block.use_fused_mlp = false;
      Generator data(4);
      const Tensor idx = randint(0, 101, {4, 64}, {.dtype = DType::i64}, &data).to(dev());
      const Tensor targets = randint(0, 101, {4, 64}, {.dtype = DType::i64}, &data).to(dev());
      const auto before = cuda::linear_gelu_path_counts();
      const Tensor lf = fused.loss(idx, targets), lp = plain.loss(idx, targets);
      lf.backward();
      lp.backward();
      const auto after = cuda::linear_gelu_path_counts();
      cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);  // the default
      EXPECT_EQ(fused.fast_blocks[0].fused_mlp_calls(), 1);
      EXPECT_EQ(plain.fast_blocks[0].fused_mlp_calls(), 0);
      expect_routes(epilogues, t, before, after, 2 * cfg.n_layer, "the GPT's MLPs");
      EXPECT_NEAR(lf.item(), lp.item(), (t == DType::f32 ? 1e-5 : 2e-2) * std::abs(lp.item()));
      for (auto& [name, p] : plain.named_parameters()) {
        const Tensor gf = fused.parameter(name).grad(), gp = p.grad();
        ASSERT_TRUE(gf.defined() && gp.defined()) << name;
        expect_within(values(gf), values(gp), t == DType::f32 ? 1e-3 : 5e-2, name);
      }
    }
}

}  // namespace
}  // namespace tessera
