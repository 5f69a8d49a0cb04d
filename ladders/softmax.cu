// Softmax ladder: y = exp(x - max) / sum(exp(x - max)) over each row, bf16 storage, f32 math.
//   v1 one thread per row, three loops (max, sum of exponentials, write): uncoalesced reads,
//      and as few threads as rows.
//   v2 one block per row: coalesced reads, the max and then the sum combined with
//      shared-memory trees; still three passes over the row.
//   v3 one warp per row with the online softmax: a single pass keeps a running max and a sum
//      that is rescaled whenever the max grows, lanes merge their (max, sum) pairs with
//      shuffles; 128-bit loads and stores. Two passes over the row: one to read, one to write.
//   v4 production (kernels/cuda/softmax.cu through the dispatch table): the row held in
//      registers by a group of threads sized to the row, so x is read from memory once.
#include <algorithm>
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/core/dispatch.h"

namespace ladders {
namespace {

__global__ void softmax_v1_thread_per_row(const bf16* x, bf16* y, int rows, int len) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const bf16* xr = x + size_t(row) * len;
  float max = -INFINITY;
  for (int i = 0; i < len; ++i) max = fmaxf(max, f32(xr[i]));
  float sum = 0.f;
  for (int i = 0; i < len; ++i) sum += expf(f32(xr[i]) - max);
  bf16* yr = y + size_t(row) * len;
  for (int i = 0; i < len; ++i) yr[i] = __float2bfloat16_rn(expf(f32(xr[i]) - max) / sum);
}

constexpr int kV2Threads = 256;
__global__ void __launch_bounds__(kV2Threads)
    softmax_v2_block_per_row(const bf16* x, bf16* y, int len) {
  __shared__ float scratch[kV2Threads];
  const bf16* xr = x + size_t(blockIdx.x) * len;
  float max = -INFINITY;
  for (int i = threadIdx.x; i < len; i += blockDim.x) max = fmaxf(max, f32(xr[i]));
  max = tree_reduce(max, scratch, MaxOp{});
  float sum = 0.f;
  for (int i = threadIdx.x; i < len; i += blockDim.x) sum += expf(f32(xr[i]) - max);
  const float inv_sum = 1.f / tree_reduce(sum, scratch, SumOp{});
  bf16* yr = y + size_t(blockIdx.x) * len;
  for (int i = threadIdx.x; i < len; i += blockDim.x)
    yr[i] = __float2bfloat16_rn(expf(f32(xr[i]) - max) * inv_sum);
}

constexpr int kV3Warps = 8;
// Needs len % 8 == 0 (rows on 16-byte boundaries, whole 8-element packs).
__global__ void __launch_bounds__(kV3Warps * 32)
    softmax_v3_warp_online(const bf16* x, bf16* y, int rows, int len) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kV3Warps + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave; the shuffles below stay full-warp
  const bf16* xr = x + size_t(row) * len;
  const int packs = len / 8;
  float v[8];
  MaxSum stats;
  for (int p = lane; p < packs; p += 32) {
    load8(xr + 8 * p, v);
    for (int j = 0; j < 8; ++j) online_add(stats, v[j]);
  }
  stats = warp_merge(stats);
  const float inv_sum = 1.f / stats.sum;
  bf16* yr = y + size_t(row) * len;
  for (int p = lane; p < packs; p += 32) {
    load8(xr + 8 * p, v);
    for (int j = 0; j < 8; ++j) v[j] = __expf(v[j] - stats.max) * inv_sum;
    store8(yr + 8 * p, v);
  }
}

int climb_at(int rows, int len, bool timed) {
  const size_t n = size_t(rows) * len;
  // A spread of 3 gives rows whose largest exponentials dominate, as attention scores do.
  const std::vector<bf16> hx = random_bf16(n, 31, 0.f, 3.f);
  DeviceArray<bf16> x(n), y(n);
  x.upload(hx);
  auto check = [&] {
    ErrorStats e("y");
    for (int64_t r : sample_indices(rows, 256)) {
      const std::vector<double> got = widen(y.download(r * len, len));
      const std::vector<bf16> row(hx.begin() + r * len, hx.begin() + (r + 1) * len);
      const std::vector<double> xr = widen(row);
      double max = -INFINITY, sum = 0;
      for (int i = 0; i < len; ++i) max = std::max(max, xr[i]);
      for (int i = 0; i < len; ++i) sum += std::exp(xr[i] - max);
      for (int i = 0; i < len; ++i) e.add(got[i], std::exp(xr[i] - max) / sum, r * len + i);
    }
    return std::vector<ErrorStats>{e};
  };
  const Workload work{strf("rows=%d len=%d bf16", rows, len), n * 4.0, 0, timed, 1e-2};
  Ladder ladder(
      "softmax", work, [&] { y.poison(); }, check);

  ladder.climb({"v1 one thread per row", "", [&] {
                  softmax_v1_thread_per_row<<<blocks_for(rows, 128), 128>>>(x.get(), y.get(), rows,
                                                                            len);
                }});
  ladder.climb({"v2 block per row, shared-memory trees", "",
                [&] { softmax_v2_block_per_row<<<rows, kV2Threads>>>(x.get(), y.get(), len); }});
  ladder.climb(
      {"v3 warp per row, online softmax, 128-bit", len % 8 == 0 ? "" : "len % 8 == 0", [&] {
         softmax_v3_warp_online<<<blocks_for(rows, kV3Warps), kV3Warps * 32>>>(x.get(), y.get(),
                                                                               rows, len);
       }});
  const tessera::Tensor tx = as_tensor(x, {rows, len}), ty = as_tensor(y, {rows, len});
  ladder.climb_library(
      {"v4 production (row in registers)", "",
       [&] { tessera::kernel_table(tessera::DeviceType::CUDA).softmax(tx, 1, false, ty); }});
  return ladder.failures();
}

}  // namespace

int softmax_ladder() {
  // 65536 rows of 1024: the attention probabilities of 64 (batch x head) pairs at T = 1024.
  return climb_at(37, 771, false) + climb_at(45, 1000, false) +
         (check_only() ? 0 : climb_at(65536, 1024, true));
}

}  // namespace ladders
