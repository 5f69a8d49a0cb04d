// Cross-entropy ladder, forward and backward in one kernel: for each row of logits [N, V]
// with target t (rows whose target is -100 are ignored: loss 0, gradient 0)
//   loss = logsumexp(row) - row[t],   dlogits = scale * (softmax(row) - onehot(t))
// with scale = 1 / (number of counted rows), the gradient of the mean loss. bf16 logits and
// dlogits, f32 losses and math. The probabilities are never stored: at V = 50k that would be
// a [N, V] f32 tensor written and read again.
//   v1 one thread per row: four loops over a 100 KB row (max, sum, loss, gradient), uncoalesced,
//      and 8192 rows give fewer threads than the GPU has lanes to fill a wave.
//   v2 one block per row: coalesced, shared-memory trees; three reads and one write of the row.
//   v3 one block per row with the online (max, sum): one read for the statistics, then one
//      read + write for the gradient, 128-bit loads and stores, warp shuffles and one
//      shared-memory merge of the warps' partial results.
//   v4 production (tessera::cuda::fused_classifier, kernels/cuda/classifier.cu): the same two
//      passes, the second walking the row backwards so it first re-reads what is still in L2;
//      it overwrites the logits with dlogits in place (its rung starts from a copy).
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace ladders {
namespace {

constexpr int kIgnoreIndex = -100;

struct CrossEntropyArgs {
  const bf16* logits;
  const int32_t* targets;
  bf16* dlogits;
  float* losses;
  int rows, V;
  float scale;
};

__global__ void cross_entropy_v1_thread_per_row(CrossEntropyArgs a) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  const bf16* x = a.logits + size_t(row) * a.V;
  bf16* dx = a.dlogits + size_t(row) * a.V;
  const int target = a.targets[row];
  if (target == kIgnoreIndex) {
    for (int i = 0; i < a.V; ++i) dx[i] = __float2bfloat16_rn(0.f);
    a.losses[row] = 0.f;
    return;
  }
  float max = -INFINITY;
  for (int i = 0; i < a.V; ++i) max = fmaxf(max, f32(x[i]));
  float sum = 0.f;
  for (int i = 0; i < a.V; ++i) sum += expf(f32(x[i]) - max);
  const float lse = max + logf(sum);
  a.losses[row] = lse - f32(x[target]);
  for (int i = 0; i < a.V; ++i)
    dx[i] = __float2bfloat16_rn(a.scale * (expf(f32(x[i]) - lse) - (i == target ? 1.f : 0.f)));
}

constexpr int kV2Threads = 512;
__global__ void __launch_bounds__(kV2Threads) cross_entropy_v2_block_per_row(CrossEntropyArgs a) {
  __shared__ float scratch[kV2Threads];
  const bf16* x = a.logits + size_t(blockIdx.x) * a.V;
  bf16* dx = a.dlogits + size_t(blockIdx.x) * a.V;
  const int target = a.targets[blockIdx.x];  // the same for the whole block: uniform branch
  if (target == kIgnoreIndex) {
    for (int i = threadIdx.x; i < a.V; i += blockDim.x) dx[i] = __float2bfloat16_rn(0.f);
    if (threadIdx.x == 0) a.losses[blockIdx.x] = 0.f;
    return;
  }
  float max = -INFINITY;
  for (int i = threadIdx.x; i < a.V; i += blockDim.x) max = fmaxf(max, f32(x[i]));
  max = tree_reduce(max, scratch, MaxOp{});
  float sum = 0.f;
  for (int i = threadIdx.x; i < a.V; i += blockDim.x) sum += expf(f32(x[i]) - max);
  const float lse = max + logf(tree_reduce(sum, scratch, SumOp{}));
  if (threadIdx.x == 0) a.losses[blockIdx.x] = lse - f32(x[target]);
  for (int i = threadIdx.x; i < a.V; i += blockDim.x)
    dx[i] = __float2bfloat16_rn(a.scale * (expf(f32(x[i]) - lse) - (i == target ? 1.f : 0.f)));
}

constexpr int kV3Threads = 512;
// Needs V % 8 == 0: rows on 16-byte boundaries, whole 8-element packs (why GPT-2's vocabulary
// of 50257 is padded to 50304 = 393 * 128).
__global__ void __launch_bounds__(kV3Threads) cross_entropy_v3_online(CrossEntropyArgs a) {
  __shared__ MaxSum warp_stats[kV3Threads / 32];
  const bf16* x = a.logits + size_t(blockIdx.x) * a.V;
  bf16* dx = a.dlogits + size_t(blockIdx.x) * a.V;
  const int target = a.targets[blockIdx.x];
  const int packs = a.V / 8;
  float v[8];
  if (target == kIgnoreIndex) {
    for (int j = 0; j < 8; ++j) v[j] = 0.f;
    for (int p = threadIdx.x; p < packs; p += blockDim.x) store8(dx + 8 * p, v);
    if (threadIdx.x == 0) a.losses[blockIdx.x] = 0.f;
    return;
  }
  MaxSum stats;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    load8(x + 8 * p, v);
    for (int j = 0; j < 8; ++j) online_add(stats, v[j]);
  }
  stats = warp_merge(stats);
  if (threadIdx.x % 32 == 0) warp_stats[threadIdx.x / 32] = stats;
  __syncthreads();
  MaxSum total;  // every thread merges the 16 warp results itself (broadcast reads, no 2nd barrier)
  for (int w = 0; w < kV3Threads / 32; ++w) total = merge(total, warp_stats[w]);
  const float lse = total.max + logf(total.sum);
  if (threadIdx.x == 0) a.losses[blockIdx.x] = lse - f32(x[target]);
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    load8(x + 8 * p, v);
    for (int j = 0; j < 8; ++j)
      v[j] = a.scale * (__expf(v[j] - lse) - (8 * p + j == target ? 1.f : 0.f));
    store8(dx + 8 * p, v);
  }
}

int climb_at(int rows, int V, bool timed) {
  const size_t n = size_t(rows) * V;
  const std::vector<bf16> hlogits = random_bf16(n, 41, 0.f, 2.f);
  std::vector<int32_t> htargets(rows);
  int counted = 0;
  for (int r = 0; r < rows; ++r) {
    htargets[r] = r % 7 == 3 ? kIgnoreIndex : int32_t((uint64_t(r) * 2654435761u) % V);
    counted += htargets[r] != kIgnoreIndex;
  }
  const float scale = 1.f / float(counted);
  DeviceArray<bf16> logits(n), dlogits(n);
  DeviceArray<int32_t> targets(rows);
  DeviceArray<float> losses(rows);
  logits.upload(hlogits), targets.upload(htargets);
  const CrossEntropyArgs args{logits.get(), targets.get(), dlogits.get(), losses.get(), rows, V,
                              scale};

  auto poison = [&] { dlogits.poison(), losses.poison(); };
  auto check = [&] {
    const std::vector<double> got_losses = widen(losses.download());
    ErrorStats e_loss("loss"), e_grad("dlogits");
    for (int64_t r : sample_indices(rows, 48)) {
      const std::vector<double> x = widen(logits.download(r * V, V)),
                                got = widen(dlogits.download(r * V, V));
      const int t = htargets[r];
      double max = -INFINITY, sum = 0;
      for (int i = 0; i < V; ++i) max = std::max(max, x[i]);
      for (int i = 0; i < V; ++i) sum += std::exp(x[i] - max);
      const double lse = max + std::log(sum);
      e_loss.add(got_losses[r], t == kIgnoreIndex ? 0.0 : lse - x[t], r);
      for (int i = 0; i < V; ++i) {
        const double ref =
            t == kIgnoreIndex ? 0.0 : double(scale) * (std::exp(x[i] - lse) - (i == t));
        e_grad.add(got[i], ref, r * V + i);
      }
    }
    return std::vector<ErrorStats>{e_loss, e_grad};
  };
  // Minimum traffic: the logits read once and the gradient written once.
  const Workload work{strf("rows=%d V=%d bf16", rows, V), n * 4.0, 0, timed, 1e-2};
  Ladder ladder("cross_entropy", work, poison, check);

  ladder.climb({"v1 one thread per row", "",
                [&] { cross_entropy_v1_thread_per_row<<<blocks_for(rows, 128), 128>>>(args); }});
  ladder.climb({"v2 block per row, shared-memory trees", "",
                [&] { cross_entropy_v2_block_per_row<<<rows, kV2Threads>>>(args); }});
  ladder.climb({"v3 block per row, online max/sum, 128-bit", V % 8 == 0 ? "" : "V % 8 == 0",
                [&] { cross_entropy_v3_online<<<rows, kV3Threads>>>(args); }});
  // In place on dlogits: the checked run starts from a copy of the logits; the timed runs then
  // see earlier gradients as logits (finite values, the same work).
  const tessera::Tensor tgrad = as_tensor(dlogits, {rows, V}),
                        ttargets = as_tensor(targets, {rows}), tlosses = as_tensor(losses, {rows});
  ladder.climb_library(
      {"v4 production (fused classifier, in place)", "",
       [&] { tessera::cuda::fused_classifier(tgrad, ttargets, kIgnoreIndex, scale, tlosses); },
       [&] { dlogits.copy_from(logits); }});
  return ladder.failures();
}

}  // namespace

int cross_entropy_ladder() {
  // The timed shape: 8192 rows (8 x 1024 tokens) of GPT-2's padded vocabulary.
  return climb_at(13, 50257, false) + climb_at(37, 1000, false) +
         (check_only() ? 0 : climb_at(8192, 50304, true));
}

}  // namespace ladders
