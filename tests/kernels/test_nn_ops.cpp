// softmax / log_softmax, layer norm, GELU and cross-entropy (forward and backward) against
// float64 references written here, plus finite differences for the backward formulas.
#include <algorithm>
#include <cmath>
#include <functional>

#include "tests/gelu_reference.h"
#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {

// Logical layout around one dim: element (o, k, i) of [outer, n, inner] is at (o*n + k)*inner + i.
struct AroundDim {
  int64_t outer = 1, n = 1, inner = 1;
  AroundDim(const Shape& shape, int64_t dim) {
    for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
      if (d < dim) outer *= shape[d];
      else if (d == dim) n = shape[d];
      else inner *= shape[d];
    }
  }
  int64_t at(int64_t o, int64_t k, int64_t i) const { return (o * n + k) * inner + i; }
};

// Reference softmax along dim over logical values.
std::vector<double> softmax_ref(const std::vector<double>& x, const Shape& shape, int64_t dim, bool log) {
  std::vector<double> out(x.size());
  const AroundDim L(shape, dim);
  for (int64_t o = 0; o < L.outer; ++o) {
    for (int64_t i = 0; i < L.inner; ++i) {
      double m = -INFINITY, s = 0;
      for (int64_t k = 0; k < L.n; ++k) m = std::max(m, x[L.at(o, k, i)]);
      for (int64_t k = 0; k < L.n; ++k) s += std::exp(x[L.at(o, k, i)] - m);
      for (int64_t k = 0; k < L.n; ++k) {
        const int64_t j = L.at(o, k, i);
        out[j] = log ? x[j] - m - std::log(s) : std::exp(x[j] - m) / s;
      }
    }
  }
  return out;
}

TEST(Softmax, ForwardAndBackwardAlongEveryDim) {
  const std::vector<Shape> shapes = {{7, 33}, {3, 5, 257}, {1, 1}, {2, 1, 7}, {300, 129}};
  uint64_t seed = 1;
  for (DType dt : kFloatDTypes) {
    for (const Shape& shape : shapes) {
      for (Layout layout : kLayouts) {
        if (skip_large_case(shape, dt, layout)) continue;
        for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
          for (bool log : {false, true}) {
            const Tensor x = random_tensor(shape, dt, seed++, layout, 3.0);
            const std::string what = std::string(log ? "log_softmax " : "softmax ") + dtype_name(dt) +
                                     " " + shape_str(shape) + " dim " + std::to_string(dim) + " " +
                                     layout_name(layout);
            const Tensor y = log ? ops::log_softmax(x, dim) : ops::softmax(x, dim);
            expect_close(y, softmax_ref(host(x), shape, dim, log), shape, tolerance(dt), what);
            // backward, with y as the kernel saw it and an arbitrary upstream gradient
            const Tensor dy = random_tensor(shape, dt, seed++, Layout::Transposed);
            const auto yv = host(y), g = host(dy);
            std::vector<double> want(yv.size());
            const AroundDim L(shape, dim);
            for (int64_t o = 0; o < L.outer; ++o) {
              for (int64_t i = 0; i < L.inner; ++i) {
                double dot = 0;
                for (int64_t k = 0; k < L.n; ++k) {
                  const int64_t j = L.at(o, k, i);
                  dot += log ? g[j] : g[j] * yv[j];
                }
                for (int64_t k = 0; k < L.n; ++k) {
                  const int64_t j = L.at(o, k, i);
                  want[j] = log ? g[j] - std::exp(yv[j]) * dot : yv[j] * (g[j] - dot);
                }
              }
            }
            // dy - dot cancels where the softmax saturates: the error is bounded relative to
            // the terms' size (|dy|, or |y * dy|), not to the (possibly tiny) result.
            const auto got = host(ops::softmax_backward(y, dy, dim, log));
            double max_diff = 0, scale = 0;
            for (size_t j = 0; j < want.size(); ++j) {
              max_diff = std::max(max_diff, std::fabs(got[j] - want[j]));
              scale = std::max({scale, std::fabs(want[j]), std::fabs(log ? g[j] : g[j] * yv[j])});
            }
            EXPECT_LE(max_diff, tolerance(dt) * 2 * scale) << what << " backward";
          }
        }
      }
    }
  }
}

TEST(Softmax, MaskedEntriesAreExactlyZeroAndLargeLogitsStable) {
  const Tensor x = from_vector<float>({1000, -INFINITY, 999, -INFINITY, 0, -1e4}, {2, 3});
  const auto y = host(ops::softmax(x, 1));
  EXPECT_EQ(y[1], 0.0);
  EXPECT_NEAR(y[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_EQ(y[3], 0.0);
  EXPECT_NEAR(y[4], 1.0, 1e-6);
  EXPECT_EQ(y[5], 0.0);
  const auto ly = host(ops::log_softmax(x, 1));
  EXPECT_NEAR(ly[5], -1e4, 1e-2);
  expect_error([] { ops::softmax(ones({3}, {.dtype = DType::i64}), 0); }, {"softmax", "int64"});
  expect_error([] { ops::softmax(ones({3, 2}), 2); }, {"softmax"});
}

struct LayerNormRef {
  std::vector<double> out, mean, rstd;
};

LayerNormRef layer_norm_ref(const std::vector<double>& x, const std::vector<double>* w,
                            const std::vector<double>* b, int64_t C, double eps) {
  LayerNormRef r;
  const int64_t rows = static_cast<int64_t>(x.size()) / C;
  r.out.resize(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    double mu = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mu += x[i * C + c];
    mu /= C;
    for (int64_t c = 0; c < C; ++c) var += (x[i * C + c] - mu) * (x[i * C + c] - mu);
    const double rs = 1 / std::sqrt(var / C + eps);
    r.mean.push_back(mu);
    r.rstd.push_back(rs);
    for (int64_t c = 0; c < C; ++c) {
      double v = (x[i * C + c] - mu) * rs;
      if (w) v *= (*w)[c];
      if (b) v += (*b)[c];
      r.out[i * C + c] = v;
    }
  }
  return r;
}

// Loss L = sum(out * G) of layer_norm(x; w, b) in float64, for finite differences.
double layer_norm_loss(const std::vector<double>& x, const std::vector<double>& w,
                       const std::vector<double>& b, const std::vector<double>& G, int64_t C) {
  const auto r = layer_norm_ref(x, &w, &b, C, 1e-5);
  double L = 0;
  for (size_t i = 0; i < G.size(); ++i) L += r.out[i] * G[i];
  return L;
}

TEST(LayerNorm, ForwardMatchesReferenceWithAndWithoutAffine) {
  const std::vector<Shape> shapes = {{7, 33}, {2, 3, 257}, {1, 1}, {5, 128}, {520, 129}};
  uint64_t seed = 200;
  for (DType dt : kFloatDTypes) {
    for (const Shape& shape : shapes) {
      for (Layout layout : kLayouts) {
        if (skip_large_case(shape, dt, layout)) continue;
        for (bool affine : {true, false}) {
          const int64_t C = shape.back();
          const Tensor x = ops::add(random_tensor(shape, dt, seed++, layout, 2.0), 0.5);
          const Tensor w = affine ? random_tensor({C}, dt, seed++) : Tensor();
          const Tensor b = affine ? random_tensor({C}, dt, seed++, Layout::Stepped) : Tensor();
          const auto wv = affine ? host(w) : std::vector<double>(), bv = affine ? host(b) : std::vector<double>();
          const auto want = layer_norm_ref(host(x), affine ? &wv : nullptr, affine ? &bv : nullptr, C, 1e-5);
          const auto got = ops::layer_norm(x, w, b, 1e-5);
          const std::string what = std::string("layer_norm ") + dtype_name(dt) + " " +
                                   shape_str(shape) + " " + layout_name(layout) + (affine ? " affine" : "");
          const Shape rows(shape.begin(), shape.end() - 1);
          expect_close(got.out, want.out, shape, tolerance(dt) * 2, what);
          // Statistics are f32, f64 for f64 inputs (whose backward then stays f64-accurate).
          const bool f64 = dt == DType::f64;
          EXPECT_EQ(got.mean.dtype(), f64 ? DType::f64 : DType::f32);
          expect_close(got.mean, want.mean, rows, f64 ? 1e-13 : 1e-6, what + " mean");
          expect_close(got.rstd, want.rstd, rows, f64 ? 1e-13 : 1e-6, what + " rstd");
        }
      }
    }
  }
}

TEST(LayerNorm, BackwardMatchesReferenceAndFiniteDifferences) {
  uint64_t seed = 300;
  for (DType dt : kFloatDTypes) {
    // C = 1 and 2 are left to the forward test: with C = 2 the true dx is ~0 (ill-conditioned);
    // with C = 1, x - mean is exactly 0 in float64 but not against the float32 saved mean.
    for (const Shape& shape : std::vector<Shape>{{7, 33}, {3, 2, 257}, {4, 3}, {300, 129}}) {
      for (Layout layout : {Layout::Contiguous, Layout::Transposed}) {
        if (skip_large_case(shape, dt, layout)) continue;
        const int64_t C = shape.back();
        const Tensor x = random_tensor(shape, dt, seed++, layout, 1.5);
        const Tensor w = random_tensor({C}, dt, seed++);
        const Tensor dy = random_tensor(shape, dt, seed++, Layout::Stepped);
        const auto fwd = ops::layer_norm(x, w, Tensor(), 1e-5);
        const auto g = ops::layer_norm_backward(dy, x, w, fwd.mean, fwd.rstd, true);
        // reference in float64 from the same inputs (statistics recomputed in float64)
        const auto xv = host(x), wv = host(w), gv = host(dy);
        const auto ref = layer_norm_ref(xv, nullptr, nullptr, C, 1e-5);
        const int64_t rows = x.numel() / C;
        std::vector<double> dx(xv.size()), dw(C, 0), db(C, 0);
        for (int64_t i = 0; i < rows; ++i) {
          double mg = 0, mgx = 0;
          for (int64_t c = 0; c < C; ++c) {
            const double xhat = ref.out[i * C + c], gg = gv[i * C + c] * wv[c];
            mg += gg / C;
            mgx += gg * xhat / C;
            dw[c] += gv[i * C + c] * xhat;
            db[c] += gv[i * C + c];
          }
          for (int64_t c = 0; c < C; ++c) {
            dx[i * C + c] = ref.rstd[i] * (gv[i * C + c] * wv[c] - mg - ref.out[i * C + c] * mgx);
          }
        }
        const std::string what = std::string("layer_norm_backward ") + dtype_name(dt) + " " +
                                 shape_str(shape) + " " + layout_name(layout);
        // The saved mean/rstd are float32 by contract, so f64 agrees to ~f32 precision.
        const double tol = dt == DType::f64 ? 1e-6 : tolerance(dt) * 5;
        expect_close(g.dx, dx, shape, tol, what + " dx");
        expect_close(g.dweight, dw, {C}, tol, what + " dw");
        expect_close(g.dbias, db, {C}, tol, what + " db");
        EXPECT_FALSE(ops::layer_norm_backward(dy, x, w, fwd.mean, fwd.rstd, false).dweight.defined());
      }
    }
  }
  // The reference formula itself against central differences of the float64 forward.
  const int64_t C = 7;
  Generator gen(9);
  const auto x = host(randn({3, C}, {.dtype = DType::f64}, &gen));
  const auto w = host(randn({C}, {.dtype = DType::f64}, &gen)), b = host(randn({C}, {.dtype = DType::f64}, &gen));
  const auto G = host(randn({3, C}, {.dtype = DType::f64}, &gen));
  const Tensor xt = from_vector(x, {3, C}, {.dtype = DType::f64}), wt = from_vector(w, {C}, {.dtype = DType::f64});
  const auto fwd = ops::layer_norm(xt, wt, from_vector(b, {C}, {.dtype = DType::f64}), 1e-5);
  const auto g = ops::layer_norm_backward(from_vector(G, {3, C}, {.dtype = DType::f64}), xt, wt,
                                          fwd.mean, fwd.rstd, true);
  const auto dx = host(g.dx), dw = host(g.dweight);
  const double h = 1e-6;
  for (int64_t i = 0; i < 3 * C; ++i) {
    auto xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd = (layer_norm_loss(xp, w, b, G, C) - layer_norm_loss(xm, w, b, G, C)) / (2 * h);
    EXPECT_NEAR(dx[i], fd, 1e-5) << "dx " << i;
  }
  for (int64_t c = 0; c < C; ++c) {
    auto wp = w, wm = w;
    wp[c] += h;
    wm[c] -= h;
    const double fd = (layer_norm_loss(x, wp, b, G, C) - layer_norm_loss(x, wm, b, G, C)) / (2 * h);
    EXPECT_NEAR(dw[c], fd, 1e-5) << "dw " << c;
  }
}

// Rows with a large mean (1e3 over C = 4096, spread 1): a plain f32 sum of the row loses the
// mean's low digits and every xhat of the row is off by the same amount. The forward and
// backward against float64 must stay within a few f32 ulps of the result; PyTorch's f32 CPU
// kernels are off by up to 2.6e-4 (out), 8.9e-5 (dx) and 4.7e-4 (dweight) on these inputs.
TEST(LayerNorm, RowsWithALargeMeanKeepFloat32Accuracy) {
  const int64_t rows = 8, C = 4096;
  Generator gen(17);
  const auto f32 = [](const Tensor& t) { return t.to(DType::f32); };
  const Tensor x = f32(ops::add(randn({rows, C}, {.dtype = DType::f64}, &gen), 1e3));
  const Tensor w = f32(ops::add(ops::mul(randn({C}, {.dtype = DType::f64}, &gen), 0.5), 1.0));
  const Tensor b = f32(randn({C}, {.dtype = DType::f64}, &gen));
  const Tensor dy = f32(randn({rows, C}, {.dtype = DType::f64}, &gen));
  const auto xv = host(x), wv = host(w), bv = host(b), gv = host(dy);
  const auto ref = layer_norm_ref(xv, &wv, &bv, C, 1e-5);
  std::vector<double> dx(xv.size()), dw(C, 0), db(C, 0);
  for (int64_t i = 0; i < rows; ++i) {
    double mg = 0, mgx = 0;
    std::vector<double> xhat(C);
    for (int64_t c = 0; c < C; ++c) {
      xhat[c] = (xv[i * C + c] - ref.mean[i]) * ref.rstd[i];
      mg += gv[i * C + c] * wv[c] / C;
      mgx += gv[i * C + c] * wv[c] * xhat[c] / C;
      dw[c] += gv[i * C + c] * xhat[c];
      db[c] += gv[i * C + c];
    }
    for (int64_t c = 0; c < C; ++c)
      dx[i * C + c] = ref.rstd[i] * (gv[i * C + c] * wv[c] - mg - xhat[c] * mgx);
  }
  const auto max_error = [](const Tensor& got, const std::vector<double>& want) {
    const auto g = host(got);
    double worst = 0;
    for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - want[i]));
    return worst;
  };
  const auto fwd = ops::layer_norm(x, w, b, 1e-5);
  const auto grads = ops::layer_norm_backward(dy, x, w, fwd.mean, fwd.rstd, true);
  // About 1e-6 each in the -march=native release build, 9e-6 (out) and 7e-6 (dx) in the -O1
  // sanitizer build; the plain f32 row sum gave 3.8e-4 and 1.4e-5, PyTorch's f32 1e-4 and more.
  EXPECT_LE(max_error(fwd.out, ref.out), 2e-5);
  EXPECT_LE(max_error(fwd.mean, ref.mean), 3.1e-5);  // the f32 mean itself: half an ulp of 1e3
  EXPECT_LE(max_error(grads.dx, dx), 1.2e-5);
  EXPECT_LE(max_error(grads.dweight, dw), 1e-5);
  EXPECT_LE(max_error(grads.dbias, db), 1e-5);
}

TEST(LayerNorm, BadInput) {
  expect_error([] { ops::layer_norm(ones({3, 4}), ones({5}), Tensor(), 1e-5); },
               {"layer_norm", "weight", "[5]", "[3, 4]"});
  expect_error([] { ops::layer_norm(ones({3, 4}), ones({4}, {.dtype = DType::f64}), Tensor(), 1e-5); },
               {"layer_norm", "float64"});
  expect_error([] { ops::layer_norm(ones({3, 4}, {.dtype = DType::i32}), Tensor(), Tensor(), 1e-5); },
               {"layer_norm", "int32"});
}

TEST(Gelu, ForwardAndBackwardFrontEnds) {
  for (DType dt : kFloatDTypes) {
    const Tensor x = random_tensor({7, 257}, dt, 400, Layout::Transposed, 3.0);
    const Tensor dy = random_tensor({7, 257}, dt, 401);
    const auto xv = host(x), gv = host(dy);
    std::vector<double> y, dx;
    for (size_t i = 0; i < xv.size(); ++i) {
      y.push_back(gelu_tanh(xv[i]));
      dx.push_back(gv[i] * gelu_tanh_grad(xv[i]));
    }
    expect_close(ops::gelu(x), y, {7, 257}, tolerance(dt), std::string("gelu ") + dtype_name(dt));
    const Tensor g = ops::gelu_backward(x, dy);
    EXPECT_EQ(g.dtype(), dt);
    expect_close(g, dx, {7, 257}, tolerance(dt), std::string("gelu_backward ") + dtype_name(dt));
  }
  expect_error([] { ops::gelu_backward(ones({3}), ones({4})); }, {"gelu_backward", "[3]", "[4]"});
}

// Reference per-row losses and dlogits (for an upstream gradient of 1 on the reduced loss).
void cross_entropy_ref(const std::vector<double>& x, const std::vector<int64_t>& t, int64_t V,
                       int64_t ignore, std::vector<double>& row_loss, std::vector<double>& softmax) {
  const int64_t N = static_cast<int64_t>(t.size());
  row_loss.assign(N, 0.0);
  softmax.assign(N * V, 0.0);
  for (int64_t r = 0; r < N; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, x[r * V + v]);
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[r * V + v] - m);
    for (int64_t v = 0; v < V; ++v) softmax[r * V + v] = std::exp(x[r * V + v] - m) / s;
    if (t[r] != ignore) row_loss[r] = m + std::log(s) - x[r * V + t[r]];
  }
}

TEST(CrossEntropy, ReductionsIgnoreIndexAndBackward) {
  uint64_t seed = 500;
  for (DType dt : kFloatDTypes) {
    for (const Shape& lead : std::vector<Shape>{{7}, {3, 11}, {1}, {2, 257}, {600}}) {
      for (Layout layout : {Layout::Contiguous, Layout::Stepped, Layout::Transposed}) {
        for (DType tdt : {DType::i64, DType::i32}) {
          const int64_t V = 65, ignore = -100;
          Shape shape = lead;
          shape.push_back(V);
          if (skip_large_case(shape, dt, layout) || (shape_numel(shape) >= kThreadedNumel && tdt == DType::i32)) continue;
          const Tensor logits = random_tensor(shape, dt, seed++, layout, 2.0);
          Generator gen(seed++);
          Tensor targets = randint(0, V, lead, {.dtype = DType::i64}, &gen);
          std::vector<int64_t> t = targets.to_vector<int64_t>();
          if (t.size() > 1) t[1] = ignore;  // one ignored row
          targets = from_vector(t, lead, {.dtype = tdt});
          std::vector<double> rows, sm;
          cross_entropy_ref(host(logits), t, V, ignore, rows, sm);
          double total = 0;
          int64_t used = 0;
          for (size_t r = 0; r < t.size(); ++r) if (t[r] != ignore) { total += rows[r]; ++used; }
          const std::string what = std::string("cross_entropy ") + dtype_name(dt) + " " +
                                   shape_str(shape) + " " + layout_name(layout);
          const double tol = dt == DType::f64 ? 1e-7 : tolerance(dt);  // loss is accumulated into f32
          const Tensor mean_loss = ops::cross_entropy(logits, targets, ignore);
          EXPECT_EQ(mean_loss.dim(), 0);
          EXPECT_EQ(mean_loss.dtype(), dt);
          expect_close(mean_loss, {total / used}, {}, tol, what + " mean");
          expect_close(ops::cross_entropy(logits, targets, ignore, ops::Reduction::Sum), {total}, {},
                       tol, what + " sum");
          expect_close(ops::cross_entropy(logits, targets, ignore, ops::Reduction::None), rows, lead,
                       tolerance(dt) * 2, what + " none");
          // backward: grad * (softmax - onehot) / used, zero rows for ignored targets
          for (auto red : {ops::Reduction::Mean, ops::Reduction::Sum}) {
            const double grad = 0.7, scale = red == ops::Reduction::Mean ? grad / used : grad;
            std::vector<double> want(sm.size());
            for (size_t r = 0; r < t.size(); ++r) {
              for (int64_t v = 0; v < V; ++v) {
                want[r * V + v] = t[r] == ignore ? 0 : scale * (sm[r * V + v] - (v == t[r] ? 1 : 0));
              }
            }
            const Tensor d = ops::cross_entropy_backward(logits, targets, grad, ignore, red);
            EXPECT_EQ(d.dtype(), dt);
            expect_close(d, want, shape, tolerance(dt) * 2, what + " backward");
          }
        }
      }
    }
  }
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const int64_t N = 4, V = 7;
  Generator gen(77);
  const auto x = host(randn({N, V}, {.dtype = DType::f64}, &gen));
  const std::vector<int64_t> t = {3, -100, 0, 6};
  const Tensor targets = from_vector(t, {N}, {.dtype = DType::i64});
  auto loss = [&](const std::vector<double>& xv) {
    return ops::cross_entropy(from_vector(xv, {N, V}, {.dtype = DType::f64}), targets).item();
  };
  const auto d = host(ops::cross_entropy_backward(from_vector(x, {N, V}, {.dtype = DType::f64}), targets, 1.0));
  for (int64_t i = 0; i < N * V; ++i) {
    auto xp = x, xm = x;
    xp[i] += 1e-2;  // a wide step: the loss is accumulated in f32
    xm[i] -= 1e-2;
    EXPECT_NEAR(d[i], (loss(xp) - loss(xm)) / 2e-2, 1e-4) << i;
  }
}

TEST(CrossEntropy, BadInputNamesTargetsAndShapes) {
  const Tensor logits = ones({4, 5});
  expect_error([&] { ops::cross_entropy(logits, from_vector<int64_t>({0, 1, 7, 2}, {4}, {.dtype = DType::i64})); },
               {"cross_entropy", "target 7", "5 classes"});
  expect_error([&] { ops::cross_entropy(logits, zeros({4})); }, {"cross_entropy", "targets", "float32"});
  expect_error([&] { ops::cross_entropy(logits, zeros({3}, {.dtype = DType::i64})); },
               {"cross_entropy", "[3]", "[4, 5]"});
  expect_error([&] {
    ops::cross_entropy(logits, from_vector<int64_t>({0, -1, 1, 2}, {4}, {.dtype = DType::i64}), -100,
                       ops::Reduction::None);
  }, {"cross_entropy", "out of range"});
  // every target ignored: the mean is NaN, as in PyTorch
  EXPECT_TRUE(std::isnan(ops::cross_entropy(logits, full({4}, -100, {.dtype = DType::i64})).item()));
}

}  // namespace
}  // namespace tessera::test
