// CUDA kernels of the Llama-style layers and of the scan/selection ops:
//  * RMSNorm forward: one warp per row (sum of squares, then the scaled write).
//  * RMSNorm backward: one warp per row for dx; dweight from per-chunk column partials
//    [chunks, C] (f32, written once each) summed in chunk order by a second kernel, so the
//    result is the same bits on every run.
//  * RoPE: one thread per rotated pair (i, i + D/2).
//  * cumsum: one thread per lane, walking it in order (f64 accumulation for float types).
//  * topk: one block per lane, k rounds of a block-wide arg-max over the entries not taken
//    yet (O(k n) per lane: meant for the small k of sampling).
// Inputs are made contiguous first; the CPU kernels are the reference (tests/cuda).
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each

template <class T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// ---- RMSNorm ----

template <class T, class S>
__global__ void rms_norm_kernel(const T* x, const T* w, float eps, T* out, S* rstd_out,
                                int64_t rows, int64_t C) {
  using A = acc_t<T>;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.y;
  if (r >= rows) return;
  const T* xr = x + r * C;
  A sq = 0;
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    const A v = to_acc<A>(xr[i]);
    sq += v * v;
  }
  const A rstd = A(1) / sqrt(warp_sum(sq) / A(C) + A(eps));
  for (int64_t i = threadIdx.x; i < C; i += 32) {
    A y = to_acc<A>(xr[i]) * rstd;
    if (w) y *= to_acc<A>(w[i]);
    out[r * C + i] = from_acc<T>(y);
  }
  if (threadIdx.x == 0) rstd_out[r] = static_cast<S>(rstd);
}

void rms_norm(const Tensor& x_in, const Tensor& w_in, double eps, const Tensor& out,
              const Tensor& rstd) {
  TESSERA_CHECK(out.is_contiguous() && rstd.is_contiguous(),
                "rms_norm (cuda): out and rstd must be contiguous");
  KernelContext ctx(out);
  const Tensor x = raw::contiguous(x_in), w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  visit_float(x.dtype(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;  // f32 statistics, f64 for f64 (the table's contract)
    rms_norm_kernel<T, S><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        static_cast<const T*>(x.raw_data()), ptr_or_null<T>(w), static_cast<float>(eps),
        static_cast<T*>(out.raw_data()), static_cast<S*>(rstd.raw_data()), rows, C);
  });
  TESSERA_KERNEL_CHECK("rms_norm_kernel");
}

// dx = rstd * (g - x * rstd^2 * mean(g * x)), g = dy * w.
template <class T, class S>
__global__ void rms_norm_dx_kernel(const T* dy, const T* x, const T* w, const S* rstd, T* dx,
                                   int64_t rows, int64_t C) {
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
    dx[r * C + i] = from_acc<T>(rs * (g - to_acc<A>(xr[i]) * k));
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

template <class T>
__global__ void rms_norm_dw_finish_kernel(const acc_t<T>* partial, int64_t chunks, int64_t C,
                                          T* dw) {
  using A = acc_t<T>;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  A acc = to_acc<A>(dw[c]);
  for (int64_t k = 0; k < chunks; ++k) acc += partial[k * C + c];
  dw[c] = from_acc<T>(acc);
}

void rms_norm_backward(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                       const Tensor& rstd_in, const Tensor& dx, const Tensor& dw) {
  TESSERA_CHECK(dx.is_contiguous() && (!dw.defined() || dw.is_contiguous()),
                "rms_norm_backward (cuda): dx and dweight must be contiguous");
  KernelContext ctx(dx);
  const Tensor dy = raw::contiguous(dy_in), x = raw::contiguous(x_in),
               rstd = raw::contiguous(rstd_in);
  const Tensor w = w_in.defined() ? raw::contiguous(w_in) : Tensor();
  const int64_t C = x.size(-1), rows = x.numel() / C;
  visit_float(x.dtype(), "rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;
    using A = acc_t<T>;
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_norm_dx_kernel<T, S><<<blocks, dim3(32, kRowsPerBlock), 0, ctx.stream>>>(
        static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
        ptr_or_null<T>(w), static_cast<const S*>(rstd.raw_data()), static_cast<T*>(dx.raw_data()),
        rows, C);
    TESSERA_KERNEL_CHECK("rms_norm_dx_kernel");
    if (!dw.defined()) return;
    const int64_t col_blocks = (C + kThreads - 1) / kThreads;
    const int64_t want = std::max<int64_t>(1, 4 * multiprocessor_count() / col_blocks);
    const int64_t rows_per_chunk = std::max<int64_t>(32, (rows + want - 1) / want);
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    Tensor partial = empty({chunks, C}, {.dtype = DTypeOf<A>::value, .device = dx.device()});
    rms_norm_dw_partial_kernel<T, S>
        <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)), kThreads, 0,
           ctx.stream>>>(static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
                         static_cast<const S*>(rstd.raw_data()), rows, C, rows_per_chunk,
                         partial.data<A>());
    TESSERA_KERNEL_CHECK("rms_norm_dw_partial_kernel");
    rms_norm_dw_finish_kernel<T><<<static_cast<unsigned>(col_blocks), kThreads, 0, ctx.stream>>>(
        partial.data<A>(), chunks, C, static_cast<T*>(dw.raw_data()));
    TESSERA_KERNEL_CHECK("rms_norm_dw_finish_kernel");
  });
}

// ---- RoPE ----

template <class T, class S>
__global__ void rope_kernel(const T* x, const S* cos, const S* sin, float sign, T* out, int64_t B,
                            int64_t Tn, int64_t H, int64_t D) {
  using A = acc_t<T>;
  const int64_t half = D / 2, pairs = B * Tn * H * half;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half, row = p / half;  // row = (b * Tn + t) * H + h
    const int64_t t = (row / H) % Tn;
    const A c = static_cast<A>(cos[t * half + i]), s = A(sign) * static_cast<A>(sin[t * half + i]);
    const A x1 = to_acc<A>(x[row * D + i]), x2 = to_acc<A>(x[row * D + i + half]);
    out[row * D + i] = from_acc<T>(x1 * c - x2 * s);
    out[row * D + i + half] = from_acc<T>(x2 * c + x1 * s);
  }
}

void rope(const Tensor& x_in, const Tensor& cos, const Tensor& sin, bool inverse,
          const Tensor& out) {
  TESSERA_CHECK(out.is_contiguous(), "rope (cuda): out must be contiguous");
  KernelContext ctx(out);
  const Tensor x = raw::contiguous(x_in);
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), D = x.size(3);
  visit_float(x.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;
    rope_kernel<T, S><<<grid_for(B * Tn * H * (D / 2)), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(x.raw_data()), static_cast<const S*>(cos.raw_data()),
        static_cast<const S*>(sin.raw_data()), inverse ? -1.f : 1.f,
        static_cast<T*>(out.raw_data()), B, Tn, H, D);
  });
  TESSERA_KERNEL_CHECK("rope_kernel");
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
  t.rope = rope;
  t.cumsum = cumsum;
  t.topk = topk;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
