// Reductions over arbitrary dims (sum, mean, max, min, prod) and argmax/argmin.
//
// The input's dims are split into kept dims (which index the outputs) and
// reduced dims. Three launch shapes share one set of combine rules:
// - column: the kept dims form one stride-1 block (the bias gradient, sum of
//   [rows, N] over rows). Threads run along columns, so a warp reads one row
//   segment (coalesced, 16-byte packs where aligned); blocks split the rows into
//   chunks whose partials a second kernel combines.
// - split: few outputs with many elements each (a full sum). Several blocks per
//   output write partials; a second kernel combines them.
// - generic: a warp (or a 512-thread block) per output, any layout.
// Every order of combination is fixed by the shapes alone (partials are added in
// chunk order, never with atomics), so results repeat bitwise from run to run.
#include <cmath>
#include <type_traits>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

// Index arithmetic for "output o, reduced element r" -> input offset.
struct ReduceLayout {
  StridedIter<1> kept;     // over the kept dims (output order), strides of x
  StridedIter<1> reduced;  // over the reduced dims, strides of x
  int64_t num_outputs;
  int64_t reduce_size;
};

ReduceLayout make_reduce_layout(const Tensor& x, const std::vector<bool>& is_reduced) {
  Shape kept_shape, kept_strides, red_shape, red_strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (is_reduced[d]) {
      red_shape.push_back(x.size(d));
      red_strides.push_back(x.stride(d));
    } else {
      kept_shape.push_back(x.size(d));
      kept_strides.push_back(x.stride(d));
    }
  }
  ReduceLayout L;
  L.kept = make_iter<1>(kept_shape, {&kept_strides});
  L.reduced = make_iter<1>(red_shape, {&red_strides});
  L.num_outputs = shape_numel(kept_shape);
  L.reduce_size = shape_numel(red_shape);
  return L;
}

// Group geometry: blockDim.x threads per output, blockDim.y outputs per block.
struct GroupShape {
  dim3 block;
  unsigned grid;
};

GroupShape group_shape(int64_t num_outputs, int64_t reduce_size) {
  const bool wide = reduce_size >= 4096 && num_outputs < 4LL * multiprocessor_count();
  if (wide) return {dim3(512, 1), static_cast<unsigned>(std::min<int64_t>(num_outputs, 65535))};
  const int64_t blocks = (num_outputs + 7) / 8;
  return {dim3(32, 8), static_cast<unsigned>(std::min<int64_t>(blocks, 65535))};
}

// Reduces v across the threads of one group (a warp, or the x-extent of the block).
template <class A, class Combine>
__device__ A group_reduce(A v, Combine combine, A* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (blockDim.x == 32) return v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) v = combine(v, scratch[w]);
  return v;
}

template <class A>
__device__ __forceinline__ A combine_op(ReduceOp op, A a, A b) {
  switch (op) {
    case ReduceOp::Sum: case ReduceOp::Mean: return a + b;
    case ReduceOp::Prod: return a * b;
    case ReduceOp::Max: return (a != a || a > b) ? a : b;  // NaN wins
    case ReduceOp::Min: return (a != a || a < b) ? a : b;
  }
  return a;
}

template <class A>
__device__ __forceinline__ A identity_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::Prod: return A(1);
    case ReduceOp::Max: return A(-INFINITY);
    case ReduceOp::Min: return A(INFINITY);
    default: return A(0);
  }
}

template <class A>
__global__ void reduce_kernel(ReduceOp op, const void* x, DType xt, void* out, DType ot,
                              ReduceLayout L) {
  __shared__ A scratch[32];
  auto combine = [op](A a, A b) { return combine_op<A>(op, a, b); };
  for (int64_t o = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; o < L.num_outputs;
       o += int64_t(gridDim.x) * blockDim.y) {
    int64_t base[1];
    L.kept.offsets(o, base);
    A acc = identity_of<A>(op);
    for (int64_t r = threadIdx.x; r < L.reduce_size; r += blockDim.x) {
      int64_t off[1];
      L.reduced.offsets(r, off);
      acc = combine(acc, load_as<A>(x, xt, base[0] + off[0]));
    }
    acc = group_reduce<A>(acc, combine, scratch);
    if (threadIdx.x == 0) {
      if (op == ReduceOp::Mean) acc /= static_cast<A>(L.reduce_size);
      store_as<A>(out, ot, o, acc);
    }
  }
}

// ---- typed input access for the column and split paths ----
// Float inputs are read with their own type (packs possible); any other dtype goes through
// the run-time dtype switch. AnyDType stands for "dtype known only at run time".
struct AnyDType {};

template <class T, class A>
__device__ __forceinline__ A load_elem(const void* x, DType xt, int64_t i) {
  if constexpr (std::is_same_v<T, AnyDType>) return load_as<A>(x, xt, i);
  else return to_acc<A>(static_cast<const T*>(x)[i]);
}

// Offset of reduced element r; the common one-dim case needs no division.
__device__ __forceinline__ int64_t reduced_offset(const StridedIter<1>& it, int64_t r) {
  if (it.ndim == 1) return r * it.strides[0][0];
  int64_t off[1];
  it.offsets(r, off);
  return off[0];
}

// The value written for output o: Mean divides by the count of reduced elements.
template <class A>
__device__ __forceinline__ void store_result(ReduceOp op, A acc, int64_t reduce_size, void* out,
                                             DType ot, int64_t o) {
  if (op == ReduceOp::Mean) acc /= static_cast<A>(reduce_size);
  store_as<A>(out, ot, o, acc);
}

// ---- column path: out[c] = combine over rows r of x[row_offset(r) + c], c < K ----
constexpr int kColLanes = 32;  // threads along columns (each owns V adjacent columns)
constexpr int kColRows = 8;    // threads along rows within a block

struct ColumnArgs {
  StridedIter<1> rows;  // the reduced dims (offsets of row starts)
  int64_t K;            // columns (outputs), stride 1
  int64_t R;            // rows (elements reduced per output)
  int64_t rows_per_chunk;
};

// Block (kColLanes, kColRows) over a tile of kColLanes * V columns and one chunk of rows.
// One chunk: writes the results; several: writes partial[chunk * K + c] for the finish kernel.
template <class T, class A, int V>
__global__ void __launch_bounds__(kColLanes * kColRows)
    column_reduce_kernel(ReduceOp op, const void* x, DType xt, ColumnArgs args, A* partial,
                         void* out, DType ot) {
  __shared__ A tile[kColRows][kColLanes * V];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tile_start = blockIdx.x * int64_t(kColLanes * V);
  const int64_t c0 = tile_start + tx * V;
  const int64_t r0 = blockIdx.y * args.rows_per_chunk;
  const int64_t r1 = min(args.R, r0 + args.rows_per_chunk);
  A acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = identity_of<A>(op);
  if (c0 < args.K) {
    // Unrolled so that several rows' loads are in flight before their combines.
#pragma unroll 4
    for (int64_t r = r0 + ty; r < r1; r += kColRows) {
      const int64_t at = reduced_offset(args.rows, r) + c0;
      if constexpr (V == kPack) {
        const Pack8<T> p = load_pack(static_cast<const T*>(x), at / kPack);
#pragma unroll
        for (int k = 0; k < kPack; ++k) acc[k] = combine_op<A>(op, acc[k], to_acc<A>(p.v[k]));
      } else {
        acc[0] = combine_op<A>(op, acc[0], load_elem<T, A>(x, xt, at));
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) tile[ty][tx * V + k] = acc[k];
  __syncthreads();
  // Slot s of the tile is column tile_start + s; rows of the block combine in order 0..7.
  for (int s = ty * kColLanes + tx; s < kColLanes * V; s += kColLanes * kColRows) {
    const int64_t c = tile_start + s;
    if (c >= args.K) break;
    A v = tile[0][s];
    for (int y = 1; y < kColRows; ++y) v = combine_op<A>(op, v, tile[y][s]);
    if (gridDim.y == 1) store_result<A>(op, v, args.R, out, ot, c);
    else partial[blockIdx.y * args.K + c] = v;
  }
}

// out[c] = combine over chunks k = 0..chunks-1 (fixed order) of partial[k * K + c].
// Block (8 columns, 32 chunk lanes): 32-byte column segments, enough blocks to fill the GPU.
constexpr int kFinishCols = 8, kFinishLanes = 32;

template <class A>
__global__ void __launch_bounds__(kFinishCols * kFinishLanes)
    column_finish_kernel(ReduceOp op, const A* partial, int64_t chunks, int64_t K,
                         int64_t reduce_size, void* out, DType ot) {
  __shared__ A lanes[kFinishLanes][kFinishCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * int64_t(kFinishCols) + tx;
  A v = identity_of<A>(op);
  if (c < K)
    for (int64_t k = ty; k < chunks; k += kFinishLanes) v = combine_op<A>(op, v, partial[k * K + c]);
  lanes[ty][tx] = v;
  __syncthreads();
  if (ty == 0 && c < K) {
    for (int y = 1; y < kFinishLanes; ++y) v = combine_op<A>(op, v, lanes[y][tx]);
    store_result<A>(op, v, reduce_size, out, ot, c);
  }
}

// ---- split path: blocks (split s, output o) each combine one range of o's elements ----
constexpr int kSplitThreads = 256;

struct SplitArgs {
  ReduceLayout L;
  int64_t per_split;  // elements per split (a multiple of kPack)
  bool reduced_dense;  // the reduced dims are one stride-1 run
  bool packed;         // ... and every output's run starts 16-byte aligned (typed floats only)
};

template <class T, class A>
__global__ void __launch_bounds__(kSplitThreads)
    split_reduce_kernel(ReduceOp op, const void* x, DType xt, SplitArgs args, A* partial,
                        void* out, DType ot) {
  __shared__ A scratch[32];
  const int64_t o = blockIdx.y, s = blockIdx.x;
  int64_t base[1];
  args.L.kept.offsets(o, base);
  const int64_t r0 = s * args.per_split;
  const int64_t r1 = min(args.L.reduce_size, r0 + args.per_split);
  A acc = identity_of<A>(op);
  auto combine = [op](A a, A b) { return combine_op<A>(op, a, b); };
  if constexpr (!std::is_same_v<T, AnyDType>) {
    if (args.packed) {
      const T* run = static_cast<const T*>(x) + base[0];
      const int64_t p1 = r1 / kPack;
#pragma unroll 4
      for (int64_t p = r0 / kPack + threadIdx.x; p < p1; p += kSplitThreads) {
        const Pack8<T> v = load_pack(run, p);
#pragma unroll
        for (int k = 0; k < kPack; ++k) acc = combine(acc, to_acc<A>(v.v[k]));
      }
      for (int64_t r = p1 * kPack + threadIdx.x; r < r1; r += kSplitThreads)
        acc = combine(acc, to_acc<A>(run[r]));
    }
  }
  if (!args.packed) {
    for (int64_t r = r0 + threadIdx.x; r < r1; r += kSplitThreads) {
      const int64_t at = base[0] + (args.reduced_dense ? r : reduced_offset(args.L.reduced, r));
      acc = combine(acc, load_elem<T, A>(x, xt, at));
    }
  }
  acc = group_reduce<A>(acc, combine, scratch);
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) store_result<A>(op, acc, args.L.reduce_size, out, ot, o);
  else partial[o * gridDim.x + s] = acc;
}

// One warp per output combines its splits: lane-strided, then a fixed shuffle tree.
template <class A>
__global__ void split_finish_kernel(ReduceOp op, const A* partial, int64_t splits,
                                    int64_t num_outputs, int64_t reduce_size, void* out, DType ot) {
  const int64_t o = blockIdx.x * int64_t(blockDim.y) + threadIdx.y;
  if (o >= num_outputs) return;
  A v = identity_of<A>(op);
  for (int64_t s = threadIdx.x; s < splits; s += 32) v = combine_op<A>(op, v, partial[o * splits + s]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = combine_op<A>(op, v, __shfl_xor_sync(0xffffffffu, v, d));
  if (threadIdx.x == 0) store_result<A>(op, v, reduce_size, out, ot, o);
}

// Calls fn(T{}, A{}): the input's element type (AnyDType for non-float dtypes) and the
// accumulation type (f32 for f32/f16/bf16, double for f64 and integers).
template <class Fn>
void visit_reduce_types(DType t, Fn&& fn) {
  switch (t) {
    case DType::f32: fn(float{}, float{}); return;
    case DType::f16: fn(Half{}, float{}); return;
    case DType::bf16: fn(BFloat16{}, float{}); return;
    case DType::f64: fn(double{}, double{}); return;
    default: fn(AnyDType{}, double{}); return;
  }
}

// The reduced dims' row offsets are all multiples of kPack (pack loads stay aligned).
bool rows_pack_aligned(const StridedIter<1>& rows) {
  for (int d = 0; d < rows.ndim; ++d)
    if (rows.strides[0][d] % kPack != 0) return false;
  return true;
}

void column_reduce(ReduceOp op, const Tensor& x, const ReduceLayout& L, const Tensor& out,
                   cudaStream_t stream) {
  ColumnArgs args{L.reduced, L.num_outputs, L.reduce_size, 0};
  visit_reduce_types(x.dtype(), [&](auto ttag, auto atag) {
    using T = decltype(ttag);
    using A = decltype(atag);
    const bool packed = !std::is_same_v<T, AnyDType> && args.K % kPack == 0 &&
                        aligned16({x.raw_data()}) && rows_pack_aligned(L.reduced);
    const int V = packed ? kPack : 1;
    const int64_t col_tiles = (args.K + kColLanes * V - 1) / (kColLanes * V);
    // Aim for ~8 blocks per SM, each thread-row walking at least 8 rows of its chunk.
    const int64_t want_chunks = std::max<int64_t>(1, 8 * multiprocessor_count() / col_tiles);
    args.rows_per_chunk =
        std::max<int64_t>(8 * kColRows, (args.R + want_chunks - 1) / want_chunks);
    const int64_t chunks = std::min<int64_t>((args.R + args.rows_per_chunk - 1) / args.rows_per_chunk, 65535);
    args.rows_per_chunk = (args.R + chunks - 1) / chunks;
    Tensor partial;
    A* partial_ptr = nullptr;
    if (chunks > 1) {
      partial = empty({chunks, args.K},
                      {.dtype = std::is_same_v<A, double> ? DType::f64 : DType::f32,
                       .device = out.device()});
      partial_ptr = static_cast<A*>(partial.raw_data());
    }
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks));
    const dim3 block(kColLanes, kColRows);
    if constexpr (!std::is_same_v<T, AnyDType>) {
      if (packed) {
        column_reduce_kernel<T, A, kPack><<<grid, block, 0, stream>>>(
            op, x.raw_data(), x.dtype(), args, partial_ptr, out.raw_data(), out.dtype());
      }
    }
    if (!packed) {
      column_reduce_kernel<T, A, 1><<<grid, block, 0, stream>>>(
          op, x.raw_data(), x.dtype(), args, partial_ptr, out.raw_data(), out.dtype());
    }
    TESSERA_KERNEL_CHECK("column_reduce_kernel");
    if (chunks > 1) {
      const unsigned blocks = static_cast<unsigned>((args.K + kFinishCols - 1) / kFinishCols);
      column_finish_kernel<A><<<blocks, dim3(kFinishCols, kFinishLanes), 0, stream>>>(
          op, partial_ptr, chunks, args.K, args.R, out.raw_data(), out.dtype());
      TESSERA_KERNEL_CHECK("column_finish_kernel");
    }
  });
}

void split_reduce(ReduceOp op, const Tensor& x, const ReduceLayout& L, const Tensor& out,
                  cudaStream_t stream) {
  SplitArgs args{L, 0, false, false};
  args.reduced_dense = L.reduced.ndim == 1 && L.reduced.strides[0][0] == 1;
  // ~8 blocks per SM over all outputs, each split at least 8192 elements.
  const int64_t want = std::max<int64_t>(1, 8 * multiprocessor_count() / L.num_outputs);
  const int64_t max_splits = std::max<int64_t>(1, L.reduce_size / 8192);
  int64_t splits = std::min(want, max_splits);
  args.per_split = (L.reduce_size + splits - 1) / splits;
  args.per_split = (args.per_split + kPack - 1) / kPack * kPack;
  splits = (L.reduce_size + args.per_split - 1) / args.per_split;
  visit_reduce_types(x.dtype(), [&](auto ttag, auto atag) {
    using T = decltype(ttag);
    using A = decltype(atag);
    bool kept_aligned = true;
    for (int d = 0; d < L.kept.ndim; ++d) kept_aligned &= L.kept.strides[0][d] % kPack == 0;
    args.packed = !std::is_same_v<T, AnyDType> && args.reduced_dense && kept_aligned &&
                  aligned16({x.raw_data()});
    Tensor partial;
    A* partial_ptr = nullptr;
    if (splits > 1) {
      partial = empty({L.num_outputs, splits},
                      {.dtype = std::is_same_v<A, double> ? DType::f64 : DType::f32,
                       .device = out.device()});
      partial_ptr = static_cast<A*>(partial.raw_data());
    }
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(L.num_outputs));
    split_reduce_kernel<T, A><<<grid, kSplitThreads, 0, stream>>>(
        op, x.raw_data(), x.dtype(), args, partial_ptr, out.raw_data(), out.dtype());
    TESSERA_KERNEL_CHECK("split_reduce_kernel");
    if (splits > 1) {
      const unsigned blocks = static_cast<unsigned>((L.num_outputs + 7) / 8);
      split_finish_kernel<A><<<blocks, dim3(32, 8), 0, stream>>>(
          op, partial_ptr, splits, L.num_outputs, L.reduce_size, out.raw_data(), out.dtype());
      TESSERA_KERNEL_CHECK("split_finish_kernel");
    }
  });
}

void reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  if (out.numel() == 0) return;
  TESSERA_CHECK(out.is_contiguous(), "reduce (cuda): output must be contiguous");
  KernelContext ctx(out);
  std::vector<bool> is_reduced(x.dim(), dims.empty());
  for (int64_t d : dims) is_reduced[d] = true;
  ReduceLayout L = make_reduce_layout(x, is_reduced);
  const bool kept_is_column_block = L.kept.ndim == 1 && L.kept.strides[0][0] == 1;
  if (kept_is_column_block && L.reduce_size > 1) {
    column_reduce(op, x, L, out, ctx.stream);
    return;
  }
  if (L.reduce_size >= 16384 && L.num_outputs < 2LL * multiprocessor_count() &&
      L.num_outputs <= 65535) {
    split_reduce(op, x, L, out, ctx.stream);
    return;
  }
  GroupShape g = group_shape(L.num_outputs, L.reduce_size);
  // f32 accumulation for f32/f16/bf16, double for f64 and integers.
  const bool use_double = x.dtype() == DType::f64 || is_integral(x.dtype());
  if (use_double) {
    reduce_kernel<double><<<g.grid, g.block, 0, ctx.stream>>>(op, x.raw_data(), x.dtype(),
                                                              out.raw_data(), out.dtype(), L);
  } else {
    reduce_kernel<float><<<g.grid, g.block, 0, ctx.stream>>>(op, x.raw_data(), x.dtype(),
                                                             out.raw_data(), out.dtype(), L);
  }
  TESSERA_KERNEL_CHECK("reduce_kernel");
}

// ---- argmax / argmin: first index of the extreme value; NaN counts as the extreme ----
struct ValueIndex {
  double value;
  int64_t index;
};

__device__ __forceinline__ bool better(bool is_max, double a, int64_t ia, double b, int64_t ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  if (a == b) return ia < ib;
  return is_max ? a > b : a < b;
}

__global__ void arg_reduce_kernel(bool is_max, const void* x, DType xt, int64_t* out,
                                  ReduceLayout L) {
  for (int64_t o = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; o < L.num_outputs;
       o += int64_t(gridDim.x) * blockDim.y) {
    int64_t base[1];
    L.kept.offsets(o, base);
    double best = is_max ? -INFINITY : INFINITY;
    int64_t best_i = L.reduce_size;  // loses every tie against a real index
    for (int64_t r = threadIdx.x; r < L.reduce_size; r += blockDim.x) {
      int64_t off[1];
      L.reduced.offsets(r, off);
      const double v = load_as<double>(x, xt, base[0] + off[0]);
      if (better(is_max, v, r, best, best_i)) {
        best = v;
        best_i = r;
      }
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      const double ov = __shfl_xor_sync(0xffffffffu, best, s);
      const int64_t oi = __shfl_xor_sync(0xffffffffu, best_i, s);
      if (better(is_max, ov, oi, best, best_i)) {
        best = ov;
        best_i = oi;
      }
    }
    if (threadIdx.x == 0) out[o] = best_i;
  }
}

void arg_reduce(bool is_max, const Tensor& x, int64_t dim, const Tensor& out) {
  if (out.numel() == 0) return;
  TESSERA_CHECK(out.is_contiguous() && out.dtype() == DType::i64,
                "arg_reduce (cuda): output must be contiguous int64");
  TESSERA_CHECK(x.size(dim) > 0, "arg", is_max ? "max" : "min", ": empty dimension ", dim,
                " of shape ", shape_str(x.shape()));
  KernelContext ctx(out);
  std::vector<bool> is_reduced(x.dim(), false);
  is_reduced[dim] = true;
  ReduceLayout L = make_reduce_layout(x, is_reduced);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((L.num_outputs + 7) / 8, 65535));
  arg_reduce_kernel<<<blocks, dim3(32, 8), 0, ctx.stream>>>(is_max, x.raw_data(), x.dtype(),
                                                           out.data<int64_t>(), L);
  TESSERA_KERNEL_CHECK("arg_reduce_kernel");
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.reduce = reduce;
  t.arg_reduce = arg_reduce;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
