// The embedding's weight gradient without atomics: out[r] (+)= the sum of the dy rows whose
// index is r, deterministic and bitwise repeatable.
//
//  1. keys: each position's index (an out-of-range one becomes the sentinel `rows`, which sorts
//     last and is skipped; the first bad position is recorded for the host's error message).
//  2. a stable radix sort of (index, position) pairs: positions of one row end up side by side,
//     in position order. Only the bits needed for `rows` are sorted.
//  3. the sorted array is cut into tiles of kTile positions and each run of one row inside a
//     tile is a chunk, summed by one warp (lanes across the columns, 16-byte loads where
//     aligned) in position order in f32. A row whose positions fit in one tile is written to
//     out right there; a longer row (a frequent token) leaves one partial sum per tile, so its
//     work spreads over many warps instead of one long serial loop.
//  4. a warp per long row adds its partials in tile order and writes the row.
// No host synchronisation while a CUDA graph is captured, and all scratch memory comes from
// the caching allocator, so the whole sequence can be recorded and replayed.
#include <cub/cub.cuh>

#include "tessera/core/dispatch.h"
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

constexpr int64_t kTile = 32;  // sorted positions per tile: the longest chunk a warp sums
constexpr int kWarpsPerBlock = 8;

__global__ void embedding_keys_kernel(const void* idx, DType it, int64_t n, int64_t rows,
                                      uint32_t* keys, int32_t* positions,
                                      unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = load_as<int64_t>(idx, it, i);
    const bool ok = id >= 0 && id < rows;
    keys[i] = static_cast<uint32_t>(ok ? id : rows);
    positions[i] = static_cast<int32_t>(i);
    if (!ok) atomicMin(first_bad, static_cast<unsigned long long>(i));
  }
}

// V consecutive columns per lane: 8 (one Pack8 per row) when every row is 16-byte aligned and C
// is a multiple of 8, otherwise 1.
template <int V, class O, class A>
__device__ __forceinline__ void write_row(O* dst, const A (&sum)[V], bool accumulate) {
  if constexpr (V == kPack) {
    Pack8<O> v;
    if (accumulate) v = load_pack(dst, 0);
#pragma unroll
    for (int j = 0; j < V; ++j)
      v.v[j] = from_acc<O>(accumulate ? A(to_acc<A>(v.v[j]) + sum[j]) : sum[j]);
    store_pack(dst, 0, v);
  } else {
    dst[0] = from_acc<O>(accumulate ? A(to_acc<A>(dst[0]) + sum[0]) : sum[0]);
  }
}

// A dy element in the compute type; times `scale` and rounded to out's dtype when `scaled`.
template <class O, class A, class T>
__device__ __forceinline__ A load_acc(T v, bool scaled, A scale) {
  return scaled ? to_acc<A>(from_acc<O>(A(to_acc<A>(v) * scale))) : to_acc<A>(v);
}

// acc += this lane's V columns of one dy row, each through load_acc.
template <int V, class O, class T, class A>
__device__ __forceinline__ void add_row(A (&acc)[V], const T* row, bool scaled, A scale) {
  if constexpr (V == kPack) {
    const Pack8<T> v = load_pack(row, 0);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += load_acc<O>(v.v[j], scaled, scale);
  } else {
    acc[0] += load_acc<O>(row[0], scaled, scale);
  }
}

// One warp per sorted position k; the warps at the start of a chunk (a new row, or a tile's
// first position) sum it. partials: 2 slots of C per tile, slot 2t for the chunk continuing a
// row from tile t - 1, slot 2t + 1 for the chunk that starts a row in tile t and runs on.
template <int V, class T, class O, class A>
__global__ void embedding_backward_chunks_kernel(const T* dy, int64_t dy_row_stride,
                                                 const uint32_t* keys, const int32_t* positions,
                                                 int64_t n, int64_t rows, int64_t C,
                                                 bool accumulate, bool scaled, A scale, O* out,
                                                 A* partials) {
  const int64_t k = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (k >= n) return;
  const uint32_t key = keys[k];
  const bool row_start = k == 0 || keys[k - 1] != key;
  if ((!row_start && k % kTile != 0) || key >= rows) return;
  const int64_t tile = k / kTile, tile_end = (tile + 1) * kTile < n ? (tile + 1) * kTile : n;
  int64_t end = k + 1;
  while (end < tile_end && keys[end] == key) ++end;
  const bool runs_on = end == tile_end && end < n && keys[end] == key;
  A* partial = !row_start ? partials + 2 * tile * C
               : runs_on  ? partials + (2 * tile + 1) * C
                          : nullptr;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    A acc[V] = {};
    int64_t p = k;
    // Four rows' loads in flight before their adds, which stay in position order.
    for (; p + 4 <= end; p += 4) {
      const T* r0 = dy + positions[p] * dy_row_stride + c;
      const T* r1 = dy + positions[p + 1] * dy_row_stride + c;
      const T* r2 = dy + positions[p + 2] * dy_row_stride + c;
      const T* r3 = dy + positions[p + 3] * dy_row_stride + c;
      if constexpr (V == kPack) {
        const Pack8<T> v0 = load_pack(r0, 0), v1 = load_pack(r1, 0), v2 = load_pack(r2, 0),
                       v3 = load_pack(r3, 0);
#pragma unroll
        for (int j = 0; j < V; ++j)
          acc[j] = acc[j] + load_acc<O>(v0.v[j], scaled, scale) +
                   load_acc<O>(v1.v[j], scaled, scale) + load_acc<O>(v2.v[j], scaled, scale) +
                   load_acc<O>(v3.v[j], scaled, scale);
      } else {
        const T v0 = *r0, v1 = *r1, v2 = *r2, v3 = *r3;
        acc[0] = acc[0] + load_acc<O>(v0, scaled, scale) + load_acc<O>(v1, scaled, scale) +
                 load_acc<O>(v2, scaled, scale) + load_acc<O>(v3, scaled, scale);
      }
    }
    for (; p < end; ++p) add_row<V, O>(acc, dy + positions[p] * dy_row_stride + c, scaled, scale);
    if (partial) {
#pragma unroll
      for (int j = 0; j < V; ++j) partial[c + j] = acc[j];
    } else {
      write_row<V>(out + int64_t(key) * C + c, acc, accumulate);
    }
  }
}

// One warp per tile: when the tile's last row started in it and runs into the next tile, sum
// that row's partials in tile order and write it.
template <int V, class O, class A>
__global__ void embedding_backward_join_kernel(const uint32_t* keys, int64_t n, int64_t rows,
                                               int64_t C, bool accumulate, const A* partials,
                                               O* out) {
  const int64_t tile = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t tiles = (n + kTile - 1) / kTile, first = tile * kTile;
  if (tile >= tiles) return;
  const int64_t last = (first + kTile < n ? first + kTile : n) - 1;
  const uint32_t key = keys[last];
  if (last + 1 >= n || keys[last + 1] != key || key >= rows) return;
  const bool started_here = first == 0 || keys[first] != key || keys[first - 1] != key;
  if (!started_here) return;
  for (int64_t c = lane * V; c < C; c += 32 * V) {
    A sum[V];
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] = partials[(2 * tile + 1) * C + c + j];
    for (int64_t t = tile + 1; t < tiles && keys[t * kTile] == key; ++t) {
#pragma unroll
      for (int j = 0; j < V; ++j) sum[j] += partials[2 * t * C + c + j];
    }
    write_row<V>(out + int64_t(key) * C + c, sum, accumulate);
  }
}

int sort_bits(int64_t rows) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= rows) ++bits;  // the sentinel `rows` must fit
  return bits;
}

// Reports the first out-of-range index (outside a capture, where nothing can be read back;
// there the sentinel keys are skipped). Runs before out is written, so a bad call leaves it.
void check_indices(const Tensor& first_bad, const Tensor& idx, int64_t rows, cudaStream_t stream) {
  if (graph_capture_underway()) return;
  unsigned long long host = 0;
  TESSERA_CUDA_CHECK(
      cudaMemcpyAsync(&host, first_bad.raw_data(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host == ~0ull) return;
  const int64_t position = static_cast<int64_t>(host);
  const int64_t value = raw::narrow(idx, 0, position, 1).to_vector<int64_t>()[0];
  TESSERA_FAIL("embedding_backward: index ", value, " (position ", position,
               ") is out of range for an embedding table of size ", rows);
}

template <class T, class O>
void launch_sums(const Tensor& dy, const Tensor& keys, const Tensor& positions, int64_t n,
                 bool accumulate, double scale, const Tensor& out, cudaStream_t stream) {
  using A =
      std::conditional_t<std::is_same_v<T, double> || std::is_same_v<O, double>, double, float>;
  const int64_t rows = out.size(0), C = out.size(1), tiles = (n + kTile - 1) / kTile;
  Tensor partials =
      empty({2 * tiles * C},
            {.dtype = std::is_same_v<A, double> ? DType::f64 : DType::f32, .device = out.device()});
  const T* dy_data = static_cast<const T*>(dy.raw_data());
  O* out_data = static_cast<O*>(out.raw_data());
  const bool packed = C % kPack == 0 && dy.stride(0) % kPack == 0 && aligned16({dy_data, out_data});
  const int threads = 32 * kWarpsPerBlock;
  auto run = [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    embedding_backward_chunks_kernel<V, T, O, A>
        <<<static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock), threads, 0, stream>>>(
            dy_data, dy.stride(0), static_cast<const uint32_t*>(keys.raw_data()),
            positions.data<int32_t>(), n, rows, C, accumulate, scale != 1.0, static_cast<A>(scale),
            out_data, static_cast<A*>(partials.raw_data()));
    TESSERA_KERNEL_CHECK("embedding_backward_chunks_kernel");
    embedding_backward_join_kernel<V, O, A>
        <<<static_cast<unsigned>((tiles + kWarpsPerBlock - 1) / kWarpsPerBlock), threads, 0,
           stream>>>(static_cast<const uint32_t*>(keys.raw_data()), n, rows, C, accumulate,
                     static_cast<const A*>(partials.raw_data()), out_data);
    TESSERA_KERNEL_CHECK("embedding_backward_join_kernel");
  };
  if (packed)
    run(std::integral_constant<int, kPack>{});
  else
    run(std::integral_constant<int, 1>{});
}

void embedding_backward(const Tensor& dy_in, const Tensor& idx_in, bool accumulate, double scale,
                        const Tensor& out) {
  TESSERA_CHECK(out.is_contiguous() && out.dim() == 2 && dy_in.dim() == 2 &&
                    dy_in.size(1) == out.size(1) && idx_in.numel() == dy_in.size(0),
                "embedding_backward (cuda): out ", shape_str(out.shape()),
                " must be contiguous [rows, C] for dy ", shape_str(dy_in.shape()), " and ",
                idx_in.numel(), " indices");
  const int64_t n = idx_in.numel(), rows = out.size(0), C = out.size(1);
  TESSERA_CHECK(n < (int64_t{1} << 31) && rows < (int64_t{1} << 31),
                "embedding_backward (cuda): ", n, " positions into ", rows,
                " rows exceed the sort's 31-bit keys");
  KernelContext ctx(out);
  if (n == 0 || C == 0) {
    if (!accumulate && out.numel() > 0)
      TESSERA_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), ctx.stream));
    return;
  }
  // Rows read with a stride; elements inside a row must be adjacent.
  const Tensor dy = dy_in.stride(1) == 1 ? dy_in : raw::contiguous(dy_in);
  const Tensor idx = raw::contiguous(idx_in);
  const TensorOptions i32{.dtype = DType::i32, .device = out.device()};
  Tensor keys = empty({n}, i32), positions = empty({n}, i32);  // keys hold uint32 bits
  Tensor sorted_keys = empty({n}, i32), sorted_positions = empty({n}, i32);
  Tensor first_bad = empty({1}, {.dtype = DType::i64, .device = out.device()});
  TESSERA_CUDA_CHECK(cudaMemsetAsync(first_bad.raw_data(), 0xff, sizeof(int64_t), ctx.stream));
  embedding_keys_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
      idx.raw_data(), idx.dtype(), n, rows, static_cast<uint32_t*>(keys.raw_data()),
      positions.data<int32_t>(), static_cast<unsigned long long*>(first_bad.raw_data()));
  TESSERA_KERNEL_CHECK("embedding_keys_kernel");
  check_indices(first_bad, idx, rows, ctx.stream);

  const int bits = sort_bits(rows);
  auto sort = [&](void* scratch, size_t& bytes) {
    TESSERA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        scratch, bytes, static_cast<const uint32_t*>(keys.raw_data()),
        static_cast<uint32_t*>(sorted_keys.raw_data()), positions.data<int32_t>(),
        sorted_positions.data<int32_t>(), static_cast<int>(n), 0, bits, ctx.stream));
  };
  size_t sort_bytes = 0;
  sort(nullptr, sort_bytes);
  Tensor scratch = empty({static_cast<int64_t>(std::max<size_t>(sort_bytes, 1))},
                         {.dtype = DType::u8, .device = out.device()});
  sort(scratch.raw_data(), sort_bytes);
  // Rows no index names are 0 without accumulate; the sums then overwrite the named ones.
  if (!accumulate) TESSERA_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), ctx.stream));
  visit_float(dy.dtype(), "embedding_backward", [&](auto dy_tag) {
    visit_float(out.dtype(), "embedding_backward", [&](auto out_tag) {
      launch_sums<decltype(dy_tag), decltype(out_tag)>(dy, sorted_keys, sorted_positions, n,
                                                       accumulate, scale, out, ctx.stream);
    });
  });
}

const bool registered = [] {
  kernel_table(DeviceType::CUDA).embedding_backward = embedding_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
