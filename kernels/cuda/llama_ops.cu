// CUDA kernels of the Llama-style layers and of the scan/selection ops:
//  * RMSNorm forward, optionally with the residual add of a pre-norm block fused in front:
//    one warp per row (sum of squares, then the scaled write); rows of up to 2048 elements
//    stay in registers and move in 16-byte packs.
//  * RMSNorm backward, optionally adding the residual stream's gradient into dx: one warp per
//    row for dx; dweight from per-block (fast path) or per-chunk column partials (f32,
//    written once each) summed in a fixed order by a second kernel over C / 8 blocks, so the
//    result is the same bits on every run.
//  * RoPE: one thread per 8 rotated pairs (16-byte packs), or per pair for odd layouts; the
//    input is read through its strides, so no layout copy runs first.
//  * cumsum: one thread per lane, walking it in order (f64 accumulation for float types).
//  * topk: one block per lane, k rounds of a block-wide arg-max over the entries not taken
//    yet (O(k n) per lane: meant for the small k of sampling).
// Other inputs are made contiguous first; the CPU kernels are the reference (tests/cuda).
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/core/fused_dispatch.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/norm_common.cuh"

namespace tessera::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each

template <class T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// Element strides of the rotary input [B, T, H, D].
struct RopeStrides {
  int64_t b, t, h, d;
};

// ---- RMSNorm ----
// With a residual (the fused add of a pre-norm block): residual_out = x + residual, rounded to
// the dtype, and that stored sum is what gets normalised. The backward's dresidual (the
// gradient reaching the sum from the residual stream) is added into dx in the same pass.

// General kernels (any length, f64): one warp per row.
template <class T, class S>
__global__ void rms_norm_kernel(const T* x, const T* residual, T* residual_out, const T* w,
                                float eps, T* out, S* rstd_out, int64_t rows, int64_t C) {
  using A = acc_t<T>;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const T* xr = x + r * C;
  A sq = 0;
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    T xi = xr[i];
    if (residual) {
      xi = from_acc<T>(to_acc<A>(xi) + to_acc<A>(residual[r * C + i]));
      residual_out[r * C + i] = xi;
    }
    const A v = to_acc<A>(xi);
    sq += v * v;
  }
  const A rstd = A(1) / sqrt(warp_sum(sq) / A(C) + A(eps));
  // Each lane re-reads only the sums it wrote itself.
  const T* sr = residual ? residual_out + r * C : xr;
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    A y = to_acc<A>(sr[i]) * rstd;
    if (w) y *= to_acc<A>(w[i]);
    out[r * C + i] = from_acc<T>(y);
  }
  if (threadIdx.x == 0) rstd_out[r] = static_cast<S>(rstd);
}

// dx = rstd * (g - x * rstd^2 * mean(g * x)) (+ dresidual), g = dy * w.
template <class T, class S>
__global__ void rms_norm_dx_kernel(const T* dy, const T* x, const T* w, const S* rstd,
                                   const T* dresidual, T* dx, int64_t rows, int64_t C) {
  using A = acc_t<T>;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const T* xr = x + r * C;
  const T* gr = dy + r * C;
  const A rs = static_cast<A>(rstd[r]);
  A sum_gx = 0;
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    const A g = to_acc<A>(gr[i]) * (w ? to_acc<A>(w[i]) : A(1));
    sum_gx += g * to_acc<A>(xr[i]);
  }
  const A k = rs * rs * warp_sum(sum_gx) / A(C);
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    const A g = to_acc<A>(gr[i]) * (w ? to_acc<A>(w[i]) : A(1));
    A d = rs * (g - to_acc<A>(xr[i]) * k);
    if (dresidual) d += to_acc<A>(dresidual[r * C + i]);
    dx[r * C + i] = from_acc<T>(d);
  }
}

// partial[chunk, c] = sum over the chunk's rows of dy * x * rstd (column c).
template <class T, class S>
__global__ void rms_norm_dw_partial_kernel(const T* dy, const T* x, const S* rstd, int64_t rows,
                                           int64_t C, int64_t rows_per_chunk, acc_t<T>* partial) {
  using A = acc_t<T>;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  A acc = 0;
  for (int64_t r = r0; r < r1; ++r)
    acc += to_acc<A>(dy[r * C + c]) * to_acc<A>(x[r * C + c]) * static_cast<A>(rstd[r]);
  partial[blockIdx.y * C + c] = acc;
}

// Fast kernels (f32/f16/bf16, C a multiple of 8 up to 32 * 8 * kPacks, 16-byte aligned rows):
// the row lives in registers, lane l of the warp holding 8-element packs l, l + 32, ..., so
// every operand is read from global memory once, in 16-byte accesses.
template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    rms_norm_regs_kernel(const T* x, const T* residual, T* residual_out, const T* w, float eps,
                         T* out, float* rstd_out, int64_t rows, int64_t C) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x;
  const int64_t packs = C / kPack;
  float v[kPacks][kPack];
  float sq = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    Pack8<T> a = load_pack(x + r * C, p);
    if (residual) {
      const Pack8<T> b = load_pack(residual + r * C, p);
#pragma unroll
      for (int j = 0; j < kPack; ++j) a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
      store_pack(residual_out + r * C, p, a);
    }
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      v[k][j] = to_float(a.v[j]);
      sq += v[k][j] * v[k][j];
    }
  }
  const float rstd = 1.f / sqrtf(warp_sum(sq) / float(C) + eps);
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = lane + 32 * k;
    if (p >= packs) continue;
    Pack8<T> wp, o;
    if (w) wp = load_pack(w, p);
#pragma unroll
    for (int j = 0; j < kPack; ++j)
      o.v[j] = from_float<T>(v[k][j] * rstd * (w ? to_float(wp.v[j]) : 1.f));
    store_pack(out + r * C, p, o);
  }
  if (lane == 0) rstd_out[r] = rstd;
}

// dx (+ dresidual) for the rows of this block's warps (grid-stride, persistent), and the
// block's dweight partial row [C] in part_dw (null: dx only), its warps added in warp order.
template <class T, int kPacks, int kWarps>
__global__ void __launch_bounds__(32 * kWarps)
    rms_norm_backward_regs_kernel(const T* dy, const T* x, const T* w, const float* rstd,
                                  const T* dresidual, T* dx, int64_t rows, int64_t C,
                                  float* part_dw) {
  extern __shared__ float block_dw[];  // [C]
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t packs = C / kPack;
  float dw[kPacks][kPack];
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
#pragma unroll
    for (int j = 0; j < kPack; ++j) dw[k][j] = 0.f;
  const int64_t warps_total = int64_t(gridDim.x) * kWarps;
  for (int64_t r = blockIdx.x * int64_t(kWarps) + warp; r < rows; r += warps_total) {
    Pack8<T> dyp[kPacks], xp[kPacks];
    const float rs = rstd[r];
    float sum_gx = 0;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      dyp[k] = load_pack(dy + r * C, p);
      xp[k] = load_pack(x + r * C, p);
      Pack8<T> wp;
      if (w) wp = load_pack(w, p);
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float d = to_float(dyp[k].v[j]), xv = to_float(xp[k].v[j]);
        sum_gx += d * (w ? to_float(wp.v[j]) : 1.f) * xv;
        dw[k][j] += d * xv * rs;
      }
    }
    const float scale = rs * rs * warp_sum(sum_gx) / float(C);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = lane + 32 * k;
      if (p >= packs) continue;
      Pack8<T> wp, res, o;
      if (w) wp = load_pack(w, p);
      if (dresidual) res = load_pack(dresidual + r * C, p);
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const float g = to_float(dyp[k].v[j]) * (w ? to_float(wp.v[j]) : 1.f);
        float d = rs * (g - to_float(xp[k].v[j]) * scale);
        if (dresidual) d += to_float(res.v[j]);
        o.v[j] = from_float<T>(d);
      }
      store_pack(dx + r * C, p, o);
    }
  }
  if (part_dw == nullptr) return;  // uniform over the grid
  add_warp_partials_in_order<kWarps>(block_dw, dw, packs, warp, lane);
  for (int64_t c = warp * 32 + lane; c < C; c += 32 * kWarps)
    part_dw[blockIdx.x * C + c] = block_dw[c];
}

constexpr int kMaxRmsForwardPacks = 8, kMaxRmsBackwardPacks = 4;

// Residual (and residual_out) may be undefined: plain RMSNorm.
void rms_norm_impl(const Tensor& x_in, const Tensor& residual_in, const Tensor& residual_out,
                   const Tensor& w_in, double eps, const Tensor& out, const Tensor& rstd) {
  TESSERA_CHECK(out.is_contiguous() && rstd.is_contiguous() &&
                    (!residual_out.defined() || residual_out.is_contiguous()),
                "rms_norm (cuda): out, rstd and the residual sum must be contiguous");
  KernelContext ctx(out);
  const Tensor x = raw::contiguous(x_in), w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  const Tensor residual = residual_in.defined() ? raw::contiguous(residual_in) : Tensor();
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const bool packed =
      rows_packable(x.raw_data(), C) && aligned16({out.raw_data()}) &&
      (!w.defined() || aligned16({w.raw_data()})) &&
      (!residual.defined() || aligned16({residual.raw_data(), residual_out.raw_data()}));
  visit_float(x.dtype(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;  // f32 statistics, f64 for f64 (the table's contract)
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* rp = ptr_or_null<T>(residual);
    T* rop = residual_out.defined() ? static_cast<T*>(residual_out.raw_data()) : nullptr;
    if constexpr (!std::is_same_v<T, double>) {
      if (packed && with_row_packs<kMaxRmsForwardPacks>(C, [&](auto packs) {
            rms_norm_regs_kernel<T, decltype(packs)::value>
                <<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
                    xp, rp, rop, ptr_or_null<T>(w), static_cast<float>(eps),
                    static_cast<T*>(out.raw_data()), rstd.data<float>(), rows, C);
          })) {
        TESSERA_KERNEL_CHECK("rms_norm_regs_kernel");
        return;
      }
    }
    rms_norm_kernel<T, S><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        xp, rp, rop, ptr_or_null<T>(w), static_cast<float>(eps), static_cast<T*>(out.raw_data()),
        static_cast<S*>(rstd.raw_data()), rows, C);
    TESSERA_KERNEL_CHECK("rms_norm_kernel");
  });
}

void rms_norm(const Tensor& x, const Tensor& w, double eps, const Tensor& out, const Tensor& rstd) {
  rms_norm_impl(x, Tensor(), Tensor(), w, eps, out, rstd);
}

// The fast backward: dx and the blocks' dweight partials in one persistent kernel. False when
// the rows do not suit it (then the general kernels run).
template <class T>
bool rms_norm_backward_fast(const KernelContext& ctx, const Tensor& dy, const Tensor& x,
                            const Tensor& w, const Tensor& rstd, const Tensor& dres,
                            const Tensor& dx, const Tensor& dw, int64_t rows, int64_t C) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    const bool packed = rows_packable(dy.raw_data(), C) &&
                        aligned16({x.raw_data(), dx.raw_data()}) &&
                        (!w.defined() || aligned16({w.raw_data()})) &&
                        (!dres.defined() || aligned16({dres.raw_data()}));
    return packed && with_row_packs<kMaxRmsBackwardPacks>(C, [&](auto packs) {
             constexpr int kPacks = decltype(packs)::value, kWarps = kPacks >= 4 ? 4 : 8;
             auto kernel = rms_norm_backward_regs_kernel<T, kPacks, kWarps>;
             const size_t smem = dw.defined() ? C * sizeof(float) : 0;
             const int64_t blocks = persistent_norm_blocks(kernel, kWarps, smem, rows);
             Tensor part = dw.defined()
                               ? empty({blocks, C}, {.dtype = DType::f32, .device = dx.device()})
                               : Tensor();
             float* part_dw = dw.defined() ? part.data<float>() : nullptr;
             kernel<<<static_cast<unsigned>(blocks), dim3(32, kWarps), smem, ctx.stream>>>(
                 static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
                 ptr_or_null<T>(w), rstd.data<float>(), ptr_or_null<T>(dres),
                 static_cast<T*>(dx.raw_data()), rows, C, part_dw);
             TESSERA_KERNEL_CHECK("rms_norm_backward_regs_kernel");
             if (!part_dw) return;
             add_column_partials<T>(ctx.stream, /*accumulate=*/true, part_dw, nullptr, blocks, C,
                                    static_cast<T*>(dw.raw_data()), nullptr);
           });
  }
}

// dresidual may be undefined (plain RMSNorm backward).
void rms_norm_backward_impl(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                            const Tensor& rstd_in, const Tensor& dres_in, const Tensor& dx,
                            const Tensor& dw) {
  TESSERA_CHECK(dx.is_contiguous() && (!dw.defined() || dw.is_contiguous()),
                "rms_norm_backward (cuda): dx and dweight must be contiguous");
  KernelContext ctx(dx);
  const Tensor dy = raw::contiguous(dy_in), x = raw::contiguous(x_in),
               rstd = raw::contiguous(rstd_in);
  const Tensor w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  const Tensor dres = dres_in.defined() ? raw::contiguous(dres_in) : Tensor();
  const int64_t C = x.size(-1), rows = x.numel() / C;
  visit_float(x.dtype(), "rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;
    using A = acc_t<T>;
    if (rms_norm_backward_fast<T>(ctx, dy, x, w, rstd, dres, dx, dw, rows, C)) return;
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_norm_dx_kernel<T, S><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
        ptr_or_null<T>(w), static_cast<const S*>(rstd.raw_data()), ptr_or_null<T>(dres),
        static_cast<T*>(dx.raw_data()), rows, C);
    TESSERA_KERNEL_CHECK("rms_norm_dx_kernel");
    if (!dw.defined()) return;
    const NormChunks chunks = norm_chunks(rows, C);
    Tensor partial = empty({chunks.count, C}, {.dtype = DTypeOf<A>::value, .device = dx.device()});
    rms_norm_dw_partial_kernel<T, S>
        <<<dim3(static_cast<unsigned>(chunks.col_blocks), static_cast<unsigned>(chunks.count)),
           kThreads, 0, ctx.stream>>>(static_cast<const T*>(dy.raw_data()),
                                      static_cast<const T*>(x.raw_data()),
                                      static_cast<const S*>(rstd.raw_data()), rows, C,
                                      chunks.rows_per_chunk, partial.data<A>());
    TESSERA_KERNEL_CHECK("rms_norm_dw_partial_kernel");
    add_column_partials<T>(ctx.stream, /*accumulate=*/true, partial.data<A>(), nullptr,
                           chunks.count, C, static_cast<T*>(dw.raw_data()), nullptr);
  });
}

void rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                       const Tensor& dx, const Tensor& dw) {
  rms_norm_backward_impl(dy, x, w, rstd, Tensor(), dx, dw);
}

// ---- RoPE ----
// x [B, T, H, D] read and out written through their strides. Pair (i, i + D/2) of a head:
//   out[i] = x[i] cos - x[i + D/2] sin,  out[i + D/2] = x[i + D/2] cos + x[i] sin.

// The readable version: one thread per rotated pair, any strides.
template <class T, class S>
__global__ void rope_kernel(const T* x, const S* cos, const S* sin, float sign, T* out, int64_t B,
                            int64_t Tn, int64_t H, int64_t D, RopeStrides xs, RopeStrides os) {
  using A = acc_t<T>;
  const int64_t half = D / 2, pairs = B * Tn * H * half;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half, row = p / half;  // row = (b * Tn + t) * H + h
    const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
    const T* in = x + b * xs.b + t * xs.t + h * xs.h;
    T* o = out + b * os.b + t * os.t + h * os.h;
    const A c = static_cast<A>(cos[t * half + i]), s = A(sign) * static_cast<A>(sin[t * half + i]);
    const A x1 = to_acc<A>(in[i * xs.d]), x2 = to_acc<A>(in[(i + half) * xs.d]);
    o[i * os.d] = from_acc<T>(x1 * c - x2 * s);
    o[(i + half) * os.d] = from_acc<T>(x2 * c + x1 * s);
  }
}

// The bandwidth-bound version (f32/f16/bf16, D/2 a multiple of 8, 16-byte aligned rows): one
// thread per 8 pairs, moving 16-byte packs of x, out and the f32 tables.
template <class T>
__global__ void rope_packed_kernel(const T* x, const float* cos, const float* sin, float sign,
                                   T* out, int64_t rows, int64_t Tn, int64_t H, int64_t D,
                                   RopeStrides xs, RopeStrides os) {
  const int64_t half = D / 2, row_packs = half / kPack, total = rows * row_packs;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = p % row_packs, row = p / row_packs;
    const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
    const T* in = x + b * xs.b + t * xs.t + h * xs.h;
    T* o = out + b * os.b + t * os.t + h * os.h;
    const Pack8<T> a = load_pack(in, j), bpk = load_pack(in + half, j);
    const Pack8<float> c = load_pack(cos + t * half, j), s = load_pack(sin + t * half, j);
    Pack8<T> lo, hi;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float x1 = to_float(a.v[k]), x2 = to_float(bpk.v[k]), sk = sign * s.v[k];
      lo.v[k] = from_float<T>(x1 * c.v[k] - x2 * sk);
      hi.v[k] = from_float<T>(x2 * c.v[k] + x1 * sk);
    }
    store_pack(o, j, lo);
    store_pack(o + half, j, hi);
  }
}

RopeStrides rope_strides(const Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// 16-byte packs along the head dim: unit stride, every head row on a 16-byte boundary.
bool rope_rows_packable(const RopeStrides& s) {
  return s.d == 1 && s.b % kPack == 0 && s.t % kPack == 0 && s.h % kPack == 0;
}

void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const Tensor& out) {
  KernelContext ctx(out);
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const RopeStrides xs = rope_strides(x), os = rope_strides(out);
  const bool packed = x.dtype() != DType::f64 && half % kPack == 0 && rope_rows_packable(xs) &&
                      rope_rows_packable(os) &&
                      aligned16({x.raw_data(), out.raw_data(), cos.raw_data(), sin.raw_data()});
  const float sign = inverse ? -1.f : 1.f;
  visit_float(x.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    T* op = static_cast<T*>(out.raw_data());
    if constexpr (!std::is_same_v<T, double>) {
      if (packed) {
        rope_packed_kernel<T><<<grid_for(B * Tn * H * (half / kPack)), kThreads, 0, ctx.stream>>>(
            xp, cos.data<float>(), sin.data<float>(), sign, op, B * Tn * H, Tn, H, D, xs, os);
        TESSERA_KERNEL_CHECK("rope_packed_kernel");
        return;
      }
    }
    rope_kernel<T, S><<<grid_for(B * Tn * H * half), kThreads, 0, ctx.stream>>>(
        xp, static_cast<const S*>(cos.raw_data()), static_cast<const S*>(sin.raw_data()), sign, op,
        B, Tn, H, D, xs, os);
    TESSERA_KERNEL_CHECK("rope_kernel");
  });
}

// ---- cumsum ----

// Lanes of a contiguous tensor viewed as [outer, n, inner]; one thread per (outer, inner).
template <class T, class A>
__global__ void cumsum_kernel(const T* x, T* out, int64_t outer, int64_t n, int64_t inner,
                              bool reverse) {
  const int64_t lanes = outer * inner;
  for (int64_t lane = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; lane < lanes;
       lane += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (lane / inner) * n * inner + lane % inner;
    A acc = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = base + (reverse ? n - 1 - j : j) * inner;
      if constexpr (std::is_same_v<A, double>) {
        acc += static_cast<double>(to_acc<acc_t<T>>(x[at]));
        out[at] = from_acc<T>(static_cast<acc_t<T>>(acc));
      } else {
        acc += static_cast<A>(x[at]);
        out[at] = static_cast<T>(acc);
      }
    }
  }
}

void cumsum(const Tensor& x_in, int64_t dim, bool reverse, const Tensor& out_in) {
  KernelContext ctx(out_in);
  const Tensor x = raw::contiguous(x_in);
  const Tensor out =
      out_in.is_contiguous()
          ? out_in
          : empty(out_in.shape(), {.dtype = out_in.dtype(), .device = out_in.device()});
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= x.size(d);
  const int64_t n = x.size(dim);
  auto launch = [&](auto tag, auto acc_tag) {
    using T = decltype(tag);
    cumsum_kernel<T, decltype(acc_tag)><<<grid_for(outer * inner), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(x.raw_data()), static_cast<T*>(out.raw_data()), outer, n, inner,
        reverse);
  };
  if (x.dtype() == DType::i64)
    launch(int64_t{}, int64_t{});
  else
    visit_float(x.dtype(), "cumsum", [&](auto tag) { launch(tag, double{}); });
  TESSERA_KERNEL_CHECK("cumsum_kernel");
  if (!out.is_same(out_in)) raw::copy_(out_in, out);
}

// ---- topk ----

// Entry a beats entry b: larger (smaller) value first, NaN as the largest, then lower index.
template <class A>
__device__ __forceinline__ bool topk_beats(A va, int64_t ia, A vb, int64_t ib, bool largest) {
  const bool na = va != va, nb = vb != vb;
  if (ib < 0) return ia >= 0;
  if (ia < 0) return false;
  if (na || nb) return na && nb ? ia < ib : (largest ? na : nb);
  if (va != vb) return largest ? va > vb : va < vb;
  return ia < ib;
}

template <class T>
__global__ void topk_kernel(const T* x, int64_t n, int64_t k, bool largest, unsigned char* taken,
                            T* values, int64_t* indices) {
  using A = acc_t<T>;
  __shared__ A best_v[32];
  __shared__ int64_t best_i[32];
  const T* lane = x + blockIdx.x * n;
  unsigned char* used = taken + blockIdx.x * n;
  const int warp = threadIdx.x / 32, lane_id = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t j = 0; j < k; ++j) {
    A v = 0;
    int64_t idx = -1;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      if (used[i]) continue;
      const A c = to_acc<A>(lane[i]);
      if (topk_beats(c, i, v, idx, largest)) v = c, idx = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const A ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (topk_beats(ov, oi, v, idx, largest)) v = ov, idx = oi;
    }
    if (lane_id == 0) best_v[warp] = v, best_i[warp] = idx;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < warps; ++w)
        if (topk_beats(best_v[w], best_i[w], v, idx, largest)) v = best_v[w], idx = best_i[w];
      values[blockIdx.x * k + j] = lane[idx];
      indices[blockIdx.x * k + j] = idx;
      used[idx] = 1;
    }
    __syncthreads();
  }
}

void topk(const Tensor& x_in, int64_t k, int64_t dim, bool largest, const Tensor& values,
          const Tensor& indices) {
  KernelContext ctx(values);
  // The lanes as contiguous rows: dim moved last.
  const int64_t last = x_in.dim() - 1;
  const Tensor rows = raw::contiguous(raw::transpose(x_in, dim, last));
  const int64_t n = rows.size(last), lanes = rows.numel() / n;
  Shape moved = values.shape();
  std::swap(moved[dim], moved[last]);
  Tensor v = empty(moved, {.dtype = values.dtype(), .device = values.device()});
  Tensor i = empty(moved, {.dtype = DType::i64, .device = values.device()});
  Tensor taken = zeros({lanes, n}, {.dtype = DType::u8, .device = values.device()});
  visit_float(rows.dtype(), "topk", [&](auto tag) {
    using T = decltype(tag);
    topk_kernel<T><<<static_cast<unsigned>(lanes), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(rows.raw_data()), n, k, largest, taken.data<uint8_t>(),
        static_cast<T*>(v.raw_data()), i.data<int64_t>());
  });
  TESSERA_KERNEL_CHECK("topk_kernel");
  raw::copy_(values, raw::transpose(v, dim, last));
  raw::copy_(indices, raw::transpose(i, dim, last));
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.rms_norm = rms_norm;
  t.rms_norm_backward = rms_norm_backward;
  FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  fused.residual_rms_norm = rms_norm_impl;
  fused.rms_norm_backward_residual = rms_norm_backward_impl;
  t.rope = rope;
  t.cumsum = cumsum;
  t.topk = topk;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
