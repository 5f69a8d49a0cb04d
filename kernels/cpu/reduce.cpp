// CPU reductions: sum / mean / max / min / prod over any set of dims, and argmax/argmin.
//
// Two loop orders, picked from the memory layout:
//  * lane order: each output element walks its reduced elements; used when the reduced
//    elements are unit-stride (rows of a contiguous tensor: softmax-like sums, mean over C);
//  * column order: when the kept elements are the unit-stride ones ([N, C] -> [C], the bias
//    gradient), a block of output columns is accumulated row by row, so the inner loop is a
//    contiguous vector add instead of a strided gather. Threads own column blocks, so the
//    result does not depend on the thread count.
// Accumulation is in compute_t<T>: f32 for f16/bf16/f32, f64 for f64, int64 for integers.
#include <limits>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

constexpr int kNumReduceOps = static_cast<int>(ReduceOp::Prod) + 1;
constexpr int64_t kCascadeChunk = 256;

template <ReduceOp op, class A>
constexpr A reduce_identity() {
  if constexpr (op == ReduceOp::Sum || op == ReduceOp::Mean) return A(0);
  else if constexpr (op == ReduceOp::Prod) return A(1);
  else if constexpr (op == ReduceOp::Max) {
    return std::numeric_limits<A>::has_infinity ? -std::numeric_limits<A>::infinity()
                                                : std::numeric_limits<A>::lowest();
  } else {
    return std::numeric_limits<A>::has_infinity ? std::numeric_limits<A>::infinity()
                                                : std::numeric_limits<A>::max();
  }
}

// Max/min propagate NaN: once the accumulator is NaN it stays NaN.
template <ReduceOp op, class A>
inline A reduce_combine(A acc, A v) {
  if constexpr (op == ReduceOp::Sum || op == ReduceOp::Mean) return acc + v;
  else if constexpr (op == ReduceOp::Prod) return acc * v;
  else if constexpr (op == ReduceOp::Max) return (v > acc || v != v) ? v : acc;
  else return (v < acc || v != v) ? v : acc;
}

// One strided lane of n elements folded into acc.
template <ReduceOp op, class T, class A>
inline A reduce_lane(A acc, const T* p, int64_t n, int64_t stride) {
  if constexpr ((op == ReduceOp::Sum || op == ReduceOp::Mean) && std::is_same_v<T, A>) {
    if (stride == 1) {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < n; ++i) acc += p[i];
      return acc;
    }
  }
  for (int64_t i = 0; i < n; ++i) acc = reduce_combine<op>(acc, convert<A>(p[i * stride]));
  return acc;
}

struct ReduceLayout {
  Shape kept_shape, kept_x_strides, kept_out_strides;
  StridedLayout<1> reduced;  // coalesced reduced dims of x
  int64_t reduced_numel = 1;
};

ReduceLayout split_dims(const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  ReduceLayout L;
  Shape red_shape, red_strides;
  size_t next = 0;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (next < dims.size() && dims[next] == d) {
      ++next;
      red_shape.push_back(x.shape()[d]);
      red_strides.push_back(x.strides()[d]);
      L.reduced_numel *= x.shape()[d];
    } else {
      L.kept_shape.push_back(x.shape()[d]);
      L.kept_x_strides.push_back(x.strides()[d]);
      L.kept_out_strides.push_back(out.strides()[d]);
    }
  }
  L.reduced = coalesce<1>(red_shape, {&red_strides});
  return L;
}

// Offset of the r-th element (row-major) of a coalesced layout.
inline int64_t unravel_offset(int64_t r, const Shape& shape, const Shape& strides) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    off += (r % shape[d]) * strides[d];
    r /= shape[d];
  }
  return off;
}

template <ReduceOp op, class T, class O>
void reduce_typed(const Tensor& x, const ReduceLayout& L, const Tensor& out) {
  using A = compute_t<T>;
  const T* xp = static_cast<const T*>(x.raw_data());
  O* op_ = static_cast<O*>(out.raw_data());
  const Shape& rs = L.reduced.shape;
  const Shape& rx = L.reduced.strides[0];
  const int64_t inner = rs.back(), inner_stride = rx.back();
  const int64_t outer = L.reduced_numel / std::max<int64_t>(inner, 1);
  const int64_t kept = shape_numel(L.kept_shape);
  const double mean_scale = 1.0 / static_cast<double>(std::max<int64_t>(L.reduced_numel, 1));
  auto finish = [&](A acc) {
    if constexpr (op == ReduceOp::Mean) return convert<O>(A(acc * A(mean_scale)));
    else return convert<O>(acc);
  };

  const StridedLayout<2> K = coalesce<2>(L.kept_shape, {&L.kept_x_strides, &L.kept_out_strides});
  const bool column_order = inner_stride != 1 && K.shape.size() == 1 && K.strides[0][0] == 1 &&
                            kept > 1 && L.reduced_numel > 1;
  if (column_order) {
    constexpr int64_t kBlock = 64;
    const int64_t blocks = (kept + kBlock - 1) / kBlock;
    const int64_t out_stride = K.strides[1][0];
#pragma omp parallel for schedule(static) if (blocks > 1 && kept * L.reduced_numel >= kParallelGrain)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c0 = blk * kBlock, width = std::min(kBlock, kept - c0);
      // Rows are folded in chunks whose partial results are then combined (a two-level
      // cascade), so a long float sum's rounding error grows with the chunk, not the length.
      A total[kBlock], acc[kBlock];
      for (int64_t c = 0; c < width; ++c) total[c] = reduce_identity<op, A>();
      for (int64_t r0 = 0; r0 < L.reduced_numel; r0 += kCascadeChunk) {
        const int64_t r1 = std::min(L.reduced_numel, r0 + kCascadeChunk);
        for (int64_t c = 0; c < width; ++c) acc[c] = reduce_identity<op, A>();
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = xp + unravel_offset(r, rs, rx) + c0;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) acc[c] = reduce_combine<op>(acc[c], convert<A>(row[c]));
        }
        for (int64_t c = 0; c < width; ++c) total[c] = reduce_combine<op>(total[c], acc[c]);
      }
      for (int64_t c = 0; c < width; ++c) op_[(c0 + c) * out_stride] = finish(total[c]);
    }
    return;
  }

  const Shape& ks = L.kept_shape;
#pragma omp parallel for schedule(static) if (kept > 1 && kept * L.reduced_numel >= kParallelGrain)
  for (int64_t k = 0; k < kept; ++k) {
    const int64_t x_off = unravel_offset(k, ks, L.kept_x_strides);
    const int64_t o_off = unravel_offset(k, ks, L.kept_out_strides);
    A total = reduce_identity<op, A>();
    for (int64_t r = 0; r < outer; ++r) {
      const T* lane = xp + x_off + unravel_offset(r * inner, rs, rx);
      for (int64_t i0 = 0; i0 < inner; i0 += kCascadeChunk) {  // cascade as above
        const int64_t n = std::min(kCascadeChunk, inner - i0);
        total = reduce_combine<op>(
            total, reduce_lane<op>(reduce_identity<op, A>(), lane + i0 * inner_stride, n, inner_stride));
      }
    }
    op_[o_off] = finish(total);
  }
}

void reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, const Tensor& out) {
  const ReduceLayout L = split_dims(x, dims, out);
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    // Integer sums/products land in int64 (the front-end allocates out accordingly); other
    // results keep x's dtype. A differing out dtype goes through a temporary.
    using O = std::conditional_t<is_float_type_v<T>, T, int64_t>;
    Tensor target = out.dtype() == DTypeOf<O>::value
                        ? out
                        : empty(out.shape(), {.dtype = DTypeOf<O>::value, .device = out.device()});
    const ReduceLayout LT = target.is_same(out) ? L : split_dims(x, dims, target);
    with_enum_constant<ReduceOp, kNumReduceOps>(op, [&](auto op_c) {
      reduce_typed<decltype(op_c)::value, T, O>(x, LT, target);
    });
    if (!target.is_same(out)) kernel_table(DeviceType::CPU).copy(out, target);
  });
}

// Index of the first max (min) along dim; NaN counts as the max and the min, as in PyTorch.
void arg_reduce(bool is_max, const Tensor& x, int64_t dim, const Tensor& out) {
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using A = compute_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    int64_t* op_ = static_cast<int64_t*>(out.raw_data());
    for_each_lane<2>(x.shape(), dim, {&x.strides(), &out.strides()},
                     [&](std::array<int64_t, 2> off, int64_t n, const std::array<int64_t, 2>& st) {
                       const T* p = xp + off[0];
                       A best = convert<A>(p[0]);
                       int64_t best_i = 0;
                       for (int64_t i = 1; i < n && best == best; ++i) {
                         const A v = convert<A>(p[i * st[0]]);
                         if (v != v || (is_max ? v > best : v < best)) {
                           best = v;
                           best_i = i;
                         }
                       }
                       op_[off[1]] = best_i;
                     });
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.reduce = reduce;
  t.arg_reduce = arg_reduce;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
