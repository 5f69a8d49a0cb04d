// CUDA kernels of the scans and selections along one dim:
//  * cumsum: one thread per lane, walking it in order (f64 accumulation for float types).
//  * topk: one block per lane, k rounds of a block-wide arg-max over the entries not taken
//    yet (O(k n) per lane: meant for the small k of sampling).
// Other inputs are made contiguous first; the CPU kernels (kernels/cpu/scan_select.cpp) are
// the reference (tests/cuda).
#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

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
  t.cumsum = cumsum;
  t.topk = topk;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
