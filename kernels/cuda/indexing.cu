// Embedding lookup and index_add (the embedding's backward).
//
// index_add has two paths: atomics (fast, order of additions varies between runs) and a
// deterministic one used when cuda::deterministic() is on, which groups the source slices
// by destination on the host (one small copy of the indices) and sums each group in index
// order on the device.
#include <algorithm>

#include <cub/cub.cuh>

#include "tessera/core/dispatch.h"
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/device_flag.cuh"

namespace tessera::cuda {
namespace {

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
// With groups_on_device set, the number of groups is read from there (the tables were built
// on the device; `groups` is then an upper bound for the grid) and a destination outside
// [0, out_len) is skipped (nothing can report it inside a CUDA graph).
template <class C>
__global__ void index_add_grouped_kernel(void* out, DType ot, const void* src, DType st,
                                         const int64_t* group_start, const int64_t* group_dest,
                                         const int64_t* order, int64_t groups, int64_t pre,
                                         int64_t n, int64_t post, int64_t out_len,
                                         const int64_t* groups_on_device = nullptr) {
  if (groups_on_device) groups = *groups_on_device;
  const int64_t total = groups * pre * post;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = e % post, a = (e / post) % pre, g = e / (post * pre);
    if (groups_on_device && (group_dest[g] < 0 || group_dest[g] >= out_len)) continue;
    const int64_t o = (a * out_len + group_dest[g]) * post + p;
    C acc = load_as<C>(out, ot, o);
    for (int64_t k = group_start[g]; k < group_start[g + 1]; ++k)
      acc += load_as<C>(src, st, (a * n + order[k]) * post + p);
    store_as<C>(out, ot, o, acc);
  }
}

// ---- the deterministic grouping built on the device (no host read: CUDA graphs) ----
__global__ void keys_and_positions_kernel(const void* idx, DType it, int64_t n, int64_t* keys,
                                          int64_t* positions) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    keys[i] = load_as<int64_t>(idx, it, i);
    positions[i] = i;
  }
}

__global__ void group_starts_kernel(const int64_t* sorted_keys, int64_t n, int32_t* is_start) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x)
    is_start[k] = k == 0 || sorted_keys[k] != sorted_keys[k - 1];
}

// group_start (groups + 1 entries, the last = n) and group_dest from the inclusive scan of
// is_start; *groups = the number of groups.
__global__ void group_tables_kernel(const int64_t* sorted_keys, const int32_t* is_start,
                                    const int32_t* group_number, int64_t n, int64_t* group_start,
                                    int64_t* group_dest, int64_t* groups) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = group_number[k] - 1;
    if (is_start[k]) {
      group_start[g] = k;
      group_dest[g] = sorted_keys[k];
    }
    if (k == n - 1) {
      group_start[g + 1] = n;
      *groups = g + 1;
    }
  }
}

// The tables of the host's deterministic path (positions stably sorted by index, the start
// and destination of each run of equal indices), computed on the device: a stable radix sort
// keeps index order inside a group, so the sums are the host path's bit for bit.
void index_add_grouped_on_device(const Tensor& out, const Tensor& idx, const Tensor& src,
                                 int64_t pre, int64_t n, int64_t post, int64_t out_len,
                                 cudaStream_t stream) {
  const TensorOptions i64{.dtype = DType::i64, .device = out.device()};
  const TensorOptions i32{.dtype = DType::i32, .device = out.device()};
  Tensor keys = empty({n}, i64), positions = empty({n}, i64);
  Tensor sorted_keys = empty({n}, i64), order = empty({n}, i64);
  Tensor is_start = empty({n}, i32), group_number = empty({n}, i32);
  Tensor group_start = empty({n + 1}, i64), group_dest = empty({n}, i64), groups = empty({1}, i64);
  keys_and_positions_kernel<<<grid_for(n), kThreads, 0, stream>>>(
      idx.raw_data(), idx.dtype(), n, keys.data<int64_t>(), positions.data<int64_t>());
  TESSERA_KERNEL_CHECK("keys_and_positions_kernel");
  size_t sort_bytes = 0, scan_bytes = 0;
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, keys.data<int64_t>(), sorted_keys.data<int64_t>(),
      positions.data<int64_t>(), order.data<int64_t>(), static_cast<int>(n), 0, 64, stream));
  TESSERA_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, is_start.data<int32_t>(),
                                                   group_number.data<int32_t>(),
                                                   static_cast<int>(n), stream));
  Tensor scratch = empty({static_cast<int64_t>(std::max(sort_bytes, scan_bytes))},
                         {.dtype = DType::u8, .device = out.device()});
  TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      scratch.raw_data(), sort_bytes, keys.data<int64_t>(), sorted_keys.data<int64_t>(),
      positions.data<int64_t>(), order.data<int64_t>(), static_cast<int>(n), 0, 64, stream));
  group_starts_kernel<<<grid_for(n), kThreads, 0, stream>>>(sorted_keys.data<int64_t>(), n,
                                                            is_start.data<int32_t>());
  TESSERA_KERNEL_CHECK("group_starts_kernel");
  TESSERA_CUDA_CHECK(cub::DeviceScan::InclusiveSum(scratch.raw_data(), scan_bytes,
                                                   is_start.data<int32_t>(),
                                                   group_number.data<int32_t>(),
                                                   static_cast<int>(n), stream));
  group_tables_kernel<<<grid_for(n), kThreads, 0, stream>>>(
      sorted_keys.data<int64_t>(), is_start.data<int32_t>(), group_number.data<int32_t>(), n,
      group_start.data<int64_t>(), group_dest.data<int64_t>(), groups.data<int64_t>());
  TESSERA_KERNEL_CHECK("group_tables_kernel");
  const int64_t max_groups = std::min(n, out_len);
  visit_compute(compute_kind({out.dtype(), src.dtype()}), [&](auto tag) {
    using C = decltype(tag);
    index_add_grouped_kernel<C><<<grid_for(max_groups * pre * post), kThreads, 0, stream>>>(
        out.raw_data(), out.dtype(), src.raw_data(), src.dtype(), group_start.data<int64_t>(),
        group_dest.data<int64_t>(), order.data<int64_t>(), max_groups, pre, n, post, out_len,
        groups.data<int64_t>());
  });
  TESSERA_KERNEL_CHECK("index_add_grouped_kernel");
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
  } else if (graph_capture_underway()) {
    // A CUDA graph cannot read the indices on the host: the same tables, built on the device.
    TESSERA_CHECK(n < (int64_t{1} << 31), "index_add (cuda): ", n,
                  " indices are too many for the device-side grouping");
    index_add_grouped_on_device(out, idx, src, pre, n, post, out_len, ctx.stream);
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
