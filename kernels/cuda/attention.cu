// Causal self-attention, flash-attention style: queries are processed in tiles of 64, keys
// and values stream through shared memory in tiles of 64, and the softmax is computed
// online (running max and sum), so memory is O(T) per head: only the output and one
// log-sum-exp per query are stored. The backward recomputes the probabilities from the
// saved log-sum-exp: one kernel for dQ (walking keys) and one for dK, dV (walking queries),
// so no atomics are needed and results repeat bitwise.
//
// Four consecutive threads share one query (or key) row, each holding a quarter of the head
// dimensions in registers (dims part, part+4, part+8, ... so that the four read adjacent
// shared-memory words); dot products finish with two shuffles inside the group of four.
// The math runs on the FP32 units; this is the readable flash kernel, not a tensor-core one.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

constexpr int kTile = 64;                 // queries (or keys) per block
constexpr int kGroup = 4;                 // threads per row
constexpr int kAttnThreads = kTile * kGroup;
constexpr int kKeyBatch = 16;             // scores computed before one online-softmax update
constexpr float kLog2e = 1.4426950408889634f;

struct HeadLayout {
  int64_t sb, sh, st;  // strides of [B, H, T, D] in elements (the D stride is 1)
  __device__ __forceinline__ int64_t row(int64_t b, int64_t h, int64_t t) const {
    return b * sb + h * sh + t * st;
  }
};

HeadLayout layout_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

__device__ __forceinline__ float group_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// Loads a [kTile, D] tile (rows t0..t0+63, zeros past T) into shared memory as raw T values.
template <class T, int D>
__device__ void load_tile(T* dst, const T* src, HeadLayout L, int64_t b, int64_t h, int64_t t0,
                          int64_t seq_len) {
  for (int e = threadIdx.x; e < kTile * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    const int64_t t = t0 + r;
    dst[e] = t < seq_len ? src[L.row(b, h, t) + d] : from_float<T>(0.f);
  }
}

template <class T, int D>
__global__ void __launch_bounds__(kAttnThreads)
    flash_forward_kernel(const T* q, const T* k, const T* v, HeadLayout Lq, HeadLayout Lk,
                         HeadLayout Lv, T* out, float* lse, int64_t H, int64_t seq_len,
                         float scale) {
  constexpr int P = D / kGroup;  // dims per thread
  __shared__ T ks[kTile * D], vs[kTile * D];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H;
  const int q_tile = blockIdx.x;
  const int part = threadIdx.x % kGroup;
  const int64_t qi = int64_t(q_tile) * kTile + threadIdx.x / kGroup;
  const bool valid = qi < seq_len;

  float qr[P], acc[P];
  const float qscale = scale * kLog2e;  // scores in log2 units: exp2 is one instruction
#pragma unroll
  for (int i = 0; i < P; ++i) {
    qr[i] = valid ? to_float(q[Lq.row(b, h, qi) + i * kGroup + part]) * qscale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;

  for (int kt = 0; kt <= q_tile; ++kt) {
    __syncthreads();
    load_tile<T, D>(ks, k, Lk, b, h, int64_t(kt) * kTile, seq_len);
    load_tile<T, D>(vs, v, Lv, b, h, int64_t(kt) * kTile, seq_len);
    __syncthreads();
    for (int j0 = 0; j0 < kTile; j0 += kKeyBatch) {
      float s[kKeyBatch];
      float batch_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeyBatch; ++j) {
        const T* kr = ks + (j0 + j) * D;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < P; ++i) dot += qr[i] * to_float(kr[i * kGroup + part]);
        dot = group_sum4(dot);
        const int64_t kj = int64_t(kt) * kTile + j0 + j;
        s[j] = (kj <= qi && kj < seq_len) ? dot : -INFINITY;
        batch_max = fmaxf(batch_max, s[j]);
      }
      const float m_new = fmaxf(m, batch_max);
      if (m_new == -INFINITY) continue;  // every key so far masked (only past T)
      const float corr = exp2f(m - m_new);
      l *= corr;
#pragma unroll
      for (int i = 0; i < P; ++i) acc[i] *= corr;
#pragma unroll
      for (int j = 0; j < kKeyBatch; ++j) {
        const float p = exp2f(s[j] - m_new);
        l += p;
        const T* vr = vs + (j0 + j) * D;
#pragma unroll
        for (int i = 0; i < P; ++i) acc[i] += p * to_float(vr[i * kGroup + part]);
      }
      m = m_new;
    }
  }
  if (!valid) return;
  const float inv = 1.f / l;
  T* orow = out + ((b * H + h) * seq_len + qi) * D;
#pragma unroll
  for (int i = 0; i < P; ++i) orow[i * kGroup + part] = from_float<T>(acc[i] * inv);
  if (part == 0) lse[(b * H + h) * seq_len + qi] = (m + log2f(l)) / kLog2e;
}

// delta_i = sum_d dO[i, d] * O[i, d]: the row term of the softmax backward.
template <class T, int D>
__global__ void attention_delta_kernel(const T* out, const T* dout, HeadLayout Ld, float* delta,
                                       int64_t rows, int64_t H, int64_t seq_len) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (r >= rows) return;
  const int64_t t = r % seq_len, bh = r / seq_len, b = bh / H, h = bh % H;
  float s = 0.f;
  for (int d = threadIdx.x; d < D; d += 32)
    s += to_float(out[r * D + d]) * to_float(dout[Ld.row(b, h, t) + d]);
  s = warp_sum(s);
  if (threadIdx.x == 0) delta[r] = s;
}

// dQ_i = scale * sum_j P_ij (dP_ij - delta_i) K_j, with P_ij = exp(scale q_i.k_j - lse_i).
template <class T, int D>
__global__ void __launch_bounds__(kAttnThreads)
    flash_backward_dq_kernel(const T* q, const T* k, const T* v, const T* dout, HeadLayout Lq,
                             HeadLayout Lk, HeadLayout Lv, HeadLayout Ld, const float* lse,
                             const float* delta, T* dq, int64_t H, int64_t seq_len, float scale) {
  constexpr int P = D / kGroup;
  __shared__ T ks[kTile * D], vs[kTile * D];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H;
  const int q_tile = blockIdx.x;
  const int part = threadIdx.x % kGroup;
  const int64_t qi = int64_t(q_tile) * kTile + threadIdx.x / kGroup;
  const bool valid = qi < seq_len;
  const int64_t stat = (b * H + h) * seq_len + (valid ? qi : 0);
  const float lse2 = valid ? lse[stat] * kLog2e : 0.f, di = valid ? delta[stat] : 0.f;
  const float qscale = scale * kLog2e;
  float qr[P], dor[P], acc[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    qr[i] = valid ? to_float(q[Lq.row(b, h, qi) + i * kGroup + part]) * qscale : 0.f;
    dor[i] = valid ? to_float(dout[Ld.row(b, h, qi) + i * kGroup + part]) : 0.f;
    acc[i] = 0.f;
  }
  for (int kt = 0; kt <= q_tile; ++kt) {
    __syncthreads();
    load_tile<T, D>(ks, k, Lk, b, h, int64_t(kt) * kTile, seq_len);
    load_tile<T, D>(vs, v, Lv, b, h, int64_t(kt) * kTile, seq_len);
    __syncthreads();
    for (int j = 0; j < kTile; ++j) {
      const T* kr = ks + j * D;
      const T* vr = vs + j * D;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        s += qr[i] * to_float(kr[i * kGroup + part]);
        dp += dor[i] * to_float(vr[i * kGroup + part]);
      }
      s = group_sum4(s);
      dp = group_sum4(dp);
      const int64_t kj = int64_t(kt) * kTile + j;
      const float p = (kj <= qi && kj < seq_len && valid) ? exp2f(s - lse2) : 0.f;
      const float ds = p * (dp - di);
#pragma unroll
      for (int i = 0; i < P; ++i) acc[i] += ds * to_float(kr[i * kGroup + part]);
    }
  }
  if (!valid) return;
  T* row = dq + ((b * H + h) * seq_len + qi) * D;
#pragma unroll
  for (int i = 0; i < P; ++i) row[i * kGroup + part] = from_float<T>(acc[i] * scale);
}

// dV_j = sum_i P_ij dO_i;  dK_j = scale * sum_i P_ij (dP_ij - delta_i) q_i, over i >= j.
template <class T, int D>
__global__ void __launch_bounds__(kAttnThreads)
    flash_backward_dkv_kernel(const T* q, const T* k, const T* v, const T* dout, HeadLayout Lq,
                              HeadLayout Lk, HeadLayout Lv, HeadLayout Ld, const float* lse,
                              const float* delta, T* dk, T* dv, int64_t H, int64_t seq_len,
                              float scale) {
  constexpr int P = D / kGroup;
  __shared__ T qs[kTile * D], dos[kTile * D];
  __shared__ float lse_s[kTile], delta_s[kTile];
  const int64_t b = blockIdx.y / H, h = blockIdx.y % H;
  const int k_tile = blockIdx.x;
  const int part = threadIdx.x % kGroup;
  const int64_t kj = int64_t(k_tile) * kTile + threadIdx.x / kGroup;
  const bool valid = kj < seq_len;
  const int num_tiles = static_cast<int>((seq_len + kTile - 1) / kTile);
  const float qscale = scale * kLog2e;
  float kr[P], vr[P], dk_acc[P], dv_acc[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    kr[i] = valid ? to_float(k[Lk.row(b, h, kj) + i * kGroup + part]) * qscale : 0.f;
    vr[i] = valid ? to_float(v[Lv.row(b, h, kj) + i * kGroup + part]) : 0.f;
    dk_acc[i] = 0.f;
    dv_acc[i] = 0.f;
  }
  const int64_t stat0 = (b * H + h) * seq_len;
  for (int qt = k_tile; qt < num_tiles; ++qt) {
    __syncthreads();
    load_tile<T, D>(qs, q, Lq, b, h, int64_t(qt) * kTile, seq_len);
    load_tile<T, D>(dos, dout, Ld, b, h, int64_t(qt) * kTile, seq_len);
    for (int r = threadIdx.x; r < kTile; r += blockDim.x) {
      const int64_t t = int64_t(qt) * kTile + r;
      lse_s[r] = t < seq_len ? lse[stat0 + t] * kLog2e : 0.f;
      delta_s[r] = t < seq_len ? delta[stat0 + t] : 0.f;
    }
    __syncthreads();
    for (int i0 = 0; i0 < kTile; ++i0) {
      const T* qrow = qs + i0 * D;
      const T* drow = dos + i0 * D;
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < P; ++i) {
        s += kr[i] * to_float(qrow[i * kGroup + part]);
        dp += vr[i] * to_float(drow[i * kGroup + part]);
      }
      s = group_sum4(s);
      dp = group_sum4(dp);
      const int64_t qi = int64_t(qt) * kTile + i0;
      const float p = (qi >= kj && qi < seq_len && valid) ? exp2f(s - lse_s[i0]) : 0.f;
      const float ds = p * (dp - delta_s[i0]);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        dv_acc[i] += p * to_float(drow[i * kGroup + part]);
        dk_acc[i] += ds * to_float(qrow[i * kGroup + part]);
      }
    }
  }
  if (!valid) return;
  const int64_t row = ((b * H + h) * seq_len + kj) * D;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    dk[row + i * kGroup + part] = from_float<T>(dk_acc[i] * scale);
    dv[row + i * kGroup + part] = from_float<T>(dv_acc[i]);
  }
}

// ---- the naive reference: scores materialised in global memory ----
template <class T>
__global__ void naive_scores_kernel(const T* q, const T* k, HeadLayout Lq, HeadLayout Lk,
                                    float* scores, int64_t BH, int64_t H, int64_t seq_len,
                                    int64_t D, float scale) {
  const int64_t total = BH * seq_len * seq_len;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % seq_len, i = (e / seq_len) % seq_len, bh = e / (seq_len * seq_len);
    const int64_t b = bh / H, h = bh % H;
    float s = -INFINITY;
    if (j <= i) {
      s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += to_float(q[Lq.row(b, h, i) + d]) * to_float(k[Lk.row(b, h, j) + d]);
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
__global__ void naive_pv_kernel(const float* probs, const T* v, HeadLayout Lv, T* out, int64_t BH,
                                int64_t H, int64_t seq_len, int64_t D) {
  const int64_t total = BH * seq_len * D;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = e % D, i = (e / D) % seq_len, bh = e / (D * seq_len);
    const int64_t b = bh / H, h = bh % H;
    float acc = 0.f;
    for (int64_t j = 0; j <= i; ++j) acc += probs[(bh * seq_len + i) * seq_len + j] * to_float(v[Lv.row(b, h, j) + d]);
    out[e] = from_float<T>(acc);
  }
}

struct AttnShape {
  int64_t B, H, T, D;
};

AttnShape check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                       bool any_head_size) {
  TESSERA_CHECK(q.dim() == 4 && k.shape() == q.shape() && v.shape() == q.shape(), op,
                ": q, k, v must all be [B, H, T, D], got ", shape_str(q.shape()), ", ",
                shape_str(k.shape()), ", ", shape_str(v.shape()));
  TESSERA_CHECK((q.dtype() == DType::bf16 || q.dtype() == DType::f16) && k.dtype() == q.dtype() &&
                    v.dtype() == q.dtype(),
                op, ": q, k, v must be bfloat16 or float16 alike, got ", dtype_name(q.dtype()),
                ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  TESSERA_CHECK(q.device().is_cuda() && k.device() == q.device() && v.device() == q.device(), op,
                ": q, k, v must be on one CUDA device");
  TESSERA_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, op,
                ": the head dimension must be contiguous (stride 1)");
  const int64_t D = q.size(3);
  TESSERA_CHECK(any_head_size || D == 64 || D == 128, op, ": head size must be 64 or 128, got ", D);
  return {q.size(0), q.size(1), q.size(2), D};
}

void check_output(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  TESSERA_CHECK(t.shape() == like.shape() && t.dtype() == like.dtype() && t.is_contiguous() &&
                    t.device() == like.device(),
                op, ": ", name, " must be a contiguous ", shape_str(like.shape()), " ",
                dtype_name(like.dtype()), " tensor on ", like.device().str());
}

void check_lse(const char* op, const Tensor& lse, const AttnShape& s, Device device) {
  TESSERA_CHECK(lse.dtype() == DType::f32 && lse.is_contiguous() && lse.numel() == s.B * s.H * s.T &&
                    lse.device() == device,
                op, ": lse must be a contiguous float32 [B, H, T] = [", s.B, ", ", s.H, ", ", s.T,
                "] tensor on ", device.str());
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

}  // namespace

void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_inputs("flash_attention_forward", q, k, v, false);
  check_output("flash_attention_forward", "out", out, q);
  check_lse("flash_attention_forward", lse, s, q.device());
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  const dim3 grid(static_cast<unsigned>((s.T + kTile - 1) / kTile), static_cast<unsigned>(s.B * s.H));
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    flash_forward_kernel<T, D><<<grid, kAttnThreads, 0, ctx.stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), layout_of(q), layout_of(k), layout_of(v),
        static_cast<T*>(out.raw_data()), lse.data<float>(), s.H, s.T, static_cast<float>(scale));
  });
  TESSERA_KERNEL_CHECK("flash_forward_kernel");
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse,
                              double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const char* op = "flash_attention_backward";
  const AttnShape s = check_inputs(op, q, k, v, false);
  check_output(op, "out", out, q);
  TESSERA_CHECK(dout.shape() == q.shape() && dout.dtype() == q.dtype() && dout.stride(3) == 1 &&
                    dout.device() == q.device(),
                op, ": dout must match q with a contiguous head dimension");
  check_output(op, "dq", dq, q);
  check_output(op, "dk", dk, q);
  check_output(op, "dv", dv, q);
  check_lse(op, lse, s, q.device());
  if (q.numel() == 0) return;
  KernelContext ctx(dq);
  Tensor delta = empty({s.B * s.H * s.T}, {.dtype = DType::f32, .device = q.device()});
  const dim3 grid(static_cast<unsigned>((s.T + kTile - 1) / kTile), static_cast<unsigned>(s.B * s.H));
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    const int64_t rows = s.B * s.H * s.T;
    attention_delta_kernel<T, D><<<static_cast<unsigned>((rows + 7) / 8), dim3(32, 8), 0, ctx.stream>>>(
        static_cast<const T*>(out.raw_data()), static_cast<const T*>(dout.raw_data()),
        layout_of(dout), delta.data<float>(), rows, s.H, s.T);
    TESSERA_KERNEL_CHECK("attention_delta_kernel");
    flash_backward_dq_kernel<T, D><<<grid, kAttnThreads, 0, ctx.stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const T*>(dout.raw_data()), layout_of(q),
        layout_of(k), layout_of(v), layout_of(dout), lse.data<float>(), delta.data<float>(),
        static_cast<T*>(dq.raw_data()), s.H, s.T, static_cast<float>(scale));
    TESSERA_KERNEL_CHECK("flash_backward_dq_kernel");
    flash_backward_dkv_kernel<T, D><<<grid, kAttnThreads, 0, ctx.stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()),
        static_cast<const T*>(v.raw_data()), static_cast<const T*>(dout.raw_data()), layout_of(q),
        layout_of(k), layout_of(v), layout_of(dout), lse.data<float>(), delta.data<float>(),
        static_cast<T*>(dk.raw_data()), static_cast<T*>(dv.raw_data()), s.H, s.T,
        static_cast<float>(scale));
    TESSERA_KERNEL_CHECK("flash_backward_dkv_kernel");
  });
}

void naive_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse) {
  const AttnShape s = check_inputs("naive_attention_forward", q, k, v, true);
  check_output("naive_attention_forward", "out", out, q);
  check_lse("naive_attention_forward", lse, s, q.device());
  if (q.numel() == 0) return;
  KernelContext ctx(out);
  const int64_t BH = s.B * s.H;
  Tensor scores = empty({BH, s.T, s.T}, {.dtype = DType::f32, .device = q.device()});
  auto run = [&](auto tag) {
    using T = decltype(tag);
    naive_scores_kernel<T><<<grid_for(BH * s.T * s.T), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(q.raw_data()), static_cast<const T*>(k.raw_data()), layout_of(q),
        layout_of(k), scores.data<float>(), BH, s.H, s.T, s.D, static_cast<float>(scale));
    naive_softmax_kernel<<<grid_for(BH * s.T), kThreads, 0, ctx.stream>>>(
        scores.data<float>(), lse.data<float>(), BH * s.T, s.T);
    naive_pv_kernel<T><<<grid_for(BH * s.T * s.D), kThreads, 0, ctx.stream>>>(
        scores.data<float>(), static_cast<const T*>(v.raw_data()), layout_of(v),
        static_cast<T*>(out.raw_data()), BH, s.H, s.T, s.D);
  };
  if (q.dtype() == DType::bf16) run(BFloat16{});
  else run(Half{});
  TESSERA_KERNEL_CHECK("naive_attention kernels");
}

}  // namespace tessera::cuda
