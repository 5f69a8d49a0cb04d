// LayerNorm backward ladder. With xhat = (x - mean) * rstd and g = dy * w, per row
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
// and over all rows dweight = sum(dy * xhat), dbias = sum(dy). bf16 storage, f32 math; mean
// and rstd come from the forward (f32). dx is a row reduction like the forward; dweight and
// dbias are column reductions over every row, which is what the rungs differ in.
//   v1 one thread per row for dx, then one thread per column for dweight/dbias: the column
//      kernel reads coalesced but has only C threads for the whole of x and dy.
//   v2 one block per row (shared-memory trees for the two row sums), and every element adds
//      its share of dweight/dbias with a global atomicAdd: all rows contend for the same C
//      addresses.
//   v3 one warp per row (shuffles, 128-bit loads) in a persistent grid of a few blocks per SM;
//      each block sums its rows' dweight/dbias in shared memory first, then adds one value per
//      column to global memory: atomics cut from rows * C to blocks * C.
//   v4 production (kernels/cuda/layer_norm.cu): warp per row with the row in registers, the
//      column partials kept in registers and summed in a fixed order (no atomics, so the
//      result repeats bitwise).
// v2 and v3 accumulate in f32 buffers (zeroed first, as part of the timed work) and a last
// small kernel rounds them to bf16; the production entry accumulates (+=) into dweight and
// dbias, which its rung zeroes first.
#include <algorithm>
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/core/dispatch.h"

namespace ladders {
namespace {

struct LayerNormGrads {
  const bf16* dy;
  const bf16* x;
  const bf16* w;
  const float* mean;
  const float* rstd;
  bf16* dx;
  float* dw_sum;  // f32 accumulators of v2/v3
  float* db_sum;
  bf16* dw;
  bf16* db;
  int rows, C;
};

__global__ void layernorm_backward_v1_dx(LayerNormGrads a) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  const size_t base = size_t(row) * a.C;
  const float mean = a.mean[row], rstd = a.rstd[row];
  float sum_g = 0.f, sum_g_xhat = 0.f;
  for (int i = 0; i < a.C; ++i) {
    const float g = f32(a.dy[base + i]) * f32(a.w[i]);
    sum_g += g;
    sum_g_xhat += g * (f32(a.x[base + i]) - mean) * rstd;
  }
  const float mean_g = sum_g / a.C, mean_g_xhat = sum_g_xhat / a.C;
  for (int i = 0; i < a.C; ++i) {
    const float g = f32(a.dy[base + i]) * f32(a.w[i]);
    const float xhat = (f32(a.x[base + i]) - mean) * rstd;
    a.dx[base + i] = __float2bfloat16_rn(rstd * (g - mean_g - xhat * mean_g_xhat));
  }
}

__global__ void layernorm_backward_v1_params(LayerNormGrads a) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= a.C) return;
  float dw = 0.f, db = 0.f;
  for (int r = 0; r < a.rows; ++r) {
    const size_t i = size_t(r) * a.C + col;
    const float dy = f32(a.dy[i]);
    dw += dy * (f32(a.x[i]) - a.mean[r]) * a.rstd[r];
    db += dy;
  }
  a.dw[col] = __float2bfloat16_rn(dw);
  a.db[col] = __float2bfloat16_rn(db);
}

constexpr int kV2Threads = 256;
__global__ void __launch_bounds__(kV2Threads)
    layernorm_backward_v2_block_per_row(LayerNormGrads a) {
  __shared__ float scratch[kV2Threads];
  const int row = blockIdx.x;
  const size_t base = size_t(row) * a.C;
  const float mean = a.mean[row], rstd = a.rstd[row];
  float sum_g = 0.f, sum_g_xhat = 0.f;
  for (int i = threadIdx.x; i < a.C; i += blockDim.x) {
    const float g = f32(a.dy[base + i]) * f32(a.w[i]);
    sum_g += g;
    sum_g_xhat += g * (f32(a.x[base + i]) - mean) * rstd;
  }
  const float mean_g = tree_reduce(sum_g, scratch, SumOp{}) / a.C;
  const float mean_g_xhat = tree_reduce(sum_g_xhat, scratch, SumOp{}) / a.C;
  for (int i = threadIdx.x; i < a.C; i += blockDim.x) {
    const float dy = f32(a.dy[base + i]);
    const float xhat = (f32(a.x[base + i]) - mean) * rstd;
    a.dx[base + i] = __float2bfloat16_rn(rstd * (dy * f32(a.w[i]) - mean_g - xhat * mean_g_xhat));
    atomicAdd(&a.dw_sum[i], dy * xhat);
    atomicAdd(&a.db_sum[i], dy);
  }
}

constexpr int kV3Warps = 8;
// Needs C % 8 == 0 and 2 * C floats of shared memory (dynamic).
__global__ void __launch_bounds__(kV3Warps * 32)
    layernorm_backward_v3_warp_per_row(LayerNormGrads a) {
  extern __shared__ float block_sums[];  // [dweight | dbias], C each
  float* dw_block = block_sums;
  float* db_block = block_sums + a.C;
  for (int i = threadIdx.x; i < 2 * a.C; i += blockDim.x) block_sums[i] = 0.f;
  __syncthreads();
  const int lane = threadIdx.x % 32, packs = a.C / 8;
  // No early return: every warp must reach the barrier after the loop.
  for (int row = blockIdx.x * kV3Warps + threadIdx.x / 32; row < a.rows;
       row += gridDim.x * kV3Warps) {
    const size_t base = size_t(row) * a.C;
    const float mean = a.mean[row], rstd = a.rstd[row];
    float dy[8], x[8], w[8];
    float sum_g = 0.f, sum_g_xhat = 0.f;
    for (int p = lane; p < packs; p += 32) {
      load8(a.dy + base + 8 * p, dy), load8(a.x + base + 8 * p, x), load8(a.w + 8 * p, w);
      for (int j = 0; j < 8; ++j) {
        sum_g += dy[j] * w[j];
        sum_g_xhat += dy[j] * w[j] * (x[j] - mean) * rstd;
      }
    }
    const float mean_g = warp_reduce(sum_g, SumOp{}) / a.C;
    const float mean_g_xhat = warp_reduce(sum_g_xhat, SumOp{}) / a.C;
    for (int p = lane; p < packs; p += 32) {  // the second read of the row comes from L1
      load8(a.dy + base + 8 * p, dy), load8(a.x + base + 8 * p, x), load8(a.w + 8 * p, w);
      float dx[8];
      for (int j = 0; j < 8; ++j) {
        const float xhat = (x[j] - mean) * rstd;
        dx[j] = rstd * (dy[j] * w[j] - mean_g - xhat * mean_g_xhat);
        atomicAdd(&dw_block[8 * p + j], dy[j] * xhat);  // shared-memory atomics: cheap
        atomicAdd(&db_block[8 * p + j], dy[j]);
      }
      store8(a.dx + base + 8 * p, dx);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < a.C; i += blockDim.x) {
    atomicAdd(&a.dw_sum[i], dw_block[i]);
    atomicAdd(&a.db_sum[i], db_block[i]);
  }
}

__global__ void round_param_grads(LayerNormGrads a) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.C) return;
  a.dw[i] = __float2bfloat16_rn(a.dw_sum[i]);
  a.db[i] = __float2bfloat16_rn(a.db_sum[i]);
}

// The inputs on the host: bf16 dy, x, w widened to double, and the forward's statistics
// rounded to f32 (exactly what the kernels read).
struct HostInputs {
  int rows, C;
  std::vector<bf16> dy, x, w;
  std::vector<double> DY, X, W;
  std::vector<float> mean, rstd;

  HostInputs(int rows_, int C_)
      : rows(rows_),
        C(C_),
        dy(random_bf16(size_t(rows) * C, 21)),
        x(random_bf16(size_t(rows) * C, 22, 1.f, 2.f)),
        w(random_bf16(C, 23, 1.f, 0.2f)),
        DY(widen(dy)),
        X(widen(x)),
        W(widen(w)),
        mean(rows),
        rstd(rows) {
    for (int r = 0; r < rows; ++r) {
      const double* xr = &X[size_t(r) * C];
      double m = 0, var = 0;
      for (int i = 0; i < C; ++i) m += xr[i];
      m /= C;
      for (int i = 0; i < C; ++i) var += (xr[i] - m) * (xr[i] - m);
      mean[r] = float(m), rstd[r] = float(1.0 / std::sqrt(var / C + 1e-5));
    }
  }
  double xhat(int64_t r, int i) const { return (X[r * C + i] - mean[r]) * rstd[r]; }
};

// dweight and dbias over every row, dx over sampled rows, in float64.
std::vector<ErrorStats> compare_with_reference(const HostInputs& h, const std::vector<double>& dx,
                                               const std::vector<double>& dw,
                                               const std::vector<double>& db) {
  const int C = h.C;
  ErrorStats e_dx("dx"), e_dw("dweight"), e_db("dbias");
  std::vector<double> ref_dw(C, 0.0), ref_db(C, 0.0);
  for (int64_t r = 0; r < h.rows; ++r)
    for (int i = 0; i < C; ++i)
      ref_dw[i] += h.DY[r * C + i] * h.xhat(r, i), ref_db[i] += h.DY[r * C + i];
  for (int i = 0; i < C; ++i) e_dw.add(dw[i], ref_dw[i], i), e_db.add(db[i], ref_db[i], i);
  for (int64_t r : sample_indices(h.rows, 256)) {
    double sum_g = 0, sum_g_xhat = 0;
    for (int i = 0; i < C; ++i) {
      sum_g += h.DY[r * C + i] * h.W[i];
      sum_g_xhat += h.DY[r * C + i] * h.W[i] * h.xhat(r, i);
    }
    for (int i = 0; i < C; ++i) {
      const double g = h.DY[r * C + i] * h.W[i];
      e_dx.add(dx[r * C + i], h.rstd[r] * (g - sum_g / C - h.xhat(r, i) * sum_g_xhat / C),
               r * C + i);
    }
  }
  return {e_dx, e_dw, e_db};
}

int climb_at(int rows, int C, bool timed) {
  const size_t n = size_t(rows) * C;
  const HostInputs h(rows, C);
  DeviceArray<bf16> dy(n), x(n), w(C), dx(n), dw(C), db(C);
  DeviceArray<float> mean(rows), rstd(rows), dw_sum(C), db_sum(C);
  dy.upload(h.dy), x.upload(h.x), w.upload(h.w), mean.upload(h.mean), rstd.upload(h.rstd);
  const LayerNormGrads args{dy.get(),     x.get(),      w.get(),  mean.get(), rstd.get(), dx.get(),
                            dw_sum.get(), db_sum.get(), dw.get(), db.get(),   rows,       C};

  auto poison = [&] { dx.poison(), dw.poison(), db.poison(); };
  auto check = [&] {
    return compare_with_reference(h, widen(dx.download()), widen(dw.download()),
                                  widen(db.download()));
  };
  // Minimum traffic: dy and x read, dx written, mean and rstd read.
  const Workload work{strf("rows=%d C=%d bf16", rows, C), n * 6.0 + rows * 8.0, 0, timed, 1e-2};
  Ladder ladder("layernorm_backward", work, poison, check);

  ladder.climb({"v1 thread per row, then thread per column", "", [&] {
                  layernorm_backward_v1_dx<<<blocks_for(rows, 128), 128>>>(args);
                  layernorm_backward_v1_params<<<blocks_for(C, 128), 128>>>(args);
                }});
  ladder.climb({"v2 block per row, global atomics", "", [&] {
                  dw_sum.zero(), db_sum.zero();
                  layernorm_backward_v2_block_per_row<<<rows, kV2Threads>>>(args);
                  round_param_grads<<<blocks_for(C, 256), 256>>>(args);
                }});
  const size_t v3_smem = 2 * size_t(C) * sizeof(float);
  const int v3_blocks = std::min<int>(blocks_for(rows, kV3Warps), 2 * sm_count());
  ladder.climb({"v3 warp per row, block sums in shared memory",
                C % 8 != 0 ? "C % 8 == 0" : (v3_smem > 48 * 1024 ? "C <= 6144" : ""), [&] {
                  dw_sum.zero(), db_sum.zero();
                  layernorm_backward_v3_warp_per_row<<<v3_blocks, kV3Warps * 32, v3_smem>>>(args);
                  round_param_grads<<<blocks_for(C, 256), 256>>>(args);
                }});
  const tessera::Tensor tdy = as_tensor(dy, {rows, C}), tx = as_tensor(x, {rows, C}),
                        tw = as_tensor(w, {C}), tmean = as_tensor(mean, {rows}),
                        trstd = as_tensor(rstd, {rows}), tdx = as_tensor(dx, {rows, C}),
                        tdw = as_tensor(dw, {C}), tdb = as_tensor(db, {C});
  ladder.climb_library({"v4 production (register partials, no atomics)", "", [&] {
                          dw.zero(), db.zero();  // the entry accumulates into them
                          tessera::kernel_table(tessera::DeviceType::CUDA)
                              .layer_norm_backward(tdy, tx, tw, tmean, trstd, tdx, tdw, tdb);
                        }});
  return ladder.failures();
}

}  // namespace

int layernorm_backward_ladder() {
  return climb_at(37, 771, false) + climb_at(45, 1000, false) +
         (check_only() ? 0 : climb_at(16384, 1024, true));
}

}  // namespace ladders
