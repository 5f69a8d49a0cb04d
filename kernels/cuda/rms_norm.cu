// CUDA kernels of RMSNorm:
//  * forward, optionally with the residual add of a pre-norm block fused in front: one warp
//    per row (sum of squares, then the scaled write); rows of up to 2048 elements stay in
//    registers and move in 16-byte packs.
//  * backward, optionally adding the residual stream's gradient into dx: one warp per row for
//    dx; dweight from per-block (fast path) or per-chunk column partials (f32, written once
//    each) summed in a fixed order by a second kernel over C / 8 blocks, so the result is the
//    same bits on every run.
// Other inputs are made contiguous first; the CPU kernels (kernels/cpu/rms_norm.cpp) are the
// reference (tests/cuda).
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/norm_common.cuh"
#include "tessera/kernels/fused_table.h"

namespace tessera::cuda {
namespace {

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

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.rms_norm = rms_norm;
  t.rms_norm_backward = rms_norm_backward;
  FusedKernelTable& fused = fused_kernel_table(DeviceType::CUDA);
  fused.residual_rms_norm = rms_norm_impl;
  fused.rms_norm_backward_residual = rms_norm_backward_impl;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
