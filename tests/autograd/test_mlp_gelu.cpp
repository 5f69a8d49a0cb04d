// mlp_gelu (GPT-2's MLP, c_fc -> GELU tanh -> c_proj, as one function): its forward and all
// five gradients against a float64 reference written out here and against finite differences;
// on the CPU it is the composition, bit for bit. Its fused route (one tape node using the
// device's linear_gelu_forward / linear_input_grad_dgelu entries) is exercised here too, with
// CPU entries this test installs (built from the plain ops), so its gradient bookkeeping
// (which input gets which gradient, subsets of inputs requiring grad, autocast) is checked
// without a GPU; tests/cuda checks the cuBLASLt kernels themselves.
#include <cmath>

#include "cpu_mlp_entries.h"
#include "gradcheck.h"
#include "tessera/autograd/autocast.h"
#include "tessera/kernels/fused_table.h"
#include "tests/gelu_reference.h"

namespace tessera {
namespace {

using testing::CpuMlpEntries;
using testing::gradcheck;
using testing::leaf;
using testing::random_f64;
using testing::transposed_leaf;
using Xs = std::vector<Tensor>;

// ---- a float64 reference, loops only ----

using test::gelu_tanh;
using test::gelu_tanh_grad;

struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double& at(int64_t r, int64_t c) { return v[r * cols + c]; }
  double at(int64_t r, int64_t c) const { return v[r * cols + c]; }
};
Matrix matrix_of(const Tensor& t) {
  const Tensor m = ops::reshape(ops::contiguous(t.detach().to(DType::f64)), {-1, t.size(-1)});
  return {m.size(0), m.size(1), m.to_vector<double>()};
}
// a @ b, with a or b read transposed when asked.
Matrix product(const Matrix& a, bool ta, const Matrix& b, bool tb) {
  const int64_t M = ta ? a.cols : a.rows, K = ta ? a.rows : a.cols, N = tb ? b.rows : b.cols;
  Matrix c{M, N, std::vector<double>(M * N, 0.0)};
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      const double av = ta ? a.at(k, i) : a.at(i, k);
      for (int64_t j = 0; j < N; ++j) c.at(i, j) += av * (tb ? b.at(j, k) : b.at(k, j));
    }
  return c;
}
std::vector<double> column_sums(const Matrix& m) {
  std::vector<double> s(m.cols, 0.0);
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) s[j] += m.at(i, j);
  return s;
}

struct Reference {
  Matrix y, dx, dw_fc, dw_proj;
  std::vector<double> db_fc, db_proj;
};

// y = gelu(x W_fc + b_fc) W_proj + b_proj and the gradients of sum(y * dy).
Reference reference(const Tensor& x, const Tensor& w_fc, const Tensor& b_fc, const Tensor& w_proj,
                    const Tensor& b_proj, const Tensor& dy) {
  const Matrix xm = matrix_of(x), wf = matrix_of(w_fc), wp = matrix_of(w_proj), g = matrix_of(dy);
  Matrix pre = product(xm, false, wf, false);
  if (b_fc.defined()) {
    const auto b = matrix_of(b_fc).v;
    for (int64_t i = 0; i < pre.rows; ++i)
      for (int64_t j = 0; j < pre.cols; ++j) pre.at(i, j) += b[j];
  }
  Matrix act = pre;
  for (double& v : act.v) v = gelu_tanh(v);
  Reference r;
  r.y = product(act, false, wp, false);
  if (b_proj.defined()) {
    const auto b = matrix_of(b_proj).v;
    for (int64_t i = 0; i < r.y.rows; ++i)
      for (int64_t j = 0; j < r.y.cols; ++j) r.y.at(i, j) += b[j];
  }
  r.dw_proj = product(act, true, g, false);
  r.db_proj = column_sums(g);
  Matrix dpre = product(g, false, wp, true);
  for (size_t i = 0; i < dpre.v.size(); ++i) dpre.v[i] *= gelu_tanh_grad(pre.v[i]);
  r.db_fc = column_sums(dpre);
  r.dw_fc = product(xm, true, dpre, false);
  r.dx = product(dpre, false, wf, true);
  return r;
}

double max_rel_error(const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = ops::contiguous(got.detach().to(DType::f64)).to_vector<double>();
  EXPECT_EQ(g.size(), want.size());
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size() && i < g.size(); ++i) {
    err = std::max(err, std::abs(g[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

struct MlpInputs {
  Tensor x, w_fc, b_fc, w_proj, b_proj;
  Xs all() const { return {x, w_fc, b_fc, w_proj, b_proj}; }
};

// Odd sizes: 37 rows (or [3, 7] of them), in 19, hidden 53, out 23; x a transposed view.
MlpInputs make_inputs(bool bias, bool three_d, uint64_t seed) {
  MlpInputs in;
  in.x = three_d ? transposed_leaf({3, 7, 19}, seed) : transposed_leaf({37, 19}, seed);
  in.w_fc = leaf(random_f64({19, 53}, seed + 1) * 0.3);
  in.w_proj = leaf(random_f64({53, 23}, seed + 2) * 0.3);
  if (bias) {
    in.b_fc = leaf(random_f64({53}, seed + 3) * 0.5);
    in.b_proj = leaf(random_f64({23}, seed + 4) * 0.5);
  }
  return in;
}

Tensor run(const Xs& v) { return mlp_gelu(v[0], v[1], v[2], v[3], v[4]); }
Tensor composed(const Xs& v) { return linear(gelu(linear(v[0], v[1], v[2])), v[3], v[4]); }

// Forward and every gradient against the float64 reference, within rtol.
void check_against_reference(const MlpInputs& in, double rtol) {
  autograd::zero_grad(in.all());
  const Tensor y = run(in.all());
  const Tensor dy = random_f64(y.shape(), 77);
  const Reference r = reference(in.x, in.w_fc, in.b_fc, in.w_proj, in.b_proj, dy);
  EXPECT_LT(max_rel_error(y, r.y.v), rtol) << "y";
  autograd::backward({y}, {dy.to(y.dtype())});
  EXPECT_EQ(in.x.grad().shape(), in.x.shape());
  EXPECT_LT(max_rel_error(in.x.grad(), r.dx.v), rtol) << "dx";
  EXPECT_LT(max_rel_error(in.w_fc.grad(), r.dw_fc.v), rtol) << "dw_fc";
  EXPECT_LT(max_rel_error(in.w_proj.grad(), r.dw_proj.v), rtol) << "dw_proj";
  if (in.b_fc.defined()) EXPECT_LT(max_rel_error(in.b_fc.grad(), r.db_fc), rtol) << "db_fc";
  if (in.b_proj.defined()) EXPECT_LT(max_rel_error(in.b_proj.grad(), r.db_proj), rtol) << "db_proj";
  autograd::zero_grad(in.all());
}

TEST(MlpGelu, MatchesFloat64ReferenceAndFiniteDifferences) {
  for (bool bias : {true, false}) {
    for (bool three_d : {false, true}) {
      SCOPED_TRACE(std::string(bias ? "with" : "without") + " biases, " +
                   (three_d ? "3-d" : "2-d"));
      const MlpInputs in = make_inputs(bias, three_d, 11);
      check_against_reference(in, 1e-12);
      EXPECT_TRUE(gradcheck(run, in.all()));
    }
  }
}

TEST(MlpGelu, IsTheCompositionBitForBitOnTheCpu) {
  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const MlpInputs f64 = make_inputs(true, true, 21);
    Xs a, b;
    for (const Tensor& t : f64.all()) {
      a.push_back(leaf(t.detach().to(dt)));
      b.push_back(leaf(t.detach().to(dt)));
    }
    const Tensor ya = run(a), yb = composed(b);
    EXPECT_EQ(ya.to_vector<double>(), yb.to_vector<double>());
    const Tensor dy = random_f64(ya.shape(), 5).to(dt);
    autograd::backward({ya}, {dy});
    autograd::backward({yb}, {dy});
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i].grad().to_vector<double>(), b[i].grad().to_vector<double>()) << "input " << i;
  }
}

TEST(MlpGelu, FusedRouteMatchesReferenceAndFiniteDifferences) {
  CpuMlpEntries entries;
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "with biases" : "without biases");
    const MlpInputs in = make_inputs(bias, true, 31);
    const Tensor y = run(in.all());
    EXPECT_EQ(CpuMlpEntries::forward_calls, 1);
    ASSERT_NE(autograd::meta_of(y).grad_fn, nullptr);
    EXPECT_EQ(autograd::meta_of(y).grad_fn->name, std::string("MlpGeluBackward"));
    check_against_reference(in, 1e-12);
    EXPECT_TRUE(gradcheck(run, in.all()));
    CpuMlpEntries::forward_calls = 0;
  }
}

TEST(MlpGelu, FusedRouteWithSomeInputsFrozen) {
  CpuMlpEntries entries;
  // Each input alone requiring grad, then the weights only (a frozen input): the gradients
  // that are asked for equal the composition's, the others stay undefined.
  for (int only = -1; only < 5; ++only) {
    SCOPED_TRACE("only input " + std::to_string(only));
    const MlpInputs in = make_inputs(true, false, 41);
    Xs fused_in, plain_in;
    for (int i = 0; i < 5; ++i) {
      const bool wanted = only < 0 ? (i == 1 || i == 3) : i == only;
      Tensor t = in.all()[i].detach();
      fused_in.push_back(wanted ? leaf(t) : t);
      plain_in.push_back(wanted ? leaf(t.clone()) : t);
    }
    const Tensor y = run(fused_in), yc = composed(plain_in);
    EXPECT_LT(ops::max_rel_error(y, yc), 1e-14);
    const Tensor dy = random_f64(y.shape(), 9);
    autograd::backward({y}, {dy});
    autograd::backward({yc}, {dy});
    for (int i = 0; i < 5; ++i) {
      if (!fused_in[i].requires_grad()) continue;
      ASSERT_TRUE(fused_in[i].grad().defined()) << "input " << i;
      EXPECT_LT(ops::max_rel_error(fused_in[i].grad(), plain_in[i].grad()), 1e-13) << "input " << i;
    }
  }
}

TEST(MlpGelu, FusedRouteCastsAsLinearDoesUnderAutocast) {
  CpuMlpEntries entries;
  const MlpInputs f64 = make_inputs(true, true, 51);
  Xs fused_in, plain_in;
  for (const Tensor& t : f64.all()) {
    fused_in.push_back(leaf(t.detach().to(DType::f32)));
    plain_in.push_back(leaf(t.detach().to(DType::f32)));
  }
  Tensor y, yc;
  {
    autograd::AutocastGuard autocast(DType::bf16);
    y = run(fused_in);
    yc = composed(plain_in);
  }
  EXPECT_EQ(CpuMlpEntries::forward_calls, 1);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(yc.dtype(), DType::bf16);
  EXPECT_EQ(y.to_vector<double>(), yc.to_vector<double>());
  const Tensor dy = random_f64(y.shape(), 3).to(DType::bf16);
  autograd::backward({y}, {dy});
  autograd::backward({yc}, {dy});
  for (size_t i = 0; i < fused_in.size(); ++i) {
    // f32 leaves get f32 gradients through the casts, as with the composed Linear layers.
    EXPECT_EQ(fused_in[i].grad().dtype(), DType::f32) << "input " << i;
    EXPECT_EQ(fused_in[i].grad().to_vector<double>(), plain_in[i].grad().to_vector<double>())
        << "input " << i;
  }
}

TEST(MlpGelu, RefusesShapesThatDoNotChain) {
  const Tensor x = random_f64({4, 6}, 1), w_fc = random_f64({6, 10}, 2);
  const Tensor w_proj = random_f64({10, 6}, 3);
  EXPECT_NE(testing::error_of([&] {
              mlp_gelu(x, random_f64({5, 10}, 4), Tensor(), w_proj, Tensor());
            }).find("do not chain"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              mlp_gelu(x, w_fc, Tensor(), random_f64({9, 6}, 5), Tensor());
            }).find("do not chain"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              mlp_gelu(x, w_fc, random_f64({9}, 6), w_proj, Tensor());
            }).find("b_fc of shape [9]"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              mlp_gelu(x, w_fc, Tensor(), w_proj, random_f64({7}, 7));
            }).find("b_proj of shape [7]"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera
