// Softmax / log-softmax (forward and backward), computed in f32 (f64 for f64
// tensors) from one online pass for the row statistics: a running max and a
// running sum of exp(x - max) (kernels/cuda/row_softmax.cuh, which cross_entropy.cu
// shares).
//
// Rows along the last dim are handled by a warp (short rows) or a block of
// 512 threads (long rows, e.g. a 50k vocabulary); softmax over an inner dim
// gives one thread per (outer, inner) column so reads stay coalesced.
// The forward over the last dim has a fast path (f32/f16/bf16, rows of a
// multiple of 8 elements up to 32768, 16-byte aligned): the row is held in
// registers by a group of 32..1024 threads, so it is read from global memory
// once; the statistics are then exact two-pass ones (max, then sum of exp).
#include <cmath>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/row_softmax.cuh"

namespace tessera::cuda {
namespace {

// ---- softmax over the last dim ----
template <class T>
__global__ void __launch_bounds__(kLongRowThreads) softmax_rows_kernel(const T* x, T* out, int64_t rows, int64_t len, bool log_out,
                                    bool packed) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;  // whole groups leave together: rows never split a group
  const T* xr = x + r * len;
  MaxSum<A> s{A(-INFINITY), A(0)};
  row_read(xr, len, threadIdx.x, blockDim.x, packed, [&](int64_t, T v) { s = push(s, to_acc<A>(v)); });
  s = group_merge(s);
  const A log_sum = log(s.sum);
  const A inv_sum = A(1) / s.sum;
  row_map_from_end(xr, out + r * len, len, threadIdx.x, blockDim.x, packed, [&](int64_t, T x) {
    const A v = to_acc<A>(x) - s.max;
    return from_acc<T>(log_out ? v - log_sum : exp(v) * inv_sum);
  });
}


// ---- softmax over the last dim, row held in registers ----
// A group of blockDim.x threads (a warp with 8 rows per block, or 64..1024 threads with one
// row per block) owns a row; thread t holds 8-element packs t, t + group, ... (kPacks at most).
constexpr int kMaxRegisterPacks = 4;

template <class A>
__device__ __forceinline__ A row_group_max(A v) {
  return blockDim.x == 32 ? warp_max(v) : block_max(v);
}
template <class A>
__device__ __forceinline__ A row_group_sum(A v) {
  return blockDim.x == 32 ? warp_sum(v) : block_sum(v);
}

template <class T, int kPacks>
__global__ void __launch_bounds__(1024)
    softmax_rows_regs_kernel(const T* x, T* out, int64_t rows, int64_t len, bool log_out) {
  const int64_t r = group_row(rows);
  if (r < 0) return;  // only when blockDim.x == 32: a block-wide group never has r < 0
  const int tid = threadIdx.x, group = blockDim.x;
  const int64_t packs = len / kPack;
  float v[kPacks][kPack];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = tid + int64_t(group) * k;
    if (p >= packs) continue;
    const Pack8<T> a = load_pack(x + r * len, p);
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      v[k][j] = to_float(a.v[j]);
      m = fmaxf(m, v[k][j]);
    }
  }
  m = row_group_max(m);
  // m is finite unless the row is all -inf (or has +inf / NaN): those give NaN, as the
  // general kernel does.
  float s = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k)
    if (tid + int64_t(group) * k < packs)
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        v[k][j] -= m;
        const float e = exp(v[k][j]);
        s += e;
        if (!log_out) v[k][j] = e;
      }
  s = row_group_sum(s);
  const float log_sum = log(s), inv_sum = 1.f / s;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = tid + int64_t(group) * k;
    if (p >= packs) continue;
    Pack8<T> o;
#pragma unroll
    for (int j = 0; j < kPack; ++j) o.v[j] = from_float<T>(log_out ? v[k][j] - log_sum : v[k][j] * inv_sum);
    store_pack(out + r * len, p, o);
  }
}

// Launches the register kernel when the row fits: the smallest group (32 .. 1024 threads)
// holding the row in at most kMaxRegisterPacks packs per thread. False when it does not fit.
template <class T>
bool launch_softmax_rows_regs(const T* x, T* out, int64_t rows, int64_t len, bool log_out,
                              cudaStream_t stream) {
  const int64_t packs = len / kPack;
  int group = 32;
  while (group < 1024 && int64_t(group) * kMaxRegisterPacks < packs) group *= 2;
  const int64_t per_thread = (packs + group - 1) / group;
  if (per_thread > kMaxRegisterPacks) return false;
  const int rows_per_block = group == 32 ? 8 : 1;
  const dim3 block(group, rows_per_block);
  const unsigned grid = static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block);
  auto launch = [&](auto kernel) { kernel<<<grid, block, 0, stream>>>(x, out, rows, len, log_out); };
  switch (per_thread) {
    case 1: launch(softmax_rows_regs_kernel<T, 1>); break;
    case 2: launch(softmax_rows_regs_kernel<T, 2>); break;
    case 3: launch(softmax_rows_regs_kernel<T, 3>); break;
    default: launch(softmax_rows_regs_kernel<T, 4>); break;
  }
  return true;
}

// ---- softmax over an inner dim: [outer, len, inner], thread per (outer, inner) ----
template <class T>
__global__ void softmax_cols_kernel(const T* x, T* out, int64_t outer, int64_t len, int64_t inner,
                                    bool log_out) {
  using A = acc_t<T>;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < outer * inner;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (c / inner) * len * inner + c % inner;
    MaxSum<A> s{A(-INFINITY), A(0)};
    for (int64_t i = 0; i < len; ++i) s = push(s, to_acc<A>(x[base + i * inner]));
    const A log_sum = log(s.sum);
    for (int64_t i = 0; i < len; ++i) {
      const A v = to_acc<A>(x[base + i * inner]) - s.max;
      out[base + i * inner] = from_acc<T>(log_out ? v - log_sum : exp(v) / s.sum);
    }
  }
}

// [outer, len, inner] view of a contiguous tensor around `dim`.
struct DimSplit {
  int64_t outer = 1, len = 1, inner = 1;
};
DimSplit split_at(const Shape& s, int64_t dim) {
  DimSplit d;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i) {
    if (i < dim) d.outer *= s[i];
    else if (i == dim) d.len = s[i];
    else d.inner *= s[i];
  }
  return d;
}

void softmax(const Tensor& x_in, int64_t dim, bool log_out, const Tensor& out) {
  if (out.numel() == 0) return;
  TESSERA_CHECK(out.is_contiguous() && out.dtype() == x_in.dtype(),
                "softmax (cuda): output must be contiguous with the input's dtype");
  KernelContext ctx(out);
  Tensor x = raw::contiguous(x_in);
  const DimSplit d = split_at(x.shape(), dim);
  visit_float(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.raw_data());
    T* op = static_cast<T*>(out.raw_data());
    if (d.inner == 1) {
      if constexpr (!std::is_same_v<T, double>) {
        if (rows_packable(xp, d.len) && aligned16({op}) && d.outer <= (int64_t{1} << 30) &&
            launch_softmax_rows_regs(xp, op, d.outer, d.len, log_out, ctx.stream))
          return;
      }
      RowLaunch l = row_launch<T>(d.outer, d.len);
      softmax_rows_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(
          xp, op, d.outer, d.len, log_out, rows_packable(xp, d.len) && aligned16({op}));
    } else {
      softmax_cols_kernel<T><<<grid_for(d.outer * d.inner), kThreads, 0, ctx.stream>>>(
          xp, op, d.outer, d.len, d.inner, log_out);
    }
  });
  TESSERA_KERNEL_CHECK("softmax_kernel");
}

// ---- softmax backward: dx = y * (dy - sum(dy * y)); log: dx = dy - exp(y) * sum(dy) ----
template <class T>
__device__ __forceinline__ acc_t<T> backward_term(T y, T dy, bool log_out) {
  using A = acc_t<T>;
  return log_out ? to_acc<A>(dy) : to_acc<A>(dy) * to_acc<A>(y);
}
template <class T>
__device__ __forceinline__ T backward_value(T y, T dy, acc_t<T> s, bool log_out) {
  using A = acc_t<T>;
  const A yv = to_acc<A>(y), dyv = to_acc<A>(dy);
  return from_acc<T>(log_out ? dyv - exp(yv) * s : yv * (dyv - s));
}

template <class T>
__global__ void __launch_bounds__(kLongRowThreads) softmax_backward_rows_kernel(const T* y, const T* dy, T* dx, int64_t rows,
                                             int64_t len, bool log_out) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;
  const int64_t base = r * len;
  A s = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
    s += backward_term(y[base + i], dy[base + i], log_out);
  s = group_sum(s);
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
    dx[base + i] = backward_value(y[base + i], dy[base + i], s, log_out);
}

template <class T>
__global__ void softmax_backward_cols_kernel(const T* y, const T* dy, T* dx, int64_t outer,
                                             int64_t len, int64_t inner, bool log_out) {
  using A = acc_t<T>;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < outer * inner;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (c / inner) * len * inner + c % inner;
    A s = 0;
    for (int64_t i = 0; i < len; ++i)
      s += backward_term(y[base + i * inner], dy[base + i * inner], log_out);
    for (int64_t i = 0; i < len; ++i)
      dx[base + i * inner] = backward_value(y[base + i * inner], dy[base + i * inner], s, log_out);
  }
}

void softmax_backward(const Tensor& y_in, const Tensor& dy_in, int64_t dim, bool log_out,
                      const Tensor& dx) {
  if (dx.numel() == 0) return;
  TESSERA_CHECK(dx.is_contiguous() && y_in.dtype() == dx.dtype() && dy_in.dtype() == dx.dtype(),
                "softmax_backward (cuda): y, dy, dx must share a dtype and dx be contiguous");
  KernelContext ctx(dx);
  Tensor y = raw::contiguous(y_in), dy = raw::contiguous(dy_in);
  const DimSplit d = split_at(y.shape(), dim);
  visit_float(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = static_cast<const T*>(y.raw_data());
    const T* dyp = static_cast<const T*>(dy.raw_data());
    T* dxp = static_cast<T*>(dx.raw_data());
    if (d.inner == 1) {
      RowLaunch l = row_launch<T>(d.outer, d.len);
      softmax_backward_rows_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(yp, dyp, dxp, d.outer,
                                                                           d.len, log_out);
    } else {
      softmax_backward_cols_kernel<T><<<grid_for(d.outer * d.inner), kThreads, 0, ctx.stream>>>(
          yp, dyp, dxp, d.outer, d.len, d.inner, log_out);
    }
  });
  TESSERA_KERNEL_CHECK("softmax_backward_kernel");
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.softmax = softmax;
  t.softmax_backward = softmax_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
