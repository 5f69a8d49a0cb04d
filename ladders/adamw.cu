// AdamW ladder: one optimizer step over n f32 parameters, PyTorch's formula (decoupled weight
// decay, bias-corrected moments, eps after the square root):
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p = p - lr * (wd * p + (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps))
// Purely memory-bound: per element p, g, m, v are read and p, m, v written (28 bytes).
//   v1 one kernel per line of the formula (what composing tensor ops does): m, then v, then p,
//      so g is read twice and m, v written then read again (40 bytes per element), and every
//      thread recomputes the bias corrections with powf.
//   v2 one fused kernel, one thread per element; the bias corrections computed once on the
//      host.
//   v3 fused, 128-bit loads and stores (4 floats), a grid-stride loop over a grid sized to the
//      GPU, and a scalar tail for n % 4.
//   v4 production (tessera::cuda::multi_tensor_adamw, kernels/cuda/multi_tensor.cu): one launch
//      for any number of tensors (a chunk table), here given one tensor; PyTorch's order of
//      the formula with host-computed coefficients, every operation rounded on its own
//      (core/adamw_math.h), so it gives the CPU AdamW's bits.
#include <algorithm>
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace ladders {
namespace {

struct AdamWArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float lr, beta1, beta2, eps, weight_decay;
  int step;
  float inv_bias1, inv_bias2;  // 1 / (1 - beta^step), from the host (v2 on)
};

__global__ void adamw_v1_first_moment(AdamWArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < a.n) a.m[i] = a.beta1 * a.m[i] + (1.f - a.beta1) * a.g[i];
}
__global__ void adamw_v1_second_moment(AdamWArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < a.n) a.v[i] = a.beta2 * a.v[i] + (1.f - a.beta2) * a.g[i] * a.g[i];
}
__global__ void adamw_v1_parameter(AdamWArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.n) return;
  const float m_hat = a.m[i] / (1.f - powf(a.beta1, float(a.step)));
  const float v_hat = a.v[i] / (1.f - powf(a.beta2, float(a.step)));
  a.p[i] -= a.lr * (a.weight_decay * a.p[i] + m_hat / (sqrtf(v_hat) + a.eps));
}

// One element's update; the same arithmetic for v2, v3's vectors and v3's tail.
__device__ __forceinline__ void adamw_update(const AdamWArgs& a, float& p, float g, float& m,
                                             float& v) {
  m = a.beta1 * m + (1.f - a.beta1) * g;
  v = a.beta2 * v + (1.f - a.beta2) * g * g;
  p -= a.lr * (a.weight_decay * p + (m * a.inv_bias1) / (sqrtf(v * a.inv_bias2) + a.eps));
}

__global__ void adamw_v2_fused(AdamWArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.n) return;
  float p = a.p[i], m = a.m[i], v = a.v[i];
  adamw_update(a, p, a.g[i], m, v);
  a.p[i] = p, a.m[i] = m, a.v[i] = v;
}

// cudaMalloc'd arrays start 256-byte aligned, so element 4k is a 16-byte boundary.
__global__ void adamw_v3_vectorised(AdamWArgs a) {
  const int64_t vectors = a.n / 4, stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < vectors; i += stride) {
    float4 p = reinterpret_cast<float4*>(a.p)[i], m = reinterpret_cast<float4*>(a.m)[i];
    float4 v = reinterpret_cast<float4*>(a.v)[i];
    const float4 g = reinterpret_cast<const float4*>(a.g)[i];
    adamw_update(a, p.x, g.x, m.x, v.x);
    adamw_update(a, p.y, g.y, m.y, v.y);
    adamw_update(a, p.z, g.z, m.z, v.z);
    adamw_update(a, p.w, g.w, m.w, v.w);
    reinterpret_cast<float4*>(a.p)[i] = p, reinterpret_cast<float4*>(a.m)[i] = m;
    reinterpret_cast<float4*>(a.v)[i] = v;
  }
  for (int64_t i = 4 * vectors + first; i < a.n; i += stride)
    adamw_update(a, a.p[i], a.g[i], a.m[i], a.v[i]);
}

int climb_at(int64_t n, bool timed) {
  const std::vector<float> hp = random_f32(n, 51, -1.f, 1.f), hg = random_f32(n, 52, -0.1f, 0.1f),
                           hm = random_f32(n, 53, -0.01f, 0.01f),
                           hv = random_f32(n, 54, 0.f, 1e-4f);
  DeviceArray<float> p(n), g(n), m(n), v(n), p0(n), m0(n), v0(n);
  p0.upload(hp), g.upload(hg), m0.upload(hm), v0.upload(hv);
  const int step = 10;
  const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  const AdamWArgs args{p.get(),
                       g.get(),
                       m.get(),
                       v.get(),
                       n,
                       lr,
                       beta1,
                       beta2,
                       eps,
                       weight_decay,
                       step,
                       float(1.0 / (1.0 - std::pow(double(beta1), step))),
                       float(1.0 / (1.0 - std::pow(double(beta2), step)))};

  // Every rung updates the state in place: each checked run starts from the same copy.
  auto reset = [&] { p.copy_from(p0), m.copy_from(m0), v.copy_from(v0); };
  auto check = [&] {
    ErrorStats e_p("param"), e_m("exp_avg"), e_v("exp_avg_sq");
    const std::vector<int64_t> at = sample_indices(n, 1 << 16);
    const std::vector<float> got_p = p.download(), got_m = m.download(), got_v = v.download();
    for (int64_t i : at) {
      const double mi = beta1 * double(hm[i]) + (1.0 - beta1) * hg[i];
      const double vi = beta2 * double(hv[i]) + (1.0 - beta2) * double(hg[i]) * hg[i];
      const double m_hat = mi / (1.0 - std::pow(double(beta1), step));
      const double v_hat = vi / (1.0 - std::pow(double(beta2), step));
      const double pi =
          hp[i] - lr * (weight_decay * double(hp[i]) + m_hat / (std::sqrt(v_hat) + eps));
      e_p.add(got_p[i], pi, i), e_m.add(got_m[i], mi, i), e_v.add(got_v[i], vi, i);
    }
    return std::vector<ErrorStats>{e_p, e_m, e_v};
  };
  const Workload work{strf("n=%lld f32", static_cast<long long>(n)), n * 28.0, 0, timed, 1e-5};
  Ladder ladder("adamw", work, reset, check);

  ladder.climb({"v1 one kernel per formula line", "", [&] {
                  adamw_v1_first_moment<<<blocks_for(n, 256), 256>>>(args);
                  adamw_v1_second_moment<<<blocks_for(n, 256), 256>>>(args);
                  adamw_v1_parameter<<<blocks_for(n, 256), 256>>>(args);
                }});
  ladder.climb({"v2 fused, one thread per element", "",
                [&] { adamw_v2_fused<<<blocks_for(n, 256), 256>>>(args); }});
  ladder.climb({"v3 fused, 128-bit, grid-stride", "", [&] {
                  const auto blocks = std::min<int64_t>(blocks_for(n / 4 + 1, 256), 8 * sm_count());
                  adamw_v3_vectorised<<<static_cast<unsigned>(blocks), 256>>>(args);
                }});
  const std::vector<tessera::Tensor> tp{as_tensor(p, {n})}, tg{as_tensor(g, {n})},
      tm{as_tensor(m, {n})}, tv{as_tensor(v, {n})}, no_master{tessera::Tensor()};
  const tessera::cuda::AdamWConfig config{.lr = lr,
                                          .beta1 = beta1,
                                          .beta2 = beta2,
                                          .eps = eps,
                                          .weight_decay = weight_decay,
                                          .step = step};
  ladder.climb_library(
      {"v4 production (multi-tensor launch)", "",
       [&] { tessera::cuda::multi_tensor_adamw(tp, tg, tm, tv, no_master, {true}, config); }});
  return ladder.failures();
}

}  // namespace

int adamw_ladder() {
  // 2^25 + 7 parameters (a 34M-parameter model): odd, so v3's scalar tail runs as well.
  return climb_at(1000003, false) + (check_only() ? 0 : climb_at((int64_t(1) << 25) + 7, true));
}

}  // namespace ladders
