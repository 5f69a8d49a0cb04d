// Backward of the causal flash attention on the tensor cores. With P = softmax(scale Q K^T)
// recomputed from the saved log-sum-exp, and delta_i = sum_d dO_id O_id:
//   dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO.
// Two kernels, so no atomics are needed and results repeat bitwise:
//   dq kernel:  a block owns 64 queries and walks the key tiles up to the diagonal;
//   dkv kernel: a block owns 64 keys and walks the query tiles from the diagonal on,
//               computing S^T = K Q^T directly so P^T is already an A operand.
// Grouped-query attention (k, v with Hkv = H / group heads): the dq kernel reads its query
// head's key/value head; a dkv block owns 64 keys of one key/value head and walks the query
// tiles of every query head of its group, so dK and dV are summed over the group in
// registers (still no atomics, still bitwise repeatable).
// Tiles live in shared memory row-major; operands that need the transpose are read with
// ldmatrix.trans (same layout tricks as the forward in attention.cu).
// On an H100/H200 flash_attention_backward runs the wgmma + TMA kernels of
// attention_sm90_backward.cu instead (same split, same contract); these mma.sync kernels run
// everywhere else, for views TMA cannot describe, and with TESSERA_ATTENTION_SM90_BWD=0.
#include <cmath>
#include <cstdlib>
#include <string>

#include "tessera/kernels/cuda/attention_common.cuh"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/norm_common.cuh"
#include "tessera/kernels/ops.h"

namespace tessera::cuda {
namespace {
using namespace attention_detail;

// delta_i = sum_d dO[i, d] * O[i, d]: the row term of the softmax backward. A group of
// kGroup lanes shares a row: with 16-byte aligned rows (the usual case) D / 8 lanes, each
// taking one 8-element pack of O and of dO, so a warp reads 4 (D 64) or 2 (D 128) whole rows
// with 16-byte loads; otherwise a warp per row, one element per lane at a time. (A warp per
// row with 2-byte loads ran at a third of the copy bandwidth: 53 us for GPT-2 124M's
// 16 x 12 x 1024 rows, 5% of the attention backward.)
template <class T, int D, bool kPacked>
__global__ void attention_delta_kernel(const T* out, const T* dout, HeadLayout Lo, HeadLayout Ld,
                                       float* delta, int64_t rows, int64_t H, int64_t seq_len) {
  constexpr int kGroup = kPacked ? D / kPack : 32;
  static_assert(32 % kGroup == 0, "a row's lanes must sit in one warp");
  const int lane = static_cast<int>(threadIdx.x % kGroup);
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kGroup;
  // Lanes past the last row stay for the shuffles below (every lane of the warp takes part).
  const bool valid = r < rows;
  float s = 0.f;
  if (valid) {
    const int64_t t = r % seq_len, bh = r / seq_len, b = bh / H, h = bh % H;
    const T* o = out + Lo.row(b, h, t);
    const T* g = dout + Ld.row(b, h, t);
    if constexpr (kPacked) {
      const Pack8<T> ov = load_pack(o, lane), gv = load_pack(g, lane);
#pragma unroll
      for (int k = 0; k < kPack; ++k) s += to_float(ov.v[k]) * to_float(gv.v[k]);
    } else {
      for (int d = lane; d < D; d += kGroup) s += to_float(o[d]) * to_float(g[d]);
    }
  }
#pragma unroll
  for (int m = kGroup / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if (valid && lane == 0) delta[r] = s;
}

// Rows of O and dO start on 16-byte boundaries (packs can be used).
bool rows_are_packable(const Tensor& t) {
  return aligned16({t.raw_data()}) && t.stride(0) % kPack == 0 && t.stride(1) % kPack == 0 &&
         t.stride(2) % kPack == 0;
}

template <int D>
struct BwdTiles {
  static constexpr int KP = D + 8;  // pitch of a row-major [64][D] tile
  static constexpr int kRowTile = kTile * KP;
};

// S (or S^T) and dP (or dP^T) for this warp's 16 rows against one 64-wide tile:
// s = A1 * B1^T, dp = A2 * B2^T with A from row-major tiles a1/a2 and B from row-major b1/b2.
template <class T, int D>
__device__ __forceinline__ void scores_and_dp(float (&s)[kTile / 8][4], float (&dp)[kTile / 8][4],
                                              const T* a1, const T* b1, const T* a2, const T* b2,
                                              int row0, int g, int tq) {
  constexpr int KP = BwdTiles<D>::KP;
#pragma unroll
  for (int nb = 0; nb < kTile / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nb][e] = dp[nb][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t fa1[4], fa2[4];
    load_a_frag(fa1, a1, KP, row0, kk, g, tq);
    load_a_frag(fa2, a2, KP, row0, kk, g, tq);
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
      const T* p1 = b1 + (nb * 8 + g) * KP + kk * 16 + tq * 2;
      const T* p2 = b2 + (nb * 8 + g) * KP + kk * 16 + tq * 2;
      mma_16816<T>(s[nb], fa1, load_pair(p1), load_pair(p1 + 8));
      mma_16816<T>(dp[nb], fa2, load_pair(p2), load_pair(p2 + 8));
    }
  }
}

// acc[16 rows][D] += M[16 rows][64] * B[64][D], M given as accumulator-layout fragments and
// B as a row-major shared tile [64][D] (read transposed by ldmatrix).
template <class T, int D>
__device__ __forceinline__ void accumulate_product(float (&acc)[D / 8][4], const float (&m)[kTile / 8][4],
                                                   const T* b, int lane) {
  constexpr int KP = BwdTiles<D>::KP;
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const uint32_t a[4] = {pack2<T>(m[2 * kk][0], m[2 * kk][1]), pack2<T>(m[2 * kk][2], m[2 * kk][3]),
                           pack2<T>(m[2 * kk + 1][0], m[2 * kk + 1][1]),
                           pack2<T>(m[2 * kk + 1][2], m[2 * kk + 1][3])};
#pragma unroll
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t bf[4];
      load_b_trans_x4(bf, b, KP, kk * 16, j * 8, lane);
      mma_16816<T>(acc[j], a, bf[0], bf[1]);
      mma_16816<T>(acc[j + 1], a, bf[2], bf[3]);
    }
  }
}

// Writes this warp's 16 rows (r_lo and r_lo + 8 for this thread) of head (b, h), scaled by mul.
template <class T, int D>
__device__ __forceinline__ void store_rows(T* dst, HeadLayout L, int64_t b, int64_t h,
                                           const float (&acc)[D / 8][4], float mul, int64_t r_lo,
                                           int64_t seq_len, int tq) {
  const int64_t r_hi = r_lo + 8;
  T* row_lo = dst + L.row(b, h, r_lo) + tq * 2;
  T* row_hi = dst + L.row(b, h, r_hi) + tq * 2;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    if (r_lo < seq_len)
      *reinterpret_cast<uint32_t*>(row_lo + j * 8) = pack2<T>(acc[j][0] * mul, acc[j][1] * mul);
    if (r_hi < seq_len)
      *reinterpret_cast<uint32_t*>(row_hi + j * 8) = pack2<T>(acc[j][2] * mul, acc[j][3] * mul);
  }
}

// kDropout (both kernels): the forward dropped the probabilities with `drop`'s mask M (scaled
// by 1 / (1 - p)), so dV = (P * M)^T dO and dS = P * (M * dP - delta); delta = rowsum(dO * O)
// is unchanged, O being the dropped output.
// `mask` (both kernels) is the forward's: P is 0 wherever it masked a score, so a masked pair
// adds nothing to dQ, dK or dV; tiles no pair of which is visible are skipped, and keys at or
// past key_end are never loaded (zero-filled), so padding gets exactly zero dK, dV.
template <class T, int D, bool kDropout>
__global__ void __launch_bounds__(kTcWarps * 32)
    flash_backward_dq_tc_kernel(const T* q, const T* k, const T* v, const T* dout, HeadLayout Lq,
                                HeadLayout Lk, HeadLayout Lv, HeadLayout Ld, const float* lse,
                                const float* delta, T* dq, HeadLayout Ldq, int64_t H, int64_t group,
                                int64_t seq_len, float scale, DropoutMask drop, KeyMask mask) {
  using Tiles = BwdTiles<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* qs = reinterpret_cast<T*>(smem_raw);      // [64][D] this block's queries
  T* dos = qs + Tiles::kRowTile;               // [64][D] their dO
  T* kv_stage = dos + Tiles::kRowTile;         // 2 stages of [64][D] key and value tiles
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int q_tile = gridDim.x - 1 - blockIdx.x;
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H;
  const int64_t h_kv = h / group;  // the key/value head this query head reads (GQA)
  const int64_t q0 = int64_t(q_tile) * kTile;
  const int64_t r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
  const int64_t base = (b * H + h) * seq_len;
  const float sc = scale * kLog2e;
  const float lse_lo = r_lo < seq_len ? lse[base + r_lo] * kLog2e : 0.f;
  const float lse_hi = r_hi < seq_len ? lse[base + r_hi] * kLog2e : 0.f;
  const float del_lo = r_lo < seq_len ? delta[base + r_lo] : 0.f;
  const float del_hi = r_hi < seq_len ? delta[base + r_hi] : 0.f;
  load_tile_tc<T, D>(qs, Tiles::KP, q, Lq, b, h, q0, seq_len);
  load_tile_tc<T, D>(dos, Tiles::KP, dout, Ld, b, h, q0, seq_len);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const int64_t key_end = mask.key_end(b, seq_len);
  const int key_tiles = mask.key_tiles(q0 + kTile, key_end);  // causal: up to the diagonal
  auto prefetch = [&](int kt) {
    T* st = kv_stage + (kt & 1) * 2 * Tiles::kRowTile;
    load_tile_async<T, D>(st, Tiles::KP, k, Lk, b, h_kv, int64_t(kt) * kTile, key_end);
    load_tile_async<T, D>(st + Tiles::kRowTile, Tiles::KP, v, Lv, b, h_kv, int64_t(kt) * kTile,
                          key_end);
    cp_async_commit();
  };
  if (key_tiles > 0) prefetch(0);  // a row with no real key has dQ = 0
  for (int kt = 0; kt < key_tiles; ++kt) {
    if (kt + 1 < key_tiles) {
      prefetch(kt + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = kv_stage + (kt & 1) * 2 * Tiles::kRowTile;
    const T* vs = ks + Tiles::kRowTile;
    // Only the diagonal tile (causal), rows past T and a tile reaching past the real keys
    // need the mask.
    const bool need_mask =
        (mask.causal && kt == q_tile) || q0 + kTile > seq_len || int64_t(kt + 1) * kTile > key_end;
    float s[kTile / 8][4], dp[kTile / 8][4];
    scores_and_dp<T, D>(s, dp, qs, ks, dos, vs, warp * 16, g, tq);
    // dS = P * (dP - delta), P recomputed from the log-sum-exp, masked causally.
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
      if constexpr (kDropout) {
        const int64_t key = int64_t(kt) * kTile + nb * 8 + tq * 2;
        const float2 f_lo = drop.factors(b, h, r_lo, key), f_hi = drop.factors(b, h, r_hi, key);
        dp[nb][0] *= f_lo.x;
        dp[nb][1] *= f_lo.y;
        dp[nb][2] *= f_hi.x;
        dp[nb][3] *= f_hi.y;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[nb][e] * sc - (e < 2 ? lse_lo : lse_hi));
        if (need_mask) {
          const int64_t key = int64_t(kt) * kTile + nb * 8 + tq * 2 + (e & 1);
          const int64_t row = e < 2 ? r_lo : r_hi;
          if ((mask.causal && key > row) || row >= seq_len || key >= key_end) p = 0.f;
        }
        s[nb][e] = p * (dp[nb][e] - (e < 2 ? del_lo : del_hi));
      }
    }
    accumulate_product<T, D>(acc, s, ks, lane);  // dQ += dS K
    __syncthreads();  // the next prefetch overwrites this stage
  }
  store_rows<T, D>(dq, Ldq, b, h, acc, scale, r_lo, seq_len, tq);
}

template <class T, int D, bool kDropout>
__global__ void __launch_bounds__(kTcWarps * 32)
    flash_backward_dkv_tc_kernel(const T* q, const T* k, const T* v, const T* dout, HeadLayout Lq,
                                 HeadLayout Lk, HeadLayout Lv, HeadLayout Ld, const float* lse,
                                 const float* delta, T* dk, HeadLayout Ldk, T* dv, HeadLayout Ldv,
                                 int64_t H, int64_t group, int64_t seq_len, float scale,
                                 DropoutMask drop, KeyMask mask) {
  using Tiles = BwdTiles<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ks = reinterpret_cast<T*>(smem_raw);      // [64][D] this block's keys
  T* vs = ks + Tiles::kRowTile;                // [64][D] their values
  T* qdo_stage = vs + Tiles::kRowTile;         // 2 stages of [64][D] query and dO tiles
  float* stat_stage = reinterpret_cast<float*>(qdo_stage + 4 * Tiles::kRowTile);  // 2 x (lse, delta)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int k_tile = blockIdx.x;
  const int64_t H_kv = H / group;
  const int64_t b = blockIdx.y / H_kv, h_kv = blockIdx.y % H_kv;
  const int64_t k0 = int64_t(k_tile) * kTile;
  const int64_t key_lo = k0 + warp * 16 + g, key_hi = key_lo + 8;
  const int num_tiles = static_cast<int>((seq_len + kTile - 1) / kTile);
  // Keys at or past key_end are padding: loaded as zeros, their P masked to 0; a block of
  // padding only walks nothing and stores zeros.
  const int64_t key_end = mask.key_end(b, seq_len);
  // Step i visits query tile tile_of(i) of query head head_of(i): the tiles from the
  // diagonal on (causal; every tile otherwise) of each of the group's query heads in turn,
  // one pipeline over all of them.
  const int first_tile = mask.causal ? k_tile : 0;
  const int tiles_per_head = num_tiles - first_tile;
  const int steps = k0 < key_end ? static_cast<int>(group) * tiles_per_head : 0;
  auto head_of = [&](int i) { return h_kv * group + i / tiles_per_head; };
  auto tile_of = [&](int i) { return first_tile + i % tiles_per_head; };
  const float sc = scale * kLog2e;
  load_tile_tc<T, D>(ks, Tiles::KP, k, Lk, b, h_kv, k0, key_end);
  load_tile_tc<T, D>(vs, Tiles::KP, v, Lv, b, h_kv, k0, key_end);
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[j][e] = dv_acc[j][e] = 0.f;

  auto prefetch = [&](int i) {
    T* st = qdo_stage + (i & 1) * 2 * Tiles::kRowTile;
    const int64_t h = head_of(i), q0 = int64_t(tile_of(i)) * kTile;
    const int64_t base = (b * H + h) * seq_len;  // of this query head's rows in lse and delta
    load_tile_async<T, D>(st, Tiles::KP, q, Lq, b, h, q0, seq_len);
    load_tile_async<T, D>(st + Tiles::kRowTile, Tiles::KP, dout, Ld, b, h, q0, seq_len);
    float* stats = stat_stage + (i & 1) * 2 * kTile;
    for (int r = threadIdx.x; r < 2 * kTile; r += blockDim.x) {
      const int64_t t = q0 + r % kTile;
      const float* from = (r < kTile ? lse : delta) + base + (t < seq_len ? t : 0);
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(stats + r));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(from),
                   "r"(t < seq_len ? 4 : 0));
    }
    cp_async_commit();
  };
  if (steps > 0) prefetch(0);
  for (int i = 0; i < steps; ++i) {
    const int qt = tile_of(i);
    const int64_t q0 = int64_t(qt) * kTile;
    if (i + 1 < steps) {
      prefetch(i + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* qs = qdo_stage + (i & 1) * 2 * Tiles::kRowTile;
    const T* dos = qs + Tiles::kRowTile;
    const float* lse_s = stat_stage + (i & 1) * 2 * kTile;  // natural-log lse
    const float* del_s = lse_s + kTile;
    const bool need_mask =
        (mask.causal && qt == k_tile) || q0 + kTile > seq_len || k0 + kTile > key_end;
    // S^T = K Q^T and dP^T = V dO^T: rows are this warp's keys, columns the tile's queries.
    float s[kTile / 8][4], dp[kTile / 8][4];
    scores_and_dp<T, D>(s, dp, ks, qs, vs, dos, warp * 16, g, tq);
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nb * 8 + tq * 2 + (e & 1);
        float p = exp2f(s[nb][e] * sc - lse_s[col] * kLog2e);
        if (need_mask) {
          const int64_t query = q0 + col;
          const int64_t key = e < 2 ? key_lo : key_hi;
          if ((mask.causal && query < key) || query >= seq_len || key >= key_end) p = 0.f;
        }
        if constexpr (kDropout) {  // element (query, key) of head h's probabilities
          const float f = drop.factor(b, head_of(i), q0 + col, e < 2 ? key_lo : key_hi);
          s[nb][e] = p * f;                              // (P * M)^T
          dp[nb][e] = p * (dp[nb][e] * f - del_s[col]);  // dS^T
        } else {
          s[nb][e] = p;                              // P^T
          dp[nb][e] = p * (dp[nb][e] - del_s[col]);  // dS^T
        }
      }
    accumulate_product<T, D>(dv_acc, s, dos, lane);   // dV += P^T dO
    accumulate_product<T, D>(dk_acc, dp, qs, lane);   // dK += dS^T Q
    __syncthreads();  // the next prefetch overwrites this stage
  }
  store_rows<T, D>(dk, Ldk, b, h_kv, dk_acc, scale, key_lo, seq_len, tq);
  store_rows<T, D>(dv, Ldv, b, h_kv, dv_acc, 1.f, key_lo, seq_len, tq);
}

template <class Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)));
}

enum class BackwardKernels { dispatch, sm90, mma_sync };

void launch_mma_sync_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                              const Tensor& lse, const Tensor& delta, double scale,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const AttnShape& s, cudaStream_t stream,
                              const DropoutDraw* dropout, KeyMask mask) {
  const unsigned tiles = static_cast<unsigned>((s.T + kTile - 1) / kTile);
  const dim3 dq_grid(tiles, static_cast<unsigned>(s.B * s.H));     // per query head
  const dim3 dkv_grid(tiles, static_cast<unsigned>(s.B * s.Hkv));  // per key/value head
  const DropoutMask drop = dropout ? dropout_mask(*dropout, s.H, s.T) : DropoutMask{};
  auto run = [&](auto tag, auto dconst, auto dropping) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    constexpr bool kDropout = decltype(dropping)::value;
    using Tiles = BwdTiles<D>;
    const size_t dq_smem = 6 * Tiles::kRowTile * sizeof(T);
    const size_t dkv_smem = 6 * Tiles::kRowTile * sizeof(T) + 4 * kTile * sizeof(float);
    // Over 48 KB of shared memory needs an opt-in (per device, so asked on every call: cheap).
    allow_shared(flash_backward_dq_tc_kernel<T, D, kDropout>, dq_smem);
    allow_shared(flash_backward_dkv_tc_kernel<T, D, kDropout>, dkv_smem);
    flash_backward_dq_tc_kernel<T, D, kDropout><<<dq_grid, kTcWarps * 32, dq_smem, stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const T*>(dout.raw_data()), layout_of(q),
        layout_of(k), layout_of(v), layout_of(dout), lse.data<float>(), delta.data<float>(),
        static_cast<T*>(dq.raw_data()), layout_of(dq), s.H, s.group(), s.T,
        static_cast<float>(scale), drop, mask);
    TESSERA_KERNEL_CHECK("flash_backward_dq_tc_kernel");
    flash_backward_dkv_tc_kernel<T, D, kDropout><<<dkv_grid, kTcWarps * 32, dkv_smem, stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const T*>(dout.raw_data()), layout_of(q),
        layout_of(k), layout_of(v), layout_of(dout), lse.data<float>(), delta.data<float>(),
        static_cast<T*>(dk.raw_data()), layout_of(dk), static_cast<T*>(dv.raw_data()),
        layout_of(dv), s.H, s.group(), s.T, static_cast<float>(scale), drop, mask);
    TESSERA_KERNEL_CHECK("flash_backward_dkv_tc_kernel");
  };
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    if (dropout) run(tag, dconst, std::true_type{});
    else run(tag, dconst, std::false_type{});
  });
}

// dbias = the column sums of dq | dk | dv over their B T rows, where the Hopper kernels did not
// sum them as they wrote them.
void column_sums_of_heads(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                          const Tensor& dbias) {
  const int64_t width = dq.size(1) * dq.size(3);
  const Tensor* parts[] = {&dq, &dk, &dv};
  for (int64_t i = 0; i < 3; ++i)
    raw::copy_(raw::narrow(dbias, 0, i * width, width),
               raw::reshape(ops::sum(*parts[i], {0, 2}), {width}));
}

// The checks, delta, then the chosen kernels; with dbias also the column sums of dq | dk | dv.
// With `dropout` (mma_sync only): the kernels that regenerate the forward's mask. Not causal or
// with kv_lengths (mma_sync only): the keys flash_masked_attention_forward attended to.
void run_backward(const char* op, BackwardKernels which, const Tensor& q, const Tensor& k,
                  const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse,
                  double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                  const Tensor& dbias = Tensor(), const DropoutDraw* dropout = nullptr,
                  bool causal = true, const Tensor& kv_lengths = Tensor()) {
  const AttnShape s = check_inputs(op, q, k, v, false);
  if (kv_lengths.defined()) check_kv_lengths(op, kv_lengths, s, q.device());
  TESSERA_CHECK(which == BackwardKernels::mma_sync || (causal && !kv_lengths.defined()), op,
                ": the Hopper backward kernels take no mask (causal, unpadded attention only)");
  check_vector_rows(op, q, k, v);
  check_head_view(op, "out", out, q, /*vector_rows=*/false, /*written=*/false);
  check_head_view(op, "dout", dout, q, /*vector_rows=*/true, /*written=*/false);
  check_head_view(op, "dq", dq, q, /*vector_rows=*/true, /*written=*/true);
  check_head_view(op, "dk", dk, k, /*vector_rows=*/true, /*written=*/true);
  check_head_view(op, "dv", dv, k, /*vector_rows=*/true, /*written=*/true);
  check_lse(op, lse, s, q.device());
  TESSERA_CHECK(!dbias.defined() ||
                    (s.Hkv == s.H && dbias.shape() == Shape{3 * s.H * s.D} &&
                     dbias.dtype() == q.dtype() && dbias.device() == q.device() &&
                     dbias.is_contiguous()),
                op, ": the bias gradient must be a contiguous [3 H D] = [", 3 * s.H * s.D,
                "] tensor of q's dtype and device with as many key/value heads as query heads; got ",
                dbias.defined() ? shape_str(dbias.shape()) : "", " for q ", shape_str(q.shape()),
                " and k ", shape_str(k.shape()));
  if (q.numel() == 0) {
    if (dbias.defined()) raw::fill_(dbias, 0.0);
    return;
  }
  // The Hopper kernels where they run (a refusal launches nothing but the delta kernel below,
  // whose output is scratch), else the mma.sync ones, unless they were asked for explicitly.
  const bool try_sm90 = which == BackwardKernels::sm90 ||
                        (which == BackwardKernels::dispatch && !sm90_switched_off("TESSERA_ATTENTION_SM90_BWD"));
  KernelContext ctx(dq);
  Tensor delta = empty({s.B * s.H * s.T}, {.dtype = DType::f32, .device = q.device()});
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    const int64_t rows = s.B * s.H * s.T;
    auto launch = [&](auto kernel, int group) {
      constexpr int kThreads = 256;
      const int64_t blocks = (rows * group + kThreads - 1) / kThreads;
      kernel<<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream>>>(
          static_cast<const T*>(out.raw_data()), static_cast<const T*>(dout.raw_data()),
          layout_of(out), layout_of(dout), delta.data<float>(), rows, s.H, s.T);
      TESSERA_KERNEL_CHECK("attention_delta_kernel");
    };
    if (rows_are_packable(out) && rows_are_packable(dout))
      launch(attention_delta_kernel<T, D, true>, D / kPack);
    else
      launch(attention_delta_kernel<T, D, false>, 32);
  });
  std::string why_not;
  const int64_t bias_width = 3 * s.H * s.D;
  const Tensor bias_partials =
      dbias.defined() && try_sm90
          ? empty({sm90_bias_partial_rows(s), bias_width}, {.dtype = DType::f32, .device = q.device()})
          : Tensor();
  if (try_sm90 && launch_sm90_backward(q, k, v, dout, lse, delta, scale, dq, dk, dv, bias_partials,
                                       s, ctx.stream, &why_not)) {
    if (dbias.defined()) {
      visit_half_float(q.dtype(), [&](auto tag) {
        using T = decltype(tag);
        add_column_partials<T>(ctx.stream, /*accumulate=*/false, bias_partials.data<float>(),
                               nullptr, bias_partials.size(0), bias_width,
                               static_cast<T*>(dbias.raw_data()), nullptr);
      });
    }
    return;
  }
  TESSERA_CHECK(which != BackwardKernels::sm90, op, ": the Hopper kernels cannot run here: ",
                why_not);
  const KeyMask mask{causal, kv_lengths.defined() ? kv_lengths.data<int32_t>() : nullptr};
  launch_mma_sync_backward(q, k, v, dout, lse, delta, scale, dq, dk, dv, s, ctx.stream, dropout,
                           mask);
  if (dbias.defined()) column_sums_of_heads(dq, dk, dv, dbias);
}

}  // namespace

// On an H100/H200 the wgmma/TMA kernels of attention_sm90_backward.cu, elsewhere (or for views
// TMA cannot read, or with TESSERA_ATTENTION_SM90_BWD=0) the mma.sync kernels above.
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse,
                              double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  run_backward("flash_attention_backward", BackwardKernels::dispatch, q, k, v, out, dout, lse,
               scale, dq, dk, dv);
}

void flash_attention_backward_with_bias_grad(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& dout,
                                             const Tensor& lse, double scale, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv,
                                             const Tensor& dbias) {
  TESSERA_CHECK(dbias.defined(), "flash_attention_backward_with_bias_grad: no bias gradient given");
  run_backward("flash_attention_backward_with_bias_grad", BackwardKernels::dispatch, q, k, v, out,
               dout, lse, scale, dq, dk, dv, dbias);
}

void flash_attention_backward_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& out, const Tensor& dout, const Tensor& lse,
                                   double scale, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv) {
  run_backward("flash_attention_backward_sm90", BackwardKernels::sm90, q, k, v, out, dout, lse,
               scale, dq, dk, dv);
}

void flash_attention_backward_mma_sync(const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& dout, const Tensor& lse,
                                       double scale, const Tensor& dq, const Tensor& dk,
                                       const Tensor& dv) {
  run_backward("flash_attention_backward_mma_sync", BackwardKernels::mma_sync, q, k, v, out, dout,
               lse, scale, dq, dk, dv);
}

void flash_attention_dropout_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& out, const Tensor& dout, const Tensor& lse,
                                      double scale, const DropoutDraw& dropout,
                                      const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  run_backward("flash_attention_dropout_backward", BackwardKernels::mma_sync, q, k, v, out, dout,
               lse, scale, dq, dk, dv, Tensor(), &dropout);
}

void flash_masked_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& dout, const Tensor& lse,
                                     double scale, bool causal, const Tensor& kv_lengths,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  // Plain causal attention dispatches (the Hopper kernels where they run); they take no mask,
  // so anything else runs the mma.sync kernels.
  const bool plain_causal = causal && !kv_lengths.defined();
  run_backward("flash_masked_attention_backward",
               plain_causal ? BackwardKernels::dispatch : BackwardKernels::mma_sync, q, k, v, out,
               dout, lse, scale, dq, dk, dv, Tensor(), nullptr, causal, kv_lengths);
}

void flash_masked_attention_dropout_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& dout, const Tensor& lse,
                                             double scale, bool causal, const Tensor& kv_lengths,
                                             const DropoutDraw& dropout, const Tensor& dq,
                                             const Tensor& dk, const Tensor& dv) {
  run_backward("flash_masked_attention_dropout_backward", BackwardKernels::mma_sync, q, k, v, out,
               dout, lse, scale, dq, dk, dv, Tensor(), &dropout, causal, kv_lengths);
}

bool flash_attention_backward_uses_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& dout, std::string* why_not) {
  const char* op = "flash_attention_backward_uses_sm90";
  check_inputs(op, q, k, v, false);
  check_vector_rows(op, q, k, v);
  check_head_view(op, "dout", dout, q, /*vector_rows=*/true, /*written=*/false);
  DeviceGuard guard(q.device().index);
  const std::string reason = sm90_switched_off("TESSERA_ATTENTION_SM90_BWD")
                                 ? "TESSERA_ATTENTION_SM90_BWD=0 keeps the mma.sync kernels"
                                 : sm90_backward_unsupported(q, k, v, dout);
  if (why_not) *why_not = reason;
  return reason.empty();
}

}  // namespace tessera::cuda
