// Causal attention forward ladder, head size 64: for each (batch, head) and query i
//   out_i = sum over keys j <= i of softmax_j(scale * q_i . k_j) v_j,   lse_i = log sum_j exp(...)
// q, k, v, out: [B, H, T, 64] bf16; lse: [B, H, T] f32 (what the backward needs); f32 math.
//   v1 the textbook three steps: the [T, T] scores of every head to memory (f32), a softmax
//      kernel over their rows, then P V: memory traffic grows with T^2.
//   v2 one thread per query streams the keys with the online softmax (running max and sum,
//      the output rescaled when the max grows): no [T, T] matrix, O(T) memory, but every
//      thread reads every key and value it needs from global memory.
//   v3 flash-attention tiling on the CUDA cores: a block of 64 queries loads tiles of 64 keys
//      and values into shared memory once for all 64 threads, and rescales its running output
//      once per 16 keys instead of once per key.
//   v4 tensor cores (tessera::cuda::flash_attention_forward_mma_sync, kernels/cuda/attention.cu):
//      the same tiling with both products on mma.sync and double-buffered tiles.
//   v5 production (tessera::cuda::flash_attention_forward; on sm_90 kernels/cuda/attention_sm90.cu):
//      warpgroup MMA fed by TMA from a producer warpgroup, P kept in registers as the A operand.
//   cuDNN's fused attention where available, for comparison.
#include <algorithm>
#include <cmath>

#include "ladder_harness.cuh"
#include "production.cuh"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"

namespace ladders {
namespace {

constexpr int kHead = 64;  // head size D

struct AttentionArgs {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  bf16* out;
  float* lse;
  float* scores;  // v1's [BH, T, T]
  int BH, T;
  float scale;
};

// ---- v1: scores, softmax, P V ----
__global__ void attention_v1_scores(AttentionArgs a) {
  const size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t TT = size_t(a.T) * a.T;
  if (e >= a.BH * TT) return;
  const size_t bh = e / TT;
  const int i = int(e % TT / a.T), j = int(e % a.T);
  if (j > i) return;  // causal: never read (the softmax stops at j = i)
  const bf16* q = a.q + (bh * a.T + i) * kHead;
  const bf16* k = a.k + (bh * a.T + j) * kHead;
  float dot = 0.f;
  for (int d = 0; d < kHead; ++d) dot += f32(q[d]) * f32(k[d]);
  a.scores[e] = dot * a.scale;
}

__global__ void attention_v1_softmax(AttentionArgs a) {
  const size_t row = blockIdx.x * size_t(blockDim.x) + threadIdx.x;  // (bh, i)
  if (row >= size_t(a.BH) * a.T) return;
  const int i = int(row % a.T);
  float* s = a.scores + row * a.T;
  float max = -INFINITY;
  for (int j = 0; j <= i; ++j) max = fmaxf(max, s[j]);
  float sum = 0.f;
  for (int j = 0; j <= i; ++j) sum += expf(s[j] - max);
  for (int j = 0; j <= i; ++j) s[j] = expf(s[j] - max) / sum;
  a.lse[row] = max + logf(sum);
}

__global__ void attention_v1_values(AttentionArgs a) {
  const size_t e = blockIdx.x * size_t(blockDim.x) + threadIdx.x;  // (bh, i, d): a warp shares i
  if (e >= size_t(a.BH) * a.T * kHead) return;
  const size_t row = e / kHead, bh = row / a.T;
  const int i = int(row % a.T), d = int(e % kHead);
  const float* p = a.scores + row * a.T;
  float acc = 0.f;
  for (int j = 0; j <= i; ++j) acc += p[j] * f32(a.v[(bh * a.T + j) * kHead + d]);
  a.out[e] = __float2bfloat16_rn(acc);
}

// ---- v2: one thread per query, online softmax ----
__global__ void attention_v2_thread_per_query(AttentionArgs a) {
  const size_t row = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (row >= size_t(a.BH) * a.T) return;
  const size_t bh = row / a.T;
  const int i = int(row % a.T);
  float q[kHead], o[kHead];
#pragma unroll
  for (int d = 0; d < kHead; ++d) q[d] = f32(a.q[row * kHead + d]) * a.scale, o[d] = 0.f;
  float max = -INFINITY, sum = 0.f;
  for (int j = 0; j <= i; ++j) {
    const bf16* k = a.k + (bh * a.T + j) * kHead;
    const bf16* v = a.v + (bh * a.T + j) * kHead;
    float s = 0.f;
#pragma unroll
    for (int d = 0; d < kHead; ++d) s += q[d] * f32(k[d]);
    const float new_max = fmaxf(max, s);
    const float rescale = __expf(max - new_max), p = __expf(s - new_max);  // exp(-inf) = 0 first
    sum = sum * rescale + p;
#pragma unroll
    for (int d = 0; d < kHead; ++d) o[d] = o[d] * rescale + p * f32(v[d]);
    max = new_max;
  }
#pragma unroll
  for (int d = 0; d < kHead; ++d) a.out[row * kHead + d] = __float2bfloat16_rn(o[d] / sum);
  a.lse[row] = max + logf(sum);
}

// ---- v3: 64 queries per block, key/value tiles in shared memory ----
constexpr int kV3Queries = 64, kV3Keys = 64, kV3Group = 16;
__global__ void __launch_bounds__(kV3Queries) attention_v3_tiled(AttentionArgs a) {
  __shared__ float k_tile[kV3Keys][kHead], v_tile[kV3Keys][kHead];  // 32 KB
  const int bh = blockIdx.y, i = blockIdx.x * kV3Queries + threadIdx.x;
  const bool active = i < a.T;  // threads past T still load tiles and meet the barriers
  const size_t row = size_t(bh) * a.T + i;
  float q[kHead], o[kHead];
#pragma unroll
  for (int d = 0; d < kHead; ++d)
    q[d] = active ? f32(a.q[row * kHead + d]) * a.scale : 0.f, o[d] = 0.f;
  float max = -INFINITY, sum = 0.f;
  // Causal: no key after the block's last query is needed.
  const int key_end = min(a.T, int(blockIdx.x + 1) * kV3Queries);
  for (int k0 = 0; k0 < key_end; k0 += kV3Keys) {
    __syncthreads();  // everyone is done with the previous tiles
    for (int e = threadIdx.x; e < kV3Keys * kHead; e += blockDim.x) {  // coalesced rows
      const int j = k0 + e / kHead;
      const size_t at = (size_t(bh) * a.T + j) * kHead + e % kHead;
      k_tile[e / kHead][e % kHead] = j < a.T ? f32(a.k[at]) : 0.f;
      v_tile[e / kHead][e % kHead] = j < a.T ? f32(a.v[at]) : 0.f;
    }
    __syncthreads();
    for (int g0 = 0; g0 < kV3Keys; g0 += kV3Group) {
      float s[kV3Group];
      float group_max = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < kV3Group; ++jj) {
        const int j = k0 + g0 + jj;
        float dot = 0.f;
#pragma unroll
        for (int d = 0; d < kHead; ++d)
          dot += q[d] * k_tile[g0 + jj][d];  // same address: broadcast
        s[jj] = j <= i && j < a.T ? dot : -INFINITY;
        group_max = fmaxf(group_max, s[jj]);
      }
      if (group_max == -INFINITY) continue;  // every key of the group is after this query
      const float new_max = fmaxf(max, group_max);
      const float rescale = __expf(max - new_max);
      sum *= rescale;
#pragma unroll
      for (int d = 0; d < kHead; ++d) o[d] *= rescale;
#pragma unroll
      for (int jj = 0; jj < kV3Group; ++jj) {
        const float p = __expf(s[jj] - new_max);
        sum += p;
#pragma unroll
        for (int d = 0; d < kHead; ++d) o[d] += p * v_tile[g0 + jj][d];
      }
      max = new_max;
    }
  }
  if (!active) return;
#pragma unroll
  for (int d = 0; d < kHead; ++d) a.out[row * kHead + d] = __float2bfloat16_rn(o[d] / sum);
  a.lse[row] = max + logf(sum);
}

// Query `row` (= bh * T + i) in float64: its output in `out` (kHead values), its lse returned.
double reference_query(const std::vector<double>& Q, const std::vector<double>& K,
                       const std::vector<double>& V, int64_t T, double scale, int64_t row,
                       std::vector<double>& out) {
  const int64_t bh = row / T, i = row % T;
  std::vector<double> p(i + 1);
  double max = -INFINITY, sum = 0;
  for (int64_t j = 0; j <= i; ++j) {
    double dot = 0;
    for (int d = 0; d < kHead; ++d) dot += Q[row * kHead + d] * K[(bh * T + j) * kHead + d];
    p[j] = dot * scale;
    max = std::max(max, p[j]);
  }
  for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - max));
  for (int d = 0; d < kHead; ++d) {
    double acc = 0;
    for (int64_t j = 0; j <= i; ++j) acc += p[j] * V[(bh * T + j) * kHead + d];
    out[d] = acc / sum;
  }
  return max + std::log(sum);
}

int climb_at(int B, int H, int T, bool timed) {
  const int BH = B * H;
  const size_t n = size_t(BH) * T * kHead;
  const float scale = 1.f / std::sqrt(float(kHead));
  const std::vector<bf16> hq = random_bf16(n, 71), hk = random_bf16(n, 72), hv = random_bf16(n, 73);
  DeviceArray<bf16> q(n), k(n), v(n), out(n);
  DeviceArray<float> lse(size_t(BH) * T), scores(size_t(BH) * T * T);
  q.upload(hq), k.upload(hk), v.upload(hv);
  const AttentionArgs args{q.get(),      k.get(), v.get(), out.get(), lse.get(),
                           scores.get(), BH,      T,       scale};
  const std::vector<double> Q = widen(hq), K = widen(hk), V = widen(hv);

  auto poison = [&] { out.poison(), lse.poison(); };
  auto check = [&] {
    const std::vector<double> got = widen(out.download()), got_lse = widen(lse.download());
    ErrorStats e_out("out"), e_lse("lse");
    std::vector<double> ref(kHead);
    for (int64_t row : sample_indices(int64_t(BH) * T, 96)) {
      const double ref_lse = reference_query(Q, K, V, T, scale, row, ref);
      for (int d = 0; d < kHead; ++d) e_out.add(got[row * kHead + d], ref[d], row * kHead + d);
      e_lse.add(got_lse[row], ref_lse, row);
    }
    return std::vector<ErrorStats>{e_out, e_lse};
  };
  // Causal: half of the T x T (query, key) pairs, 2 products of 2 * D flops each per pair.
  const Workload work{strf("B=%d H=%d T=%d D=%d bf16, causal", B, H, T, kHead), 0,
                      2.0 * BH * double(T) * T * kHead, timed, 1e-2};
  Ladder ladder("attention_forward", work, poison, check);

  const size_t pairs = size_t(BH) * T * T, rows = size_t(BH) * T;
  ladder.climb({"v1 scores, softmax, P V (T x T in memory)", "", [&] {
                  attention_v1_scores<<<blocks_for(pairs, 256), 256>>>(args);
                  attention_v1_softmax<<<blocks_for(rows, 128), 128>>>(args);
                  attention_v1_values<<<blocks_for(rows * kHead, 256), 256>>>(args);
                }});
  ladder.climb({"v2 thread per query, online softmax", "",
                [&] { attention_v2_thread_per_query<<<blocks_for(rows, 128), 128>>>(args); }});
  ladder.climb({"v3 64-query blocks, K/V tiles in shared mem", "", [&] {
                  attention_v3_tiled<<<dim3(blocks_for(T, kV3Queries), BH), kV3Queries>>>(args);
                }});
  const tessera::Tensor tq = as_tensor(q, {B, H, T, kHead}), tk = as_tensor(k, {B, H, T, kHead}),
                        tv = as_tensor(v, {B, H, T, kHead}),
                        tout = as_tensor(out, {B, H, T, kHead}), tlse = as_tensor(lse, {B, H, T});
  ladder.climb_library({"v4 tensor cores (mma.sync)", "", [&] {
                          tessera::cuda::flash_attention_forward_mma_sync(tq, tk, tv, scale, tout,
                                                                          tlse);
                        }});
  std::string why_not;
  if (!tessera::cuda::flash_attention_forward_uses_sm90(tq, tk, tv, scale, &why_not))
    why_not = "sm_90 kernel: " + why_not;
  ladder.climb_library({"v5 production (sm_90: TMA + wgmma)", why_not, [&] {
                          tessera::cuda::flash_attention_forward(tq, tk, tv, scale, tout, tlse);
                        }});
  why_not.clear();
  if (!timed)
    why_not = "the timed shape (a comparison only)";
  else if (!tessera::cuda::cudnn_attention_available(&why_not))
    why_not = "cuDNN attention: " + why_not;
  ladder.climb_library({"cuDNN fused attention (for comparison)", why_not, [&] {
                          tessera::cuda::cudnn_attention_forward(tq, tk, tv, scale, tout, tlse);
                        }});
  return ladder.failures();
}

}  // namespace

int attention_forward_ladder() {
  return climb_at(1, 3, 77, false) + climb_at(2, 2, 130, false) +
         (check_only() ? 0 : climb_at(4, 12, 1024, true));
}

}  // namespace ladders
