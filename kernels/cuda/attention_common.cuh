// Shared by the attention kernels (attention.cu forward, attention_backward.cu): tile sizes,
// the [B, H, T, D] stride layout and the mma.sync helpers (argument checks: attention_checks.h).
#pragma once
#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/philox.h"
#include "tessera/kernels/cuda/attention_checks.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/fused_table.h"

namespace tessera::cuda::attention_detail {

constexpr int kTile = 64;                 // queries (or keys) per block
constexpr float kLog2e = 1.4426950408889634f;

struct HeadLayout {
  int64_t sb, sh, st;  // strides of [B, H, T, D] in elements (the D stride is 1)
  __device__ __forceinline__ int64_t row(int64_t b, int64_t h, int64_t t) const {
    return b * sb + h * sh + t * st;
  }
};

inline HeadLayout layout_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Dropout on the probabilities (kernels/fused_table.h's DropoutDraw, as the kernels take
// it): probability (b, h, row, key) is multiplied by factor(), 1 / (1 - p) where it is kept and 0
// where it is dropped. The mask is a pure function of the element's index, so the backward
// regenerates what the forward drew.
struct DropoutMask {
  uint64_t seed = 0, offset = 0;
  uint32_t keep_from = 0;  // a Philox word >= this keeps its element (dropout_keep_from)
  float scale = 1.f;       // 1 / (1 - p)
  int64_t heads = 0, seq_len = 0;

  __device__ __forceinline__ float factor(int64_t b, int64_t h, int64_t row, int64_t key) const {
    const uint64_t u = static_cast<uint64_t>(((b * heads + h) * seq_len + row) * seq_len + key);
    const Philox4 r = philox4x32_10(seed, offset + u / 4);
    const uint32_t w = (u & 2) ? ((u & 1) ? r.v[3] : r.v[2]) : ((u & 1) ? r.v[1] : r.v[0]);
    return w >= keep_from ? scale : 0.f;
  }
  // factor() of (row, key) and (row, key + 1): one Philox block where both words lie in it.
  __device__ __forceinline__ float2 factors(int64_t b, int64_t h, int64_t row, int64_t key) const {
    const uint64_t u = static_cast<uint64_t>(((b * heads + h) * seq_len + row) * seq_len + key);
    const Philox4 r = philox4x32_10(seed, offset + u / 4);
    uint32_t w0, w1;
    if (u & 1) {
      w0 = (u & 2) ? r.v[3] : r.v[1];
      w1 = (u & 2) ? philox4x32_10(seed, offset + u / 4 + 1).v[0] : r.v[2];
    } else {
      w0 = (u & 2) ? r.v[2] : r.v[0];
      w1 = (u & 2) ? r.v[3] : r.v[1];
    }
    return make_float2(w0 >= keep_from ? scale : 0.f, w1 >= keep_from ? scale : 0.f);
  }
};

inline DropoutMask dropout_mask(const DropoutDraw& d, int64_t heads, int64_t seq_len) {
  TESSERA_CHECK(d.p > 0 && d.p < 1, "attention dropout: the probability must lie in (0, 1), got ",
                d.p);
  return {d.seed, d.offset, static_cast<uint32_t>(dropout_keep_from(d.p)),
          static_cast<float>(1.0 / (1.0 - d.p)), heads, seq_len};
}

// Which keys a query row attends to, besides keys past the sequence: causal (key <= row) or all
// of them, and, with kv_lengths, only the real keys of a row padded on the right (key <
// kv_lengths[b]). The default is the plain causal self-attention of flash_attention_forward.
// Every kernel reads keys (and values) only below key_end(): the tiles past it are zero-filled
// on loading and their scores masked, so nothing the padding holds (even NaN) reaches a result.
struct KeyMask {
  bool causal = true;
  const int32_t* kv_lengths = nullptr;  // i32 [B] on the device, or null (no padding)

  // The number of real keys of batch row b: kv_lengths[b] clamped to [0, seq_len], or seq_len.
  __device__ __forceinline__ int64_t key_end(int64_t b, int64_t seq_len) const {
    if (kv_lengths == nullptr) return seq_len;
    const int64_t n = kv_lengths[b];
    return n < 0 ? 0 : n > seq_len ? seq_len : n;
  }
  // How many kTile-key tiles the queries [q0, q_end) attend to: up to their last query under
  // causal, up to key_end either way (0 when the row has no real key).
  __device__ __forceinline__ int key_tiles(int64_t q_end, int64_t key_end) const {
    const int64_t end = causal && q_end < key_end ? q_end : key_end;
    return static_cast<int>((end + kTile - 1) / kTile);
  }
};

// ---- forward on the tensor cores (mma.sync m16n8k16, FlashAttention-2 register layout) ----
// A block of 4 warps takes 64 queries, each warp 16 of them. S = Q K^T for a 64-key tile is
// 8 accumulator fragments per warp; the online softmax runs on those registers (a row lives
// in the 4 threads of a quad), and P is reused as the A operand of O += P V without going
// through memory. K is kept row-major in shared memory and V transposed, so every B operand
// is one 32-bit shared-memory load; rows are padded by 8 elements against bank conflicts.
constexpr int kTcWarps = 4;

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The two values of a pack2 result, as floats.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t packed) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  }
}

// c += a (16x16, row) * b (16x8, col), f32 accumulate.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <class T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Copies a [kTile, D] tile (rows t0.., zeros past T) into shared memory, row-major with pitch
// `pitch` (a multiple of 8 elements, so every row starts on a 16-byte boundary).
template <class T, int D>
__device__ __forceinline__ void load_tile_tc(T* rows, int pitch, const T* src, HeadLayout L,
                                             int64_t b, int64_t h, int64_t t0, int64_t seq_len) {
  for (int c = threadIdx.x; c < kTile * D / kPack; c += blockDim.x) {
    const int r = c / (D / kPack), d0 = (c % (D / kPack)) * kPack;
    const int64_t t = t0 + r;
    Pack8<T> x;
    if (t < seq_len) {
      x = *reinterpret_cast<const Pack8<T>*>(src + L.row(b, h, t) + d0);
    } else {
#pragma unroll
      for (int e = 0; e < kPack; ++e) x.v[e] = from_float<T>(0.f);
    }
    *reinterpret_cast<Pack8<T>*>(rows + r * pitch + d0) = x;
  }
}

// The same tile copied with cp.async (rows past T are zero-filled by a 0-byte source), so
// the copy of the next tile runs while the current one is used. Call cp_async_commit()
// after, and cp_async_wait<n>() + __syncthreads() before reading it.
template <class T, int D>
__device__ __forceinline__ void load_tile_async(T* rows, int pitch, const T* src, HeadLayout L,
                                                int64_t b, int64_t h, int64_t t0, int64_t seq_len) {
  for (int c = threadIdx.x; c < kTile * D / kPack; c += blockDim.x) {
    const int r = c / (D / kPack), d0 = (c % (D / kPack)) * kPack;
    const int64_t t = t0 + r;
    const T* from = src + L.row(b, h, t < seq_len ? t : 0) + d0;
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(rows + r * pitch + d0));
    const int bytes = t < seq_len ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(from), "r"(bytes));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// B operands for two adjacent 8-wide n-blocks (n0, n0 + 8) over 16 k-rows from a row-major
// [k][n] shared tile (V[key][dim], K[key][dim], ...), with one ldmatrix.x4.trans: the
// transpose happens in the load, so no transposed copy of the tile is needed.
// b[0], b[1] feed n-block n0; b[2], b[3] feed n-block n0 + 8.
template <class T>
__device__ __forceinline__ void load_b_trans_x4(uint32_t (&b)[4], const T* tile, int pitch, int k0,
                                                int n0, int lane) {
  const int m = lane / 8;
  const T* p = tile + (k0 + (m & 1) * 8 + lane % 8) * pitch + n0 + (m >> 1) * 8;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(addr));
}

// The A operand (16 rows from row0, k-step kk) of a row-major [rows][dim] tile in shared memory.
template <class T>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const T* tile, int pitch, int row0,
                                            int kk, int g, int tq) {
  const T* p = tile + (row0 + g) * pitch + kk * 16 + tq * 2;
  a[0] = load_pair(p);
  a[1] = load_pair(p + 8 * pitch);
  a[2] = load_pair(p + 8);
  a[3] = load_pair(p + 8 * pitch + 8);
}

// ---- the Hopper forward (attention_sm90.cu: wgmma + TMA, warp-specialised) ----
// Empty when the sm_90 kernel can run these checked inputs, otherwise why it cannot (not an
// sm_90 device or no sm_90a code in this build, a head size other than 64/128, a scale that is
// not positive, views TMA cannot describe, sizes past the kernel's index range).
std::string sm90_forward_unsupported(const Tensor& q, const Tensor& k, const Tensor& v,
                                     double scale);
// Launches it and returns true, or returns false (with the reason in *why_not when given) and
// launches nothing.
bool launch_sm90_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                         const Tensor& out, const Tensor& lse, const AttnShape& s,
                         cudaStream_t stream, std::string* why_not);

// ---- the Hopper backward (attention_sm90_backward.cu: wgmma + TMA dkv and dq kernels) ----
// Empty when the sm_90 kernels can run these checked inputs, otherwise why they cannot (not an
// sm_90 device or no sm_90a code in this build, a head size other than 64/128, views TMA cannot
// describe, sizes past the kernels' index range).
std::string sm90_backward_unsupported(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& dout);
// Launches both kernels (delta: f32 [B, H, T], sum_d dO O per query) and returns true, or returns
// false (with the reason in *why_not when given) and launches nothing. With bias_partials (f32
// [B ceil(T / 128), 3 H D], H = Hkv) they also write the column sums of dq | dk | dv over each
// 128 rows of every batch entry there (sm90_bias_partial_rows).
bool launch_sm90_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                          const Tensor& lse, const Tensor& delta, double scale, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& bias_partials,
                          const AttnShape& s, cudaStream_t stream, std::string* why_not);
constexpr int64_t kSm90BackwardRows = 128;  // rows (keys or queries) of one backward block
inline int64_t sm90_bias_partial_rows(const AttnShape& s) {
  return s.B * ((s.T + kSm90BackwardRows - 1) / kSm90BackwardRows);
}

template <class Fn>
void visit_attention(DType t, int64_t D, Fn&& fn) {
  auto with_d = [&](auto tag) {
    using T = decltype(tag);
    if (D == 64) fn(T{}, std::integral_constant<int, 64>{});
    else fn(T{}, std::integral_constant<int, 128>{});
  };
  if (t == DType::bf16) with_d(BFloat16{});
  else with_d(Half{});
}


}  // namespace tessera::cuda::attention_detail
