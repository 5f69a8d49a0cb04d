// Causal self-attention, flash-attention style: queries are processed in tiles of 64, keys
// and values stream through shared memory in tiles of 64, and the softmax is computed
// online (running max and sum), so memory is O(T) per head: only the output and one
// log-sum-exp per query are stored. The backward recomputes the probabilities from the
// saved log-sum-exp (attention_backward.cu). The matrix products run on the tensor cores
// through mma.sync; naive_attention_forward below is the readable reference that stores the
// whole [T, T] score matrix. Grouped-query attention (k, v with H / group heads) costs
// nothing extra: a query head's block simply streams the tiles of its key/value head.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "tessera/kernels/cuda/attention_common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {
using namespace attention_detail;

constexpr int kFwdWarps = 8;                // 8 warps x 16 queries
constexpr int kFwdQueries = kFwdWarps * 16;  // queries per block

// kDropout: the probabilities that multiply V are dropped and scaled by `drop` (the row sums,
// and so the log-sum-exp kept for the backward, are those of the undropped probabilities).
// `mask` says which keys a query sees (causal or not, keys padded on the right): the block
// streams only the key tiles some of its queries see, and masks scores inside a tile.
template <class T, int D, bool kDropout>
__global__ void __launch_bounds__(kFwdWarps * 32)
    flash_forward_tc_kernel(const T* q, const T* k, const T* v, HeadLayout Lq, HeadLayout Lk,
                            HeadLayout Lv, T* out, HeadLayout Lo, float* lse, int64_t H,
                            int64_t group, int64_t seq_len, float scale, DropoutMask drop,
                            KeyMask mask) {
  constexpr int KSTEPS = D / 16;     // k-steps of S = Q K^T
  constexpr int SBLK = kTile / 8;    // 8-key blocks of S
  constexpr int OBLK = D / 8;        // 8-dim blocks of O
  constexpr int KP = D + 8;
  // Two stages of K and V tiles ([key][dim]): the next pair is copied while this one is used.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  // Stage s holds K at tile slot 2s and V at slot 2s + 1 (pointer arithmetic, not a pointer
  // array, so nothing is indexed at run time in local memory).
  auto k_stage = [&](int kt) { return smem + (kt & 1) * 2 * kTile * KP; };
  auto v_stage = [&](int kt) { return smem + ((kt & 1) * 2 + 1) * kTile * KP; };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int q_tile = gridDim.x - 1 - blockIdx.x;  // longest rows first
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H;
  const int64_t h_kv = h / group;  // the key/value head this query head reads (GQA)
  const int64_t q0 = int64_t(q_tile) * kFwdQueries;
  const int64_t r_lo = q0 + warp * 16 + g, r_hi = r_lo + 8;
  // Keys at key_end and past it (padding, or past T) are never loaded: their tiles are
  // zero-filled and their scores -inf.
  const int64_t key_end = mask.key_end(b, seq_len);
  const int key_tiles = mask.key_tiles(q0 + kFwdQueries, key_end);

  uint32_t qf[KSTEPS][4];
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const int c = kk * 16 + tq * 2;
    qf[kk][0] = r_lo < seq_len ? load_pair(q + Lq.row(b, h, r_lo) + c) : 0u;
    qf[kk][1] = r_hi < seq_len ? load_pair(q + Lq.row(b, h, r_hi) + c) : 0u;
    qf[kk][2] = r_lo < seq_len ? load_pair(q + Lq.row(b, h, r_lo) + c + 8) : 0u;
    qf[kk][3] = r_hi < seq_len ? load_pair(q + Lq.row(b, h, r_hi) + c + 8) : 0u;
  }
  float o[OBLK][4];
#pragma unroll
  for (int j = 0; j < OBLK; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  const float sc = scale * kLog2e;

  auto prefetch = [&](int kt) {
    load_tile_async<T, D>(k_stage(kt), KP, k, Lk, b, h_kv, int64_t(kt) * kTile, key_end);
    load_tile_async<T, D>(v_stage(kt), KP, v, Lv, b, h_kv, int64_t(kt) * kTile, key_end);
    cp_async_commit();
  };
  if (key_tiles > 0) prefetch(0);  // a row with no real key streams nothing
  const int64_t warp_first = q0 + warp * 16;
  for (int kt = 0; kt < key_tiles; ++kt) {
    if (kt + 1 < key_tiles) {
      prefetch(kt + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = k_stage(kt);
    const T* vs = v_stage(kt);
    const int64_t key0 = int64_t(kt) * kTile;
    // Causal: a tile entirely in this warp's future adds nothing; one entirely in its past
    // needs no mask unless it reaches past the real keys.
    if (!mask.causal || key0 <= warp_first + 15) {
    const bool need_mask =
        (mask.causal && key0 + kTile - 1 > warp_first) || key0 + kTile > key_end;

    float s[SBLK][4];
#pragma unroll
    for (int nb = 0; nb < SBLK; ++nb) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
      const T* krow = ks + (nb * 8 + g) * KP + tq * 2;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk)
        mma_16816<T>(s[nb], qf[kk], load_pair(krow + kk * 16), load_pair(krow + kk * 16 + 8));
    }
    // Scale to log2 units and mask the future (causal) and keys past the real ones.
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < SBLK; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nb][e] *= sc;
        if (need_mask) {
          const int64_t key = key0 + nb * 8 + tq * 2 + (e & 1);
          const int64_t row = e < 2 ? r_lo : r_hi;
          if ((mask.causal && key > row) || key >= key_end) s[nb][e] = -INFINITY;
        }
        if (e < 2) mx_lo = fmaxf(mx_lo, s[nb][e]);
        else mx_hi = fmaxf(mx_hi, s[nb][e]);
      }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o2));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o2));
    }
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    // A row with nothing visible yet keeps reference 0 so that no inf - inf appears.
    const float ref_lo = new_lo == -INFINITY ? 0.f : new_lo, ref_hi = new_hi == -INFINITY ? 0.f : new_hi;
    const float corr_lo = exp2f(m_lo - ref_lo), corr_hi = exp2f(m_hi - ref_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    l_lo *= corr_lo;
    l_hi *= corr_hi;
#pragma unroll
    for (int j = 0; j < OBLK; ++j) {
      o[j][0] *= corr_lo;
      o[j][1] *= corr_lo;
      o[j][2] *= corr_hi;
      o[j][3] *= corr_hi;
    }
#pragma unroll
    for (int nb = 0; nb < SBLK; ++nb) {
      s[nb][0] = exp2f(s[nb][0] - ref_lo);
      s[nb][1] = exp2f(s[nb][1] - ref_lo);
      s[nb][2] = exp2f(s[nb][2] - ref_hi);
      s[nb][3] = exp2f(s[nb][3] - ref_hi);
      l_lo += s[nb][0] + s[nb][1];
      l_hi += s[nb][2] + s[nb][3];
      if constexpr (kDropout) {
        const int64_t key = key0 + nb * 8 + tq * 2;
        const float2 f_lo = drop.factors(b, h, r_lo, key), f_hi = drop.factors(b, h, r_hi, key);
        s[nb][0] *= f_lo.x;
        s[nb][1] *= f_lo.y;
        s[nb][2] *= f_hi.x;
        s[nb][3] *= f_hi.y;
      }
    }
    // O += P V, 16 keys per step; P's accumulator layout is the A operand's layout.
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < OBLK; j += 2) {
        uint32_t bv[4];
        load_b_trans_x4(bv, vs, KP, kk * 16, j * 8, lane);
        mma_16816<T>(o[j], a, bv[0], bv[1]);
        mma_16816<T>(o[j + 1], a, bv[2], bv[3]);
      }
    }
    }  // tile visible to this warp
    __syncthreads();  // the next prefetch overwrites this stage
  }
#pragma unroll
  for (int o2 = 1; o2 <= 2; o2 <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o2);
  }
  const int64_t base = (b * H + h) * seq_len;  // of this head's rows in the contiguous lse
  // A row that saw no key (its batch row has length 0) has l = 0 and o = 0: it stores 0 (o / 1)
  // and lse +inf, so the backward's exp(s - lse) is 0 for it (FlashAttention's convention).
  const float div_lo = l_lo == 0.f ? 1.f : l_lo, div_hi = l_hi == 0.f ? 1.f : l_hi;
  if (r_lo < seq_len) {
    T* orow = out + Lo.row(b, h, r_lo) + tq * 2;
#pragma unroll
    for (int j = 0; j < OBLK; ++j)
      *reinterpret_cast<uint32_t*>(orow + j * 8) = pack2<T>(o[j][0] / div_lo, o[j][1] / div_lo);
    if (tq == 0) lse[base + r_lo] = l_lo == 0.f ? INFINITY : (m_lo + log2f(l_lo)) / kLog2e;
  }
  if (r_hi < seq_len) {
    T* orow = out + Lo.row(b, h, r_hi) + tq * 2;
#pragma unroll
    for (int j = 0; j < OBLK; ++j)
      *reinterpret_cast<uint32_t*>(orow + j * 8) = pack2<T>(o[j][2] / div_hi, o[j][3] / div_hi);
    if (tq == 0) lse[base + r_hi] = l_hi == 0.f ? INFINITY : (m_hi + log2f(l_hi)) / kLog2e;
  }
}

// ---- the naive reference: scores materialised in global memory ----
template <class T>
__global__ void naive_scores_kernel(const T* q, const T* k, HeadLayout Lq, HeadLayout Lk,
                                    float* scores, int64_t BH, int64_t H, int64_t group,
                                    int64_t seq_len, int64_t D, float scale) {
  const int64_t total = BH * seq_len * seq_len;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % seq_len, i = (e / seq_len) % seq_len, bh = e / (seq_len * seq_len);
    const int64_t b = bh / H, h = bh % H;
    float s = -INFINITY;
    if (j <= i) {
      s = 0.f;
      for (int64_t d = 0; d < D; ++d)
        s += to_float(q[Lq.row(b, h, i) + d]) * to_float(k[Lk.row(b, h / group, j) + d]);
      s *= scale;
    }
    scores[e] = s;
  }
}

// One thread per query row: softmax in place and the row's log-sum-exp.
__global__ void naive_softmax_kernel(float* scores, float* lse, int64_t rows, int64_t seq_len) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    float* row = scores + r * seq_len;
    float m = -INFINITY;
    for (int64_t j = 0; j < seq_len; ++j) m = fmaxf(m, row[j]);
    float s = 0.f;
    for (int64_t j = 0; j < seq_len; ++j) s += expf(row[j] - m);
    for (int64_t j = 0; j < seq_len; ++j) row[j] = expf(row[j] - m) / s;
    lse[r] = m + logf(s);
  }
}

template <class T>
__global__ void naive_pv_kernel(const float* probs, const T* v, HeadLayout Lv, T* out, HeadLayout Lo,
                                int64_t BH, int64_t H, int64_t group, int64_t seq_len, int64_t D) {
  const int64_t total = BH * seq_len * D;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = e % D, i = (e / D) % seq_len, bh = e / (D * seq_len);
    const int64_t b = bh / H, h = bh % H;
    float acc = 0.f;
    for (int64_t j = 0; j <= i; ++j)
      acc += probs[(bh * seq_len + i) * seq_len + j] * to_float(v[Lv.row(b, h / group, j) + d]);
    out[Lo.row(b, h, i) + d] = from_float<T>(acc);
  }
}

}  // namespace

namespace {

// The argument contract of every flash forward entry point; returns the shape.
AttnShape check_forward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_inputs(op, q, k, v, false);
  check_vector_rows(op, q, k, v);
  check_head_view(op, "out", out, q, /*vector_rows=*/true, /*written=*/true);
  check_lse(op, lse, s, q.device());
  return s;
}

// With `dropout`, the kernel that drops probabilities (the mask of that state); `mask` says
// which keys each query sees (plain causal by default).
void launch_mma_sync_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse, const AttnShape& s,
                             cudaStream_t stream, const DropoutDraw* dropout = nullptr,
                             KeyMask mask = {}) {
  const dim3 grid(static_cast<unsigned>((s.T + kFwdQueries - 1) / kFwdQueries),
                  static_cast<unsigned>(s.B * s.H));
  const DropoutMask drop = dropout ? dropout_mask(*dropout, s.H, s.T) : DropoutMask{};
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    const size_t smem = 4 * kTile * (D + 8) * sizeof(T);
    auto launch = [&](auto kernel) {
      TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
      kernel<<<grid, kFwdWarps * 32, smem, stream>>>(
          static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
          static_cast<const T*>(v.raw_data()), layout_of(q), layout_of(k), layout_of(v),
          static_cast<T*>(out.raw_data()), layout_of(out), lse.data<float>(), s.H, s.group(), s.T,
          static_cast<float>(scale), drop, mask);
    };
    if (dropout) launch(flash_forward_tc_kernel<T, D, true>);
    else launch(flash_forward_tc_kernel<T, D, false>);
  });
  TESSERA_KERNEL_CHECK("flash_forward_tc_kernel");
}

}  // namespace

// On an H100/H200 the wgmma/TMA kernel of attention_sm90.cu, elsewhere (or for views TMA cannot
// read, or with TESSERA_ATTENTION_SM90=0) the mma.sync kernel above.
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_forward("flash_attention_forward", q, k, v, out, lse);
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  if (!sm90_switched_off("TESSERA_ATTENTION_SM90") &&
      launch_sm90_forward(q, k, v, scale, out, lse, s, ctx.stream, nullptr)) {
    TESSERA_KERNEL_CHECK("flash_forward_sm90_kernel");
    return;
  }
  launch_mma_sync_forward(q, k, v, scale, out, lse, s, ctx.stream);
}

void flash_attention_forward_sm90(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                  const Tensor& out, const Tensor& lse) {
  const char* op = "flash_attention_forward_sm90";
  const AttnShape s = check_forward(op, q, k, v, out, lse);
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  std::string why_not;
  const bool launched = launch_sm90_forward(q, k, v, scale, out, lse, s, ctx.stream, &why_not);
  TESSERA_CHECK(launched, op, ": the Hopper kernel cannot run here: ", why_not);
  TESSERA_KERNEL_CHECK("flash_forward_sm90_kernel");
}

void flash_attention_forward_mma_sync(const Tensor& q, const Tensor& k, const Tensor& v,
                                      double scale, const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_forward("flash_attention_forward_mma_sync", q, k, v, out, lse);
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  launch_mma_sync_forward(q, k, v, scale, out, lse, s, ctx.stream);
}

void flash_attention_dropout_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     double scale, const DropoutDraw& dropout,
                                     const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_forward("flash_attention_dropout_forward", q, k, v, out, lse);
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  launch_mma_sync_forward(q, k, v, scale, out, lse, s, ctx.stream, &dropout);
}

void flash_masked_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                    bool causal, const Tensor& kv_lengths, const Tensor& out,
                                    const Tensor& lse) {
  const char* op = "flash_masked_attention_forward";
  const AttnShape s = check_forward(op, q, k, v, out, lse);
  if (kv_lengths.defined()) check_kv_lengths(op, kv_lengths, s, q.device());
  // Plain causal attention is the dispatching entry (the Hopper kernel where it runs); the
  // Hopper kernels take no mask, so anything else runs the mma.sync kernel.
  if (causal && !kv_lengths.defined()) return flash_attention_forward(q, k, v, scale, out, lse);
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  const KeyMask mask{causal, kv_lengths.defined() ? kv_lengths.data<int32_t>() : nullptr};
  launch_mma_sync_forward(q, k, v, scale, out, lse, s, ctx.stream, nullptr, mask);
}

void flash_masked_attention_dropout_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            double scale, bool causal, const Tensor& kv_lengths,
                                            const DropoutDraw& dropout, const Tensor& out,
                                            const Tensor& lse) {
  const char* op = "flash_masked_attention_dropout_forward";
  const AttnShape s = check_forward(op, q, k, v, out, lse);
  if (kv_lengths.defined()) check_kv_lengths(op, kv_lengths, s, q.device());
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  const KeyMask mask{causal, kv_lengths.defined() ? kv_lengths.data<int32_t>() : nullptr};
  launch_mma_sync_forward(q, k, v, scale, out, lse, s, ctx.stream, &dropout, mask);
}

bool flash_attention_forward_uses_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                       double scale, std::string* why_not) {
  check_inputs("flash_attention_forward_uses_sm90", q, k, v, false);
  check_vector_rows("flash_attention_forward_uses_sm90", q, k, v);
  DeviceGuard guard(q.device().index);
  const std::string reason = sm90_switched_off("TESSERA_ATTENTION_SM90")
                                 ? "TESSERA_ATTENTION_SM90=0 keeps the mma.sync kernel"
                                 : sm90_forward_unsupported(q, k, v, scale);
  if (why_not) *why_not = reason;
  return reason.empty();
}

void naive_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_inputs("naive_attention_forward", q, k, v, true);
  check_head_view("naive_attention_forward", "out", out, q, /*vector_rows=*/false, /*written=*/true);
  check_lse("naive_attention_forward", lse, s, q.device());
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  const int64_t BH = s.B * s.H;
  Tensor scores = empty({BH, s.T, s.T}, {.dtype = DType::f32, .device = q.device()});
  auto run = [&](auto tag) {
    using T = decltype(tag);
    naive_scores_kernel<T><<<grid_for(BH * s.T * s.T), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()), layout_of(q),
        layout_of(k), scores.data<float>(), BH, s.H, s.group(), s.T, s.D,
        static_cast<float>(scale));
    naive_softmax_kernel<<<grid_for(BH * s.T), kThreads, 0, ctx.stream>>>(
        scores.data<float>(), lse.data<float>(), BH * s.T, s.T);
    naive_pv_kernel<T><<<grid_for(BH * s.T * s.D), kThreads, 0, ctx.stream>>>(
        scores.data<float>(), static_cast<const T*>(v.raw_data()), layout_of(v),
        static_cast<T*>(out.raw_data()), layout_of(out), BH, s.H, s.group(), s.T, s.D);
  };
  if (q.dtype() == DType::bf16) run(BFloat16{});
  else run(Half{});
  TESSERA_KERNEL_CHECK("naive_attention kernels");
}

}  // namespace tessera::cuda
