// Softmax / log-softmax (forward and backward) and cross-entropy (loss and
// dlogits), all computed in f32 (f64 for f64 tensors) from one online pass
// for the row statistics: a running max and a running sum of exp(x - max).
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
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

// Online (max, sum-of-exp) pair and its merge.
template <class A>
struct MaxSum {
  A max;
  A sum;
};

template <class A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  if (a.max == A(-INFINITY)) return b;
  if (b.max == A(-INFINITY)) return a;
  const A m = a.max > b.max ? a.max : b.max;
  return {m, a.sum * exp(a.max - m) + b.sum * exp(b.max - m)};
}

template <class A>
__device__ __forceinline__ MaxSum<A> push(MaxSum<A> s, A x) {
  if (x == A(-INFINITY)) return s;  // a masked entry adds nothing (and -inf - -inf is NaN)
  if (x > s.max) {
    const A scale = s.max == A(-INFINITY) ? A(0) : exp(s.max - x);
    return {x, s.sum * scale + A(1)};
  }
  return {s.max, s.sum + exp(x - s.max)};
}

// Merges across the group (blockDim.x threads: a warp, or the whole block when y == 1).
template <class A>
__device__ MaxSum<A> group_merge(MaxSum<A> s) {
  __shared__ A smax[32], ssum[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum<A> other{__shfl_xor_sync(0xffffffffu, s.max, o), __shfl_xor_sync(0xffffffffu, s.sum, o)};
    s = merge(s, other);
  }
  if (blockDim.x == 32) return s;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) {
    smax[warp] = s.max;
    ssum[warp] = s.sum;
  }
  __syncthreads();
  s = {smax[0], ssum[0]};
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) s = merge(s, MaxSum<A>{smax[w], ssum[w]});
  return s;
}

template <class A>
__device__ A group_sum(A v) {
  __shared__ A partial[32];
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = partial[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) v += partial[w];
  return v;
}


struct RowLaunch {
  dim3 block;
  unsigned grid;
};
// Long rows: a block of 512 threads per row. 1024-thread blocks, two per SM (to keep the
// second pass's rows in L2: 132 x 2 x 100 KB for a bf16 50k vocabulary), measured slower on
// an H100: cross-entropy forward + backward at 8192 x 50304 went from 59% to 39% of copy
// bandwidth (32 registers a thread leaves too few loads in flight).
constexpr int kLongRowThreads = 512;
template <class T>
RowLaunch row_launch(int64_t rows, int64_t len) {
  if (len > 1024)
    return {dim3(kLongRowThreads, 1), static_cast<unsigned>(std::min<int64_t>(rows, 1 << 30))};
  return {dim3(32, 8), static_cast<unsigned>(std::min<int64_t>((rows + 7) / 8, 1 << 30))};
}

// The row this thread group works on, or -1.
__device__ __forceinline__ int64_t group_row(int64_t rows) {
  const int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  return r < rows ? r : -1;
}

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

// ---- cross-entropy ----
// Per row: loss_r = log(sum exp(x - max)) + max - x[target]; ignored rows give 0 and count 0.
// loss = sum of the rows' losses and count = rows counted (the front-end divides for Mean).
// A target outside [0, V) that is not ignore_index raises bad_target.
template <class T>
__global__ void __launch_bounds__(kLongRowThreads) cross_entropy_rows_kernel(const T* logits, const void* targets, DType tt,
                                          int64_t rows, int64_t vocab, int64_t ignore_index,
                                          double* row_loss, int* row_counted, int* bad_target,
                                          bool packed) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  const bool ignored = target == ignore_index;
  if (!ignored && (target < 0 || target >= vocab)) {
    if (threadIdx.x == 0) *bad_target = 1;
    return;  // the group leaves together: `target` is the same for all its threads
  }
  if (ignored) {
    if (threadIdx.x == 0) {
      row_loss[r] = 0.0;
      row_counted[r] = 0;
    }
    return;
  }
  const T* xr = logits + r * vocab;
  MaxSum<A> s{A(-INFINITY), A(0)};
  row_read(xr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t, T v) { s = push(s, to_acc<A>(v)); });
  s = group_merge(s);
  if (threadIdx.x == 0) {
    row_loss[r] = static_cast<double>(log(s.sum) + s.max - to_acc<A>(xr[target]));
    row_counted[r] = 1;
  }
}

// One block sums the rows in a fixed order: the loss is the same bits on every run.
__global__ void cross_entropy_finish_kernel(const double* row_loss, const int* row_counted,
                                            int64_t rows, void* loss, DType lt, void* count,
                                            DType ct) {
  double s = 0;
  long long c = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    s += row_loss[r];
    c += row_counted[r];
  }
  s = block_sum(s);
  c = block_sum(c);
  if (threadIdx.x == 0) {
    store_as<double>(loss, lt, 0, s);  // the sum, as the CPU kernel: the front-end divides for Mean
    store_as<double>(count, ct, 0, static_cast<double>(c));
  }
}

// Reads a device error flag back (one small synchronous copy) and raises if it was set.
void check_flag(const int* flag, cudaStream_t stream, const std::string& message) {
  // Inside a CUDA graph capture the flag cannot be read back (core/graph_capture.h).
  if (graph_capture_underway()) return;
  int host = 0;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  TESSERA_CHECK(host == 0, message);
}

void cross_entropy(const Tensor& logits_in, const Tensor& targets_in, int64_t ignore_index,
                   const Tensor& loss, const Tensor& count) {
  TESSERA_CHECK(logits_in.dim() == 2 && targets_in.dim() == 1 &&
                    targets_in.size(0) == logits_in.size(0),
                "cross_entropy (cuda): logits must be [N, V] and targets [N], got ",
                shape_str(logits_in.shape()), " and ", shape_str(targets_in.shape()));
  TESSERA_CHECK(loss.dtype() == DType::f32 || loss.dtype() == DType::f64,
                "cross_entropy (cuda): loss must be float32 or float64");
  KernelContext ctx(loss);
  Tensor logits = raw::contiguous(logits_in), targets = raw::contiguous(targets_in);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  Tensor row_loss = empty({std::max<int64_t>(rows, 1)}, {.dtype = DType::f64, .device = loss.device()});
  Tensor flags = zeros({std::max<int64_t>(rows, 1) + 1}, {.dtype = DType::i32, .device = loss.device()});
  int* row_counted = flags.data<int32_t>();
  int* bad = row_counted + std::max<int64_t>(rows, 1);
  visit_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    RowLaunch l = row_launch<T>(rows, vocab);
    if (rows > 0)
      cross_entropy_rows_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(
          static_cast<const T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), rows,
          vocab, ignore_index, row_loss.data<double>(), row_counted, bad,
          rows_packable(logits.raw_data(), vocab));
  });
  TESSERA_KERNEL_CHECK("cross_entropy_rows_kernel");
  cross_entropy_finish_kernel<<<1, 1024, 0, ctx.stream>>>(row_loss.data<double>(), row_counted,
                                                         rows, loss.raw_data(), loss.dtype(),
                                                         count.raw_data(), count.dtype());
  TESSERA_KERNEL_CHECK("cross_entropy_finish_kernel");
  check_flag(bad, ctx.stream,
             ::tessera::detail::concat("cross_entropy: a target is outside [0, ", vocab,
                            ") and is not ignore_index ", ignore_index));
}

// dlogits = scale * (softmax(x) - onehot(target)); ignored rows get zeros.
template <class T>
__global__ void __launch_bounds__(kLongRowThreads) cross_entropy_backward_kernel(const T* logits, const void* targets, DType tt,
                                              int64_t rows, int64_t vocab, int64_t ignore_index,
                                              float scale, T* dlogits, bool packed) {
  using A = acc_t<T>;
  const int64_t r = group_row(rows);
  if (r < 0) return;
  const int64_t target = load_as<int64_t>(targets, tt, r);
  const T* xr = logits + r * vocab;
  T* dr = dlogits + r * vocab;
  if (target == ignore_index) {
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) dr[i] = from_acc<T>(A(0));
    return;
  }
  MaxSum<A> s{A(-INFINITY), A(0)};
  row_read(xr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t, T v) { s = push(s, to_acc<A>(v)); });
  s = group_merge(s);
  const A inv = A(1) / s.sum;
  row_map_from_end(xr, dr, vocab, threadIdx.x, blockDim.x, packed, [&](int64_t i, T x) {
    const A p = exp(to_acc<A>(x) - s.max) * inv;
    return from_acc<T>(A(scale) * (p - (i == target ? A(1) : A(0))));
  });
}

void cross_entropy_backward(const Tensor& logits_in, const Tensor& targets_in,
                            int64_t ignore_index, double scale, const Tensor& dlogits) {
  TESSERA_CHECK(dlogits.is_contiguous() && dlogits.dtype() == logits_in.dtype() &&
                    logits_in.dim() == 2,
                "cross_entropy_backward (cuda): dlogits must be contiguous [N, V] in the logits' "
                "dtype");
  if (dlogits.numel() == 0) return;
  KernelContext ctx(dlogits);
  Tensor logits = raw::contiguous(logits_in), targets = raw::contiguous(targets_in);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  visit_float(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    RowLaunch l = row_launch<T>(rows, vocab);
    cross_entropy_backward_kernel<T><<<l.grid, l.block, 0, ctx.stream>>>(
        static_cast<const T*>(logits.raw_data()), targets.raw_data(), targets.dtype(), rows,
        vocab, ignore_index, static_cast<float>(scale), static_cast<T*>(dlogits.raw_data()),
        rows_packable(logits.raw_data(), vocab) && aligned16({dlogits.raw_data()}));
  });
  TESSERA_KERNEL_CHECK("cross_entropy_backward_kernel");
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.softmax = softmax;
  t.softmax_backward = softmax_backward;
  t.cross_entropy = cross_entropy;
  t.cross_entropy_backward = cross_entropy_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
