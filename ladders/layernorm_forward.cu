// LayerNorm forward ladder: out = (x - mean) * rstd * w + b over each row of C elements, with
// rstd = 1 / sqrt(var + eps) and the biased variance; mean and rstd are also written (the
// backward needs them). bf16 storage, f32 math.
//   v1 one thread per row: three loops over the row; neighbouring threads read addresses C
//      elements apart, so every load of a warp touches 32 cache lines (uncoalesced), and only
//      `rows` threads exist.
//   v2 one block per row: the block's threads read consecutive elements (coalesced) and
//      combine their partial sums with a shared-memory tree (a barrier per level).
//   v3 one warp per row: shuffles combine the sums inside the warp (no shared memory, no
//      barrier), and each lane moves 8 bf16 per 128-bit load; the row is re-read for the
//      variance and the output pass, which L1 serves.
//   v4 production (kernels/cuda/layer_norm.cu through the dispatch table): one warp per row
//      with the row held in registers, so x is read from memory exactly once.
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/core/dispatch.h"

namespace ladders {
namespace {

struct LayerNormArgs {
  const bf16* x;
  const bf16* w;
  const bf16* b;
  bf16* out;
  float* mean;
  float* rstd;
  int rows, C;
  float eps;
};

__global__ void layernorm_v1_thread_per_row(LayerNormArgs a) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  const bf16* x = a.x + size_t(row) * a.C;
  float sum = 0.f;
  for (int i = 0; i < a.C; ++i) sum += f32(x[i]);
  const float mean = sum / a.C;
  float squares = 0.f;
  for (int i = 0; i < a.C; ++i) {
    const float d = f32(x[i]) - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(squares / a.C + a.eps);
  bf16* out = a.out + size_t(row) * a.C;
  for (int i = 0; i < a.C; ++i)
    out[i] = __float2bfloat16_rn((f32(x[i]) - mean) * rstd * f32(a.w[i]) + f32(a.b[i]));
  a.mean[row] = mean;
  a.rstd[row] = rstd;
}

constexpr int kV2Threads = 256;
__global__ void __launch_bounds__(kV2Threads) layernorm_v2_block_per_row(LayerNormArgs a) {
  __shared__ float scratch[kV2Threads];
  const int row = blockIdx.x;
  const bf16* x = a.x + size_t(row) * a.C;
  float sum = 0.f;
  for (int i = threadIdx.x; i < a.C; i += blockDim.x) sum += f32(x[i]);
  const float mean = tree_reduce(sum, scratch, SumOp{}) / a.C;
  // The variance from the deviations (two passes), not E[x^2] - mean^2, which cancels badly
  // when |mean| is large next to the spread.
  float squares = 0.f;
  for (int i = threadIdx.x; i < a.C; i += blockDim.x) {
    const float d = f32(x[i]) - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(tree_reduce(squares, scratch, SumOp{}) / a.C + a.eps);
  bf16* out = a.out + size_t(row) * a.C;
  for (int i = threadIdx.x; i < a.C; i += blockDim.x)
    out[i] = __float2bfloat16_rn((f32(x[i]) - mean) * rstd * f32(a.w[i]) + f32(a.b[i]));
  if (threadIdx.x == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

constexpr int kV3Warps = 8;  // rows per block
// Needs C % 8 == 0: every row then starts on a 16-byte boundary and splits into 8-element packs.
__global__ void __launch_bounds__(kV3Warps * 32) layernorm_v3_warp_per_row(LayerNormArgs a) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kV3Warps + threadIdx.x / 32;
  if (row >= a.rows) return;  // the whole warp leaves together, so the shuffles stay full-warp
  const bf16* x = a.x + size_t(row) * a.C;
  const int packs = a.C / 8;
  float v[8];
  float sum = 0.f;
  for (int p = lane; p < packs; p += 32) {
    load8(x + 8 * p, v);
    for (int j = 0; j < 8; ++j) sum += v[j];
  }
  const float mean = warp_reduce(sum, SumOp{}) / a.C;
  float squares = 0.f;
  for (int p = lane; p < packs; p += 32) {
    load8(x + 8 * p, v);
    for (int j = 0; j < 8; ++j) squares += (v[j] - mean) * (v[j] - mean);
  }
  const float rstd = rsqrtf(warp_reduce(squares, SumOp{}) / a.C + a.eps);
  bf16* out = a.out + size_t(row) * a.C;
  for (int p = lane; p < packs; p += 32) {
    float w[8], b[8];
    load8(x + 8 * p, v);
    load8(a.w + 8 * p, w);
    load8(a.b + 8 * p, b);
    for (int j = 0; j < 8; ++j) v[j] = (v[j] - mean) * rstd * w[j] + b[j];
    store8(out + 8 * p, v);
  }
  if (lane == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
}

int climb_at(int rows, int C, bool timed) {
  const size_t n = size_t(rows) * C;
  const float eps = 1e-5f;
  // A mean of 3 next to a spread of 1 makes the variance's cancellation visible.
  const std::vector<bf16> hx = random_bf16(n, 11, 3.f, 1.f), hw = random_bf16(C, 12, 1.f, 0.2f),
                          hb = random_bf16(C, 13, 0.f, 0.2f);
  DeviceArray<bf16> x(n), w(C), b(C), out(n);
  DeviceArray<float> mean(rows), rstd(rows);
  x.upload(hx), w.upload(hw), b.upload(hb);
  const LayerNormArgs args{x.get(),    w.get(), b.get(), out.get(), mean.get(),
                           rstd.get(), rows,    C,       eps};

  auto poison = [&] { out.poison(), mean.poison(), rstd.poison(); };
  const std::vector<double> X = widen(hx), W = widen(hw), B = widen(hb);
  auto check = [&] {
    const std::vector<double> got = widen(out.download()), got_mean = widen(mean.download()),
                              got_rstd = widen(rstd.download());
    ErrorStats e_out("out"), e_mean("mean"), e_rstd("rstd");
    for (int64_t r : sample_indices(rows, 256)) {
      const double* xr = &X[r * C];
      double m = 0, var = 0;
      for (int i = 0; i < C; ++i) m += xr[i];
      m /= C;
      for (int i = 0; i < C; ++i) var += (xr[i] - m) * (xr[i] - m);
      const double rs = 1.0 / std::sqrt(var / C + eps);
      for (int i = 0; i < C; ++i)
        e_out.add(got[r * C + i], (xr[i] - m) * rs * W[i] + B[i], r * C + i);
      e_mean.add(got_mean[r], m, r);
      e_rstd.add(got_rstd[r], rs, r);
    }
    return std::vector<ErrorStats>{e_out, e_mean, e_rstd};
  };
  // Minimum traffic: x read, out written, mean and rstd written (w and b are negligible).
  const Workload work{strf("rows=%d C=%d bf16", rows, C), n * 4.0 + rows * 8.0, 0, timed, 1e-2};
  Ladder ladder("layernorm_forward", work, poison, check);

  ladder.climb({"v1 one thread per row", "",
                [&] { layernorm_v1_thread_per_row<<<blocks_for(rows, 128), 128>>>(args); }});
  ladder.climb({"v2 block per row, shared-memory tree", "",
                [&] { layernorm_v2_block_per_row<<<rows, kV2Threads>>>(args); }});
  ladder.climb({"v3 warp per row, shuffles, 128-bit loads", C % 8 == 0 ? "" : "C % 8 == 0", [&] {
                  layernorm_v3_warp_per_row<<<blocks_for(rows, kV3Warps), kV3Warps * 32>>>(args);
                }});
  const tessera::Tensor tx = as_tensor(x, {rows, C}), tw = as_tensor(w, {C}),
                        tb = as_tensor(b, {C}), tout = as_tensor(out, {rows, C}),
                        tmean = as_tensor(mean, {rows}), trstd = as_tensor(rstd, {rows});
  ladder.climb_library({"v4 production (row in registers)", "", [&] {
                          tessera::kernel_table(tessera::DeviceType::CUDA)
                              .layer_norm(tx, tw, tb, eps, tout, tmean, trstd);
                        }});
  return ladder.failures();
}

}  // namespace

int layernorm_forward_ladder() {
  return climb_at(37, 771, false) + climb_at(45, 1000, false) +
         (check_only() ? 0 : climb_at(16384, 1024, true));
}

}  // namespace ladders
