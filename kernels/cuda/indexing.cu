// Embedding lookup and index_add (the embedding's backward).
//
// index_add has two paths: atomics (fast, order of additions varies between runs) and a
// deterministic one used when cuda::deterministic() is on, which groups the source slices
// by destination on the host (one small copy of the indices) and sums each group in index
// order on the device.
#include <algorithm>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

void check_flag(const int* flag, cudaStream_t stream, const std::string& message) {
  int host = 0;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  TESSERA_CHECK(host == 0, message);
}

// ---- embedding: block per looked-up row, threads across the channels ----
template <class Word>
__global__ void embedding_kernel(const Word* weight, const void* idx, DType it, int64_t n,
                                 int64_t rows, int64_t C, Word* out, int* bad) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = load_as<int64_t>(idx, it, i);
    if (id < 0 || id >= rows) {
      if (threadIdx.x == 0) *bad = 1;
      continue;
    }
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[i * C + c] = weight[id * C + c];
  }
}

void embedding(const Tensor& weight_in, const Tensor& idx_in, const Tensor& out) {
  TESSERA_CHECK(weight_in.dim() == 2, "embedding (cuda): weight must be 2-D, got ",
                shape_str(weight_in.shape()));
  TESSERA_CHECK(idx_in.dtype() == DType::i32 || idx_in.dtype() == DType::i64,
                "embedding (cuda): indices must be int32 or int64, got ", dtype_name(idx_in.dtype()));
  TESSERA_CHECK(out.is_contiguous() && out.dtype() == weight_in.dtype() &&
                    out.numel() == idx_in.numel() * weight_in.size(1),
                "embedding (cuda): output must be contiguous ", dtype_name(weight_in.dtype()),
                " with ", idx_in.numel(), " x ", weight_in.size(1), " elements");
  const int64_t n = idx_in.numel(), rows = weight_in.size(0), C = weight_in.size(1);
  if (n == 0 || C == 0) return;
  KernelContext ctx(out);
  Tensor weight = raw::contiguous(weight_in), idx = raw::contiguous(idx_in);
  Tensor flag = zeros({1}, {.dtype = DType::i32, .device = out.device()});
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n, 65535LL * 4));
  const int threads = static_cast<int>(std::min<int64_t>(256, (C + 31) / 32 * 32));
  auto launch = [&](auto word) {
    using W = decltype(word);
    embedding_kernel<W><<<blocks, threads, 0, ctx.stream>>>(
        static_cast<const W*>(weight.raw_data()), idx.raw_data(), idx.dtype(), n, rows, C,
        static_cast<W*>(out.raw_data()), flag.data<int32_t>());
  };
  switch (weight.element_size()) {
    case 1: launch(uint8_t{}); break;
    case 2: launch(uint16_t{}); break;
    case 4: launch(uint32_t{}); break;
    default: launch(uint64_t{}); break;
  }
  TESSERA_KERNEL_CHECK("embedding_kernel");
  check_flag(flag.data<int32_t>(), ctx.stream,
             ::tessera::detail::concat("embedding: an index is outside [0, ", rows,
                                       ") for a weight of shape ", shape_str(weight.shape())));
}

// ---- index_add ----
// out viewed as [pre, out_len, post], src as [pre, n, post] (both contiguous).
__device__ __forceinline__ void atomic_add_as(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: atomicAdd(static_cast<float*>(base) + i, static_cast<float>(v)); break;
    case DType::f64: atomicAdd(static_cast<double*>(base) + i, v); break;
    case DType::f16: atomicAdd(static_cast<__half*>(base) + i, __float2half_rn(static_cast<float>(v))); break;
    case DType::bf16:
      atomicAdd(static_cast<__nv_bfloat16*>(base) + i, __float2bfloat16_rn(static_cast<float>(v)));
      break;
    case DType::i32: atomicAdd(static_cast<int*>(base) + i, static_cast<int>(v)); break;
    case DType::i64:
      atomicAdd(static_cast<unsigned long long*>(base) + i,
                static_cast<unsigned long long>(static_cast<long long>(v)));
      break;
    default: break;  // rejected on the host
  }
}

__global__ void index_add_atomic_kernel(void* out, DType ot, const void* src, DType st,
                                        const void* idx, DType it, int64_t pre, int64_t n,
                                        int64_t post, int64_t out_len, int* bad) {
  const int64_t total = pre * n * post;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = e % post, i = (e / post) % n, a = e / (post * n);
    const int64_t j = load_as<int64_t>(idx, it, i);
    if (j < 0 || j >= out_len) {
      *bad = 1;
      continue;
    }
    atomic_add_as(out, ot, (a * out_len + j) * post + p, load_as<double>(src, st, e));
  }
}

// Deterministic: group g adds, in index order, the source slices listed in
// order[group_start[g] .. group_start[g+1]) into destination slice group_dest[g].
template <class C>
__global__ void index_add_grouped_kernel(void* out, DType ot, const void* src, DType st,
                                         const int64_t* group_start, const int64_t* group_dest,
                                         const int64_t* order, int64_t groups, int64_t pre,
                                         int64_t n, int64_t post, int64_t out_len) {
  const int64_t total = groups * pre * post;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = e % post, a = (e / post) % pre, g = e / (post * pre);
    const int64_t o = (a * out_len + group_dest[g]) * post + p;
    C acc = load_as<C>(out, ot, o);
    for (int64_t k = group_start[g]; k < group_start[g + 1]; ++k)
      acc += load_as<C>(src, st, (a * n + order[k]) * post + p);
    store_as<C>(out, ot, o, acc);
  }
}

void index_add(const Tensor& out_in, int64_t dim, const Tensor& idx_in, const Tensor& src_in) {
  TESSERA_CHECK(idx_in.dtype() == DType::i32 || idx_in.dtype() == DType::i64,
                "index_add (cuda): indices must be int32 or int64, got ", dtype_name(idx_in.dtype()));
  TESSERA_CHECK(out_in.dtype() != DType::u8 && out_in.dtype() != DType::boolean,
                "index_add (cuda): dtype ", dtype_name(out_in.dtype()), " is not supported");
  TESSERA_CHECK(idx_in.dim() <= 1 && src_in.dim() == out_in.dim() &&
                    src_in.size(dim) == idx_in.numel(),
                "index_add (cuda): src ", shape_str(src_in.shape()), " must match out ",
                shape_str(out_in.shape()), " except along dim ", dim, " which has the ",
                idx_in.numel(), " indices");
  const int64_t n = idx_in.numel();
  if (n == 0 || src_in.numel() == 0) return;
  KernelContext ctx(out_in);
  Tensor out = raw::contiguous(out_in);  // a temporary when out is a strided view
  Tensor src = raw::contiguous(src_in), idx = raw::contiguous(idx_in);
  int64_t pre = 1, post = 1;
  for (int64_t d = 0; d < dim; ++d) pre *= out.size(d);
  for (int64_t d = dim + 1; d < out.dim(); ++d) post *= out.size(d);
  const int64_t out_len = out.size(dim);
  const std::string bad_msg = ::tessera::detail::concat(
      "index_add: an index is outside [0, ", out_len, ") (dim ", dim, " of out ",
      shape_str(out.shape()), ")");

  if (!deterministic()) {
    Tensor flag = zeros({1}, {.dtype = DType::i32, .device = out.device()});
    index_add_atomic_kernel<<<grid_for(pre * n * post), kThreads, 0, ctx.stream>>>(
        out.raw_data(), out.dtype(), src.raw_data(), src.dtype(), idx.raw_data(), idx.dtype(), pre,
        n, post, out_len, flag.data<int32_t>());
    TESSERA_KERNEL_CHECK("index_add_atomic_kernel");
    check_flag(flag.data<int32_t>(), ctx.stream, bad_msg);
  } else {
    // Group source positions by destination on the host, keeping index order inside a group.
    std::vector<int64_t> ids = idx.to_vector<int64_t>();
    for (int64_t j : ids) TESSERA_CHECK(j >= 0 && j < out_len, bad_msg, ": got ", j);
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return ids[x] < ids[y]; });
    std::vector<int64_t> starts, dests;
    for (int64_t k = 0; k < n; ++k) {
      if (k == 0 || ids[order[k]] != ids[order[k - 1]]) {
        starts.push_back(k);
        dests.push_back(ids[order[k]]);
      }
    }
    starts.push_back(n);
    const int64_t groups = static_cast<int64_t>(dests.size());
    std::vector<int64_t> packed;
    packed.reserve(starts.size() + dests.size() + order.size());
    packed.insert(packed.end(), starts.begin(), starts.end());
    packed.insert(packed.end(), dests.begin(), dests.end());
    packed.insert(packed.end(), order.begin(), order.end());
    Tensor table = from_vector(packed, {static_cast<int64_t>(packed.size())},
                               {.dtype = DType::i64, .device = out.device()});
    const int64_t* t = table.data<int64_t>();
    visit_compute(compute_kind({out.dtype(), src.dtype()}), [&](auto tag) {
      using C = decltype(tag);
      index_add_grouped_kernel<C><<<grid_for(groups * pre * post), kThreads, 0, ctx.stream>>>(
          out.raw_data(), out.dtype(), src.raw_data(), src.dtype(), t, t + starts.size(),
          t + starts.size() + dests.size(), groups, pre, n, post, out_len);
    });
    TESSERA_KERNEL_CHECK("index_add_grouped_kernel");
  }
  if (!out.is_same(out_in)) raw::copy_(out_in, out);
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.embedding = embedding;
  t.index_add = index_add;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
