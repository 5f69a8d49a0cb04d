// GPT-2's c_attn and its attention as one node (causal_attention_qkv_projection) against the two
// ops composed (linear, then causal_attention_qkv: the same GEMMs and attention kernels): y, dx
// and dW bit for bit; the bias gradient, which the attention kernels sum as they store d(qkv),
// against float64 column sums of that d(qkv), on the Hopper kernels and on the mma.sync ones
// (TESSERA_ATTENTION_SM90_BWD=0), and bit for bit from one run to the next. Also the routes the
// node leaves to the composition, and autocast over f32 parameters.
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/nn/gpt.h"

namespace tessera {
namespace {

using namespace cuda_test;

struct Inputs {
  Tensor x, w, b, dy;  // host
  int64_t H;
};

Inputs make_inputs(DType t, int64_t B, int64_t T, int64_t in, int64_t H, int64_t D) {
  const int64_t C = H * D;
  return {host_randn({B, T, in}, t), host_randn({in, 3 * C}, t, 0.0, 1.0 / std::sqrt(double(in))),
          host_randn({3 * C}, t, 0.0, 0.5), host_randn({B, T, C}, t), H};
}

struct Result {
  std::vector<double> y, dx, dw, db;
  std::string node;
};

Result run_node(const Inputs& in, bool one_node) {
  const Tensor x = requiring_grad(to_gpu(in.x)), w = requiring_grad(to_gpu(in.w)),
               b = requiring_grad(to_gpu(in.b));
  const Tensor y = one_node ? causal_attention_qkv_projection(x, w, b, in.H)
                            : causal_attention_qkv(linear(x, w, b), in.H);
  Result r{.node = autograd::meta_of(y).grad_fn->name};
  autograd::backward({y}, {to_gpu(in.dy)});
  r.y = host_values(y);
  r.dx = host_values(x.grad());
  r.dw = host_values(w.grad());
  r.db = host_values(b.grad());
  return r;
}

// The column sums of d(qkv) in float64, d(qkv) from the composition's kernels (qkv a leaf), and
// the sums of the columns' magnitudes (the scale of each sum's f32 rounding error).
struct ColumnSums {
  std::vector<double> sums, magnitudes;
};
ColumnSums dqkv_column_sums(const Inputs& in) {
  Tensor qkv;
  {
    NoGradGuard no_grad;
    qkv = linear(to_gpu(in.x), to_gpu(in.w), to_gpu(in.b));
  }
  qkv.requires_grad_(true);
  autograd::backward({causal_attention_qkv(qkv, in.H)}, {to_gpu(in.dy)});
  const std::vector<double> g = host_values(qkv.grad());
  const int64_t cols = qkv.size(2), rows = qkv.size(0) * qkv.size(1);
  ColumnSums out{std::vector<double>(cols, 0.0), std::vector<double>(cols, 0.0)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      out.sums[c] += g[r * cols + c];
      out.magnitudes[c] += std::fabs(g[r * cols + c]);
    }
  return out;
}

// Each sum within its rounding to the dtype (half an ulp, taken as a whole one) plus an f32
// accumulation error over the column.
void expect_bias_grad(const std::vector<double>& got, const ColumnSums& want, DType t,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.sums.size()) << what;
  const double ulp = t == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int bad = 0;
  for (size_t c = 0; c < got.size(); ++c) {
    const double tol = ulp * std::fabs(want.sums[c]) + 1e-6 * want.magnitudes[c];
    if (!(std::fabs(got[c] - want.sums[c]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << ": column " << c << " got " << got[c] << ", float64 "
                    << want.sums[c] << " (tolerance " << tol << ")";
  }
  EXPECT_EQ(bad, 0) << what;
}

struct EnvRestorer {
  const char* name;
  std::string before;
  bool was_set;
  explicit EnvRestorer(const char* n) : name(n) {
    const char* v = std::getenv(n);
    was_set = v != nullptr;
    before = v ? v : "";
  }
  ~EnvRestorer() {
    if (was_set) ::setenv(name, before.c_str(), 1);
    else ::unsetenv(name);
  }
};

TEST(ProjectionAttentionCuda, OneNodeMatchesTheComposition) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore_backend;
  set_attention_backend(AttentionBackend::Flash);
  EnvRestorer restore_env("TESSERA_ATTENTION_SM90_BWD");
  constexpr int64_t kB = 2, kH = 3, kIn = 72;
  for (const char* kernels : {"1", "0"}) {
    ::setenv("TESSERA_ATTENTION_SM90_BWD", kernels, 1);
    for (DType t : {DType::bf16, DType::f16})
      for (int64_t T : {77, 300})
        for (int64_t D : {64, 128}) {
          SCOPED_TRACE(::testing::Message() << "TESSERA_ATTENTION_SM90_BWD=" << kernels << " "
                                            << dtype_name(t) << " T " << T << " D " << D);
          const Inputs in = make_inputs(t, kB, T, kIn, kH, D);
          EXPECT_TRUE(attention_qkv_projection_takes(to_gpu(in.x), to_gpu(in.w), to_gpu(in.b), kH));
          const Result fused = run_node(in, true), again = run_node(in, true),
                       composed = run_node(in, false);
          EXPECT_EQ(fused.node, "ProjectionAttentionQkvBackward");
          EXPECT_EQ(composed.node, "CausalAttentionQkvBackward");
          EXPECT_EQ(fused.y, composed.y);
          EXPECT_EQ(fused.dx, composed.dx);
          EXPECT_EQ(fused.dw, composed.dw);
          EXPECT_EQ(fused.db, again.db) << "the bias gradient must repeat bit for bit";
          const ColumnSums want = dqkv_column_sums(in);
          expect_bias_grad(fused.db, want, t, "one node's bias gradient");
          expect_bias_grad(composed.db, want, t, "the composition's bias gradient");
        }
  }
}

// GPT-2 124M's attention shape (12 heads of 64, 768 channels, T 1024): many row tiles per head.
TEST(ProjectionAttentionCuda, Gpt2SmallShape) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore_backend;
  set_attention_backend(AttentionBackend::Flash);
  const Inputs in = make_inputs(DType::bf16, 2, 1024, 768, 12, 64);
  const Result fused = run_node(in, true), composed = run_node(in, false);
  EXPECT_EQ(fused.node, "ProjectionAttentionQkvBackward");
  EXPECT_EQ(fused.y, composed.y);
  EXPECT_EQ(fused.dx, composed.dx);
  EXPECT_EQ(fused.dw, composed.dw);
  const ColumnSums want = dqkv_column_sums(in);
  expect_bias_grad(fused.db, want, DType::bf16, "one node's bias gradient");
  expect_bias_grad(composed.db, want, DType::bf16, "the composition's bias gradient");
}

// f32 parameters under autocast: the node runs in bf16 and the parameters get f32 gradients,
// close to the composition's (also under autocast).
TEST(ProjectionAttentionCuda, AutocastOverFloat32Parameters) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore_backend;
  set_attention_backend(AttentionBackend::Flash);
  const Inputs in = make_inputs(DType::f32, 2, 200, 64, 2, 64);
  Result runs[2];
  for (int one_node = 0; one_node < 2; ++one_node) {
    autograd::AutocastGuard autocast(DType::bf16);
    const Tensor x = requiring_grad(to_gpu(in.x)), w = requiring_grad(to_gpu(in.w)),
                 b = requiring_grad(to_gpu(in.b));
    EXPECT_TRUE(attention_qkv_projection_takes(x, w, b, in.H, autograd::autocast_dtype()));
    const Tensor y = one_node ? causal_attention_qkv_projection(x, w, b, in.H)
                              : causal_attention_qkv(linear(x, w, b), in.H);
    EXPECT_EQ(y.dtype(), DType::bf16);
    autograd::backward({y}, {to_gpu(raw::to(in.dy, Device::cpu(), DType::bf16))});
    EXPECT_EQ(w.grad().dtype(), DType::f32);
    EXPECT_EQ(b.grad().dtype(), DType::f32);
    runs[one_node] = {host_values(y), host_values(x.grad()), host_values(w.grad()),
                      host_values(b.grad()), ""};
  }
  EXPECT_EQ(runs[1].y, runs[0].y);
  EXPECT_EQ(runs[1].dx, runs[0].dx);
  EXPECT_EQ(runs[1].dw, runs[0].dw);
  expect_close(runs[1].db, runs[0].db, 1e-2, "bias gradient under autocast");
}

// Where the node does not apply it is the composition itself: no bias, the cuDNN backend, f32,
// a head size the kernels lack.
TEST(ProjectionAttentionCuda, OtherCasesAreTheComposition) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore_backend;
  set_attention_backend(AttentionBackend::Flash);
  const Inputs in = make_inputs(DType::bf16, 1, 33, 64, 2, 64);
  const Tensor x = to_gpu(in.x), w = to_gpu(in.w), b = to_gpu(in.b);
  EXPECT_FALSE(attention_qkv_projection_takes(x, w, Tensor(), 2));
  EXPECT_FALSE(attention_qkv_projection_takes(x, w, b, 4));  // D = 32
  EXPECT_FALSE(attention_qkv_projection_takes(raw::to(x, dev(), DType::f32),
                                              raw::to(w, dev(), DType::f32),
                                              raw::to(b, dev(), DType::f32), 2));
  const Tensor wg = requiring_grad(to_gpu(in.w));
  const Tensor y = causal_attention_qkv_projection(x, wg, Tensor(), 2);
  EXPECT_EQ(autograd::meta_of(y).grad_fn->name, "CausalAttentionQkvBackward");
  set_attention_backend(AttentionBackend::Cudnn);
  EXPECT_FALSE(attention_qkv_projection_takes(x, w, b, 2));
}

// A small GPT with c_attn and attention as one node against the composition: the same loss and
// the same gradients bit for bit, except c_attn's bias gradients (summed in another order).
TEST(ProjectionAttentionCuda, GptTrainsTheSameThroughTheNode) {
  TESSERA_REQUIRE_GPU();
  AttentionBackendRestorer restore_backend;
  set_attention_backend(AttentionBackend::Flash);
  const nn::GPTConfig cfg{
      .vocab_size = 101, .block_size = 96, .n_layer = 2, .n_head = 2, .n_embd = 128};
  Generator g1(5), g2(5);
  nn::GPT fused(cfg, &g1), plain(cfg, &g2);
  for (nn::GPT* m : {&fused, &plain}) m->to(dev(), DType::bf16);
  for (nn::GPTFastBlock& block : fused.fast_blocks) block.use_fused_projection = true;
  for (nn::GPTFastBlock& block : plain.fast_blocks) block.use_fused_projection = false;
  Generator data(6);
  const Tensor idx = randint(0, 101, {3, 96}, {.dtype = DType::i64}, &data).to(dev());
  const Tensor targets = randint(0, 101, {3, 96}, {.dtype = DType::i64}, &data).to(dev());
  const Tensor lf = fused.loss(idx, targets), lp = plain.loss(idx, targets);
  lf.backward();
  lp.backward();
  EXPECT_EQ(fused.fast_blocks[0].fused_projection_calls(), 1);
  EXPECT_EQ(plain.fast_blocks[0].fused_projection_calls(), 0);
  EXPECT_EQ(lf.item(), lp.item());
  for (auto& [name, p] : plain.named_parameters()) {
    SCOPED_TRACE(name);
    const Tensor gf = fused.parameter(name).grad(), gp = p.grad();
    ASSERT_TRUE(gf.defined() && gp.defined());
    if (name.find("attn.c_attn.bias") != std::string::npos)
      expect_close(host_values(gf), host_values(gp), 2e-2, name.c_str());
    else
      EXPECT_EQ(host_values(gf), host_values(gp));
  }
}

}  // namespace
}  // namespace tessera
