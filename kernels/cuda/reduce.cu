// Reductions over arbitrary dims (sum, mean, max, min, prod) and argmax/argmin.
//
// The input's dims are split into kept dims (which index the outputs) and
// reduced dims (which a group of threads walks). A group is one warp, or a whole
// block of 512 threads when there are few outputs and many elements each. The
// order of the partial sums is fixed by the launch shape, so results repeat
// bitwise from run to run.
#include <cmath>

#include "core/dispatch.h"
#include "kernels/cuda/common.cuh"

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

void reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  if (out.numel() == 0) return;
  TESSERA_CHECK(out.is_contiguous(), "reduce (cuda): output must be contiguous");
  KernelContext ctx(out);
  std::vector<bool> is_reduced(x.dim(), dims.empty());
  for (int64_t d : dims) is_reduced[d] = true;
  ReduceLayout L = make_reduce_layout(x, is_reduced);
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
