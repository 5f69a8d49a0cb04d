// Element-wise CUDA kernels: fill, strided copy with conversion, Philox random
// fills, unary and binary math, where.
//
// Each is one grid-stride kernel over the output's elements. Operand dtypes are
// read at run time (the branch is the same for every thread of a launch), so a
// kernel is instantiated per compute type (f32, f64, i64) rather than per
// combination of dtypes; a dense fast path skips the index arithmetic, and a
// broadcast fast path covers bias vectors and scalars over contiguous outputs.
#include <cmath>
#include <utility>

#include "tessera/core/dispatch.h"
#include "tessera/core/philox.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/norm_common.cuh"

namespace tessera::cuda {

ComputeKind compute_kind(std::initializer_list<DType> dtypes) {
  bool any_f64 = false, any_float = false, all_integral = true;
  for (DType t : dtypes) {
    any_f64 |= t == DType::f64;
    any_float |= is_floating(t);
    all_integral &= is_integral(t);
  }
  if (any_f64) return ComputeKind::F64;
  if (all_integral) return ComputeKind::I64;
  // Integers mixed with f32/f16/bf16: double holds every integer up to 2^53 exactly.
  bool any_integral = false;
  for (DType t : dtypes) any_integral |= is_integral(t);
  return any_integral ? ComputeKind::F64 : ComputeKind::F32;
}

int multiprocessor_count(int device) {
  static int counts[64] = {};
  const int d = device < 0 ? current_device() : device;
  if (counts[d] == 0) {
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&counts[d], cudaDevAttrMultiProcessorCount, d));
  }
  return counts[d];
}

namespace {

// ---- fill ----
template <class C>
__global__ void fill_kernel(void* out, DType t, StridedIter<1> it, int64_t n, C value,
                            bool dense) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[1] = {i};
    if (!dense) it.offsets(i, off);
    store_as<C>(out, t, off[0], value);
  }
}

void fill(const Tensor& out, double value) {
  const int64_t n = out.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  auto it = make_iter<1>(out.shape(), {&out.strides()});
  visit_compute(compute_kind({out.dtype()}), [&](auto tag) {
    using C = decltype(tag);
    fill_kernel<C><<<grid_for(n), kThreads, 0, ctx.stream>>>(
        out.raw_data(), out.dtype(), it, n, static_cast<C>(value), iter_is_contiguous(it));
  });
  TESSERA_KERNEL_CHECK("fill_kernel");
}

// ---- copy ----
// Same dtype: move raw elements of the right width, no conversion.
template <class Word>
__global__ void strided_move_kernel(Word* dst, const Word* src, StridedIter<2> it, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    it.offsets(i, off);
    dst[off[0]] = src[off[1]];
  }
}

template <class C>
__global__ void convert_kernel(void* dst, DType dt, const void* src, DType st, StridedIter<2> it,
                               int64_t n, bool dense) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2] = {i, i};
    if (!dense) it.offsets(i, off);
    store_as<C>(dst, dt, off[0], load_as<C>(src, st, off[1]));
  }
}

// Dense float-to-float conversion (f32/f16/bf16 pairs), 8-element packs.
template <class D, class S>
__global__ void dense_cast_kernel(const S* __restrict__ src, D* __restrict__ dst, int64_t n) {
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = n / kPack;
  for (int64_t i = start; i < packs; i += stride) {
    const Pack8<S> a = load_pack(src, i);
    Pack8<D> r;
#pragma unroll
    for (int k = 0; k < kPack; ++k) r.v[k] = from_float<D>(to_float(a.v[k]));
    store_pack(dst, i, r);
  }
  for (int64_t i = packs * kPack + start; i < n; i += stride) dst[i] = from_float<D>(to_float(src[i]));
}

bool is_half_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

void copy(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  TESSERA_CHECK(src.device().is_cuda() && src.device() == dst.device(), "copy_ (cuda): ",
                "source on ", src.device().str(), ", destination on ", dst.device().str());
  KernelContext ctx(dst);
  auto it = make_iter<2>(dst.shape(), {&dst.strides(), &src.strides()});
  const bool dense = iter_is_contiguous(it);
  if (dst.dtype() == src.dtype()) {
    if (dense) {
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(),
                                         cudaMemcpyDeviceToDevice, ctx.stream));
      return;
    }
    auto launch = [&](auto word) {
      using W = decltype(word);
      strided_move_kernel<W><<<grid_for(n), kThreads, 0, ctx.stream>>>(
          static_cast<W*>(dst.raw_data()), static_cast<const W*>(src.raw_data()), it, n);
    };
    switch (dst.element_size()) {
      case 1: launch(uint8_t{}); break;
      case 2: launch(uint16_t{}); break;
      case 4: launch(uint32_t{}); break;
      default: launch(uint64_t{}); break;
    }
    TESSERA_KERNEL_CHECK("strided_move_kernel");
    return;
  }
  if (dense && is_half_float(dst.dtype()) && is_half_float(src.dtype()) &&
      aligned16({dst.raw_data(), src.raw_data()})) {
    visit_half_float(dst.dtype(), [&](auto dtag) {
      visit_half_float(src.dtype(), [&](auto stag) {
        using D = decltype(dtag);
        using S = decltype(stag);
        dense_cast_kernel<D, S><<<grid_for((n + kPack - 1) / kPack), kThreads, 0, ctx.stream>>>(
            static_cast<const S*>(src.raw_data()), static_cast<D*>(dst.raw_data()), n);
      });
    });
    TESSERA_KERNEL_CHECK("dense_cast_kernel");
    return;
  }
  visit_compute(compute_kind({dst.dtype(), src.dtype()}), [&](auto tag) {
    using C = decltype(tag);
    convert_kernel<C><<<grid_for(n), kThreads, 0, ctx.stream>>>(
        dst.raw_data(), dst.dtype(), src.raw_data(), src.dtype(), it, n, dense);
  });
  TESSERA_KERNEL_CHECK("convert_kernel");
}

// ---- random: the same Philox numbering as the CPU kernel ----
__global__ void random_kernel(void* out, DType t, int64_t n, RandomKind kind, uint64_t seed,
                              uint64_t offset, double a, double b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t u = static_cast<uint64_t>(i);
    if (kind == RandomKind::Integer) {
      store_as<int64_t>(out, t, i,
                        philox_randint_at(seed, offset, u, static_cast<int64_t>(a),
                                          static_cast<int64_t>(b)));
    } else {
      const double r = kind == RandomKind::Uniform
                           ? a + (b - a) * philox_uniform_at(seed, offset, u)
                           : a + b * philox_normal_at(seed, offset, u);
      store_as<double>(out, t, i, r);
    }
  }
}

void random(const Tensor& out, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b) {
  const int64_t n = out.numel();
  if (n == 0) return;
  TESSERA_CHECK(out.is_contiguous(), "random (cuda): output must be contiguous");
  KernelContext ctx(out);
  random_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(out.raw_data(), out.dtype(), n, kind,
                                                         seed, offset, a, b);
  TESSERA_KERNEL_CHECK("random_kernel");
}

// ---- unary ----
constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCoeff = 0.044715;

template <class C>
__device__ __forceinline__ C apply_unary(UnaryOp op, C x) {
  if constexpr (std::is_same_v<C, int64_t>) {
    switch (op) {
      case UnaryOp::Neg: return -x;
      case UnaryOp::Abs: return x < 0 ? -x : x;
      case UnaryOp::Square: return x * x;
      case UnaryOp::Sign: return (x > 0) - (x < 0);
      case UnaryOp::Relu: return x > 0 ? x : 0;
      case UnaryOp::LogicalNot: return x == 0;
      case UnaryOp::Floor: case UnaryOp::Ceil: case UnaryOp::Round: return x;
      default: return static_cast<int64_t>(apply_unary<double>(op, static_cast<double>(x)));
    }
  } else {
    switch (op) {
      case UnaryOp::Neg: return -x;
      case UnaryOp::Exp: return exp(x);
      case UnaryOp::Log: return log(x);
      case UnaryOp::Sqrt: return sqrt(x);
      case UnaryOp::Rsqrt: return C(1) / sqrt(x);
      case UnaryOp::Abs: return fabs(x);
      case UnaryOp::Tanh: return tanh(x);
      case UnaryOp::Sigmoid: return C(1) / (C(1) + exp(-x));
      case UnaryOp::Relu: return x > C(0) ? x : C(0);
      case UnaryOp::Gelu: {
        const C inner = C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x * x * x);
        const C one_plus_t = C(1) + tanh(inner);
        return one_plus_t == C(0) ? C(0) : C(0.5) * x * one_plus_t;  // 0 at -inf, not NaN
      }
      case UnaryOp::Sin: return sin(x);
      case UnaryOp::Cos: return cos(x);
      case UnaryOp::Square: return x * x;
      case UnaryOp::Reciprocal: return C(1) / x;
      case UnaryOp::Sign: return x > C(0) ? C(1) : (x < C(0) ? C(-1) : C(0));
      case UnaryOp::Floor: return floor(x);
      case UnaryOp::Ceil: return ceil(x);
      case UnaryOp::Round: return rint(x);  // half to even, as PyTorch
      case UnaryOp::LogicalNot: return x == C(0) ? C(1) : C(0);
      case UnaryOp::Log1p: return log1p(x);
      case UnaryOp::Expm1: return expm1(x);
      case UnaryOp::Erf: return erf(x);
    }
    return x;
  }
}

// Dense fast path: one float dtype, contiguous, 16-byte aligned; the op is a template
// argument so its switch folds away, and each thread moves 8-element packs.
template <UnaryOp kOp>
struct UnaryFn {
  template <class A>
  __device__ __forceinline__ A operator()(A x) const { return apply_unary<A>(kOp, x); }
};

template <class T, class Fn>
__global__ void dense_unary_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n, Fn fn) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = n / kPack;
  for (int64_t i = start; i < packs; i += stride) {
    const Pack8<T> a = load_pack(x, i);
    Pack8<T> r;
#pragma unroll
    for (int k = 0; k < kPack; ++k) r.v[k] = from_acc<T>(fn(to_acc<A>(a.v[k])));
    store_pack(out, i, r);
  }
  for (int64_t i = packs * kPack + start; i < n; i += stride) out[i] = from_acc<T>(fn(to_acc<A>(x[i])));
}

template <class T, UnaryOp kOp>
bool launch_dense_unary(UnaryOp op, const T* x, T* out, int64_t n, cudaStream_t stream) {
  if (op != kOp) return false;
  dense_unary_kernel<T><<<grid_for((n + kPack - 1) / kPack), kThreads, 0, stream>>>(x, out, n, UnaryFn<kOp>{});
  return true;
}

template <class T, size_t... I>
void dense_unary(UnaryOp op, const T* x, T* out, int64_t n, cudaStream_t stream,
                 std::index_sequence<I...>) {
  (launch_dense_unary<T, static_cast<UnaryOp>(I)>(op, x, out, n, stream) || ...);
}

// Same float dtype for x and out, both dense and aligned: the fast path applies.
bool dense_float_path(std::initializer_list<const Tensor*> ts) {
  const DType t = (*ts.begin())->dtype();
  if (t != DType::f32 && t != DType::f16 && t != DType::bf16) return false;
  const Shape& shape = (*ts.begin())->shape();
  for (const Tensor* x : ts) {
    if (x->dtype() != t || x->shape() != shape || !x->is_contiguous() || !aligned16({x->raw_data()}))
      return false;
  }
  return true;
}

template <class C>
__global__ void unary_kernel(UnaryOp op, const void* x, DType xt, void* out, DType ot,
                             StridedIter<2> it, int64_t n, bool dense) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2] = {i, i};
    if (!dense) it.offsets(i, off);
    store_as<C>(out, ot, off[0], apply_unary<C>(op, load_as<C>(x, xt, off[1])));
  }
}

void unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  if (dense_float_path({&out, &x})) {
    visit_half_float(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      dense_unary<T>(op, static_cast<const T*>(x.raw_data()), static_cast<T*>(out.raw_data()), n,
                     ctx.stream, std::make_index_sequence<static_cast<size_t>(UnaryOp::Erf) + 1>{});
    });
    TESSERA_KERNEL_CHECK("dense_unary_kernel");
    return;
  }
  auto it = make_iter<2>(out.shape(), {&out.strides(), &x.strides()});
  // Floating math on integer inputs (exp of an i64) is done in double.
  ComputeKind k = compute_kind({x.dtype(), out.dtype()});
  visit_compute(k, [&](auto tag) {
    using C = decltype(tag);
    unary_kernel<C><<<grid_for(n), kThreads, 0, ctx.stream>>>(
        op, x.raw_data(), x.dtype(), out.raw_data(), out.dtype(), it, n, iter_is_contiguous(it));
  });
  TESSERA_KERNEL_CHECK("unary_kernel");
}

// ---- binary ----
template <class C>
__device__ __forceinline__ C apply_binary(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div:
      if constexpr (std::is_same_v<C, int64_t>) {
        return b == 0 ? 0 : a / b;  // only reached for integer outputs (floor-free C division)
      } else {
        return a / b;
      }
    case BinaryOp::Pow:
      if constexpr (std::is_same_v<C, int64_t>) {
        return static_cast<int64_t>(pow(static_cast<double>(a), static_cast<double>(b)));
      } else {
        return pow(a, b);
      }
    case BinaryOp::Maximum:
      if constexpr (!std::is_same_v<C, int64_t>) {
        if (a != a || b != b) return a != a ? a : b;  // NaN propagates
      }
      return a > b ? a : b;
    case BinaryOp::Minimum:
      if constexpr (!std::is_same_v<C, int64_t>) {
        if (a != a || b != b) return a != a ? a : b;
      }
      return a < b ? a : b;
    case BinaryOp::Eq: return a == b;
    case BinaryOp::Ne: return a != b;
    case BinaryOp::Lt: return a < b;
    case BinaryOp::Le: return a <= b;
    case BinaryOp::Gt: return a > b;
    case BinaryOp::Ge: return a >= b;
    case BinaryOp::LogicalAnd: return (a != C(0)) && (b != C(0));
    case BinaryOp::LogicalOr: return (a != C(0)) || (b != C(0));
    case BinaryOp::GeluBackward:
      if constexpr (std::is_same_v<C, int64_t>) {
        return 0;
      } else {
        const C x = a, x2 = x * x;
        const C t = tanh(C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x2 * x));
        const C dinner = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCoeff) * x2);
        // Where tanh saturates (|x| large or infinite) sech^2 is 0 and the limit is 1 or 0;
        // x * dinner alone would be inf there and inf * 0 NaN.
        const C sech2 = C(1) - t * t;
        const C tail = sech2 == C(0) ? C(0) : C(0.5) * x * sech2 * dinner;
        return b * (C(0.5) * (C(1) + t) + tail);
      }
  }
  return a;
}

template <BinaryOp kOp>
struct BinaryFn {
  template <class A>
  __device__ __forceinline__ A operator()(A a, A b) const { return apply_binary<A>(kOp, a, b); }
};

template <class T, class Fn>
__global__ void dense_binary_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                    T* __restrict__ out, int64_t n, Fn fn) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = n / kPack;
  for (int64_t i = start; i < packs; i += stride) {
    const Pack8<T> x = load_pack(a, i), y = load_pack(b, i);
    Pack8<T> r;
#pragma unroll
    for (int k = 0; k < kPack; ++k) r.v[k] = from_acc<T>(fn(to_acc<A>(x.v[k]), to_acc<A>(y.v[k])));
    store_pack(out, i, r);
  }
  for (int64_t i = packs * kPack + start; i < n; i += stride)
    out[i] = from_acc<T>(fn(to_acc<A>(a[i]), to_acc<A>(b[i])));
}

template <class T, BinaryOp kOp>
bool launch_dense_binary(BinaryOp op, const T* a, const T* b, T* out, int64_t n, cudaStream_t stream) {
  if (op != kOp) return false;
  dense_binary_kernel<T><<<grid_for((n + kPack - 1) / kPack), kThreads, 0, stream>>>(a, b, out, n, BinaryFn<kOp>{});
  return true;
}

template <class T, size_t... I>
void dense_binary(BinaryOp op, const T* a, const T* b, T* out, int64_t n, cudaStream_t stream,
                  std::index_sequence<I...>) {
  (launch_dense_binary<T, static_cast<BinaryOp>(I)>(op, a, b, out, n, stream) || ...);
}

// Broadcast fast path: out contiguous, and each operand's element for output index i is
// p[(i / div) % mod] over its own contiguous memory -- a same-shape dense operand
// (div 1, mod n), a vector of the last dims broadcast over the leading ones (bias [N] over
// [M, N]: div 1, mod N), a column broadcast over the last dims ([M, 1]: div N, mod M) or a
// scalar (mod 1). Threads keep (i / div) % mod up to date by adding their fixed grid stride,
// so the loop has no division.
struct PeriodicOperand {
  const void* data;
  int64_t div, mod;
  int64_t step_quot, step_rem;  // (stride / div) % mod and stride % div, stride in elements
  bool packs;                   // 8 consecutive outputs read 8 consecutive elements
};

// Position of one thread in one operand: q = (i / div) % mod, r = i % div.
struct PeriodicCursor {
  int64_t q, r;
  __device__ __forceinline__ void start(const PeriodicOperand& o, int64_t i) {
    r = i % o.div;
    q = (i / o.div) % o.mod;
  }
  __device__ __forceinline__ void advance(const PeriodicOperand& o) {
    r += o.step_rem;
    const int carry = r >= o.div;
    if (carry) r -= o.div;
    q += o.step_quot + carry;  // < 2 * mod: one subtraction wraps it
    if (q >= o.mod) q -= o.mod;
  }
};

// The 8 operand values for the 8 outputs starting at a multiple of 8: one pack when they are
// consecutive in memory, else one element repeated (div a multiple of 8, or a scalar).
template <class T>
__device__ __forceinline__ Pack8<T> periodic_pack(const PeriodicOperand& o, int64_t q) {
  const T* p = static_cast<const T*>(o.data);
  if (o.packs) return load_pack(p, q / kPack);
  Pack8<T> v;
  const T e = p[q];
#pragma unroll
  for (int k = 0; k < kPack; ++k) v.v[k] = e;
  return v;
}

template <class T>
__device__ __forceinline__ T periodic_at(const PeriodicOperand& o, int64_t i) {
  return static_cast<const T*>(o.data)[(i / o.div) % o.mod];
}

// With `packed` a unit is 8 outputs (16-byte stores), else one output. out may be a's data
// (in-place binary_): each unit is read before it is written, by the same thread.
template <class T, class Fn>
__global__ void periodic_binary_kernel(PeriodicOperand a, PeriodicOperand b, T* out, int64_t n,
                                       bool packed, Fn fn) {
  using A = acc_t<T>;
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int unit = packed ? kPack : 1;
  const int64_t units = n / unit;
  PeriodicCursor ca, cb;
  ca.start(a, t * unit);
  cb.start(b, t * unit);
  for (int64_t u = t; u < units; u += stride) {
    if (packed) {
      const Pack8<T> x = periodic_pack<T>(a, ca.q), y = periodic_pack<T>(b, cb.q);
      Pack8<T> r;
#pragma unroll
      for (int k = 0; k < kPack; ++k) r.v[k] = from_acc<T>(fn(to_acc<A>(x.v[k]), to_acc<A>(y.v[k])));
      store_pack(out, u, r);
    } else {
      const T* pa = static_cast<const T*>(a.data);
      const T* pb = static_cast<const T*>(b.data);
      out[u] = from_acc<T>(fn(to_acc<A>(pa[ca.q]), to_acc<A>(pb[cb.q])));
    }
    ca.advance(a);
    cb.advance(b);
  }
  // The last n % 8 outputs of the packed walk.
  for (int64_t i = units * unit + t; i < n; i += stride)
    out[i] = from_acc<T>(fn(to_acc<A>(periodic_at<T>(a, i)), to_acc<A>(periodic_at<T>(b, i))));
}

template <class T, BinaryOp kOp>
bool launch_periodic_binary(BinaryOp op, const PeriodicOperand& a, const PeriodicOperand& b,
                            T* out, int64_t n, bool packed, unsigned grid, cudaStream_t stream) {
  if (op != kOp) return false;
  periodic_binary_kernel<T><<<grid, kThreads, 0, stream>>>(a, b, out, n, packed, BinaryFn<kOp>{});
  return true;
}

template <class T, size_t... I>
void periodic_binary(BinaryOp op, const PeriodicOperand& a, const PeriodicOperand& b, T* out,
                     int64_t n, bool packed, unsigned grid, cudaStream_t stream,
                     std::index_sequence<I...>) {
  (launch_periodic_binary<T, static_cast<BinaryOp>(I)>(op, a, b, out, n, packed, grid, stream) ||
   ...);
}

// Reads x's (expanded) strides from the innermost dim out: stride-0 dims (their product is
// div), then dims laid out contiguously (their product is mod), then stride-0 dims only.
// False for any other layout.
bool periodic_layout(const Tensor& x, PeriodicOperand& o) {
  enum { kInnerBroadcast, kContiguous, kOuterBroadcast } phase = kInnerBroadcast;
  o.data = x.raw_data();
  o.div = 1;
  o.mod = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    const int64_t size = x.size(d), stride = x.stride(d);
    if (size == 1) continue;
    if (phase == kInnerBroadcast) {
      if (stride == 0) {
        o.div *= size;
        continue;
      }
      phase = kContiguous;
    }
    if (phase == kContiguous) {
      if (stride == o.mod) {
        o.mod *= size;
        continue;
      }
      phase = kOuterBroadcast;
    }
    if (stride != 0) return false;
  }
  return true;
}

// The broadcast fast path applies: one float dtype everywhere, out contiguous and aligned,
// and both operands periodic. Fills the operands (steps for `grid` blocks) and `packed`.
bool periodic_binary_path(const Tensor& a, const Tensor& b, const Tensor& out, unsigned& grid,
                          bool& packed, PeriodicOperand& pa, PeriodicOperand& pb) {
  const DType t = out.dtype();
  if (t != DType::f32 && t != DType::f16 && t != DType::bf16) return false;
  if (a.dtype() != t || b.dtype() != t || !out.is_contiguous() || !aligned16({out.raw_data()}))
    return false;
  if (!periodic_layout(a, pa) || !periodic_layout(b, pb)) return false;
  // Packs of 8 outputs start at multiples of 8 below n - n % 8: an operand's 8 elements are
  // consecutive when its period is a multiple of 8 or is the whole output (no wrap-around).
  const int64_t n = out.numel();
  packed = true;
  for (PeriodicOperand* o : {&pa, &pb}) {
    o->packs = o->div == 1 && (o->mod % kPack == 0 || o->mod == n) && aligned16({o->data});
    packed &= o->packs || o->div % kPack == 0 || o->mod == 1;
  }
  const int unit = packed ? kPack : 1;
  grid = grid_for((n + unit - 1) / unit);
  const int64_t stride = int64_t(grid) * kThreads * unit;
  for (PeriodicOperand* o : {&pa, &pb}) {
    o->step_quot = (stride / o->div) % o->mod;
    o->step_rem = stride % o->div;
  }
  return true;
}

template <class C>
__global__ void binary_kernel(BinaryOp op, const void* a, DType at, const void* b, DType bt,
                              void* out, DType ot, StridedIter<3> it, int64_t n, bool dense) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[3] = {i, i, i};
    if (!dense) it.offsets(i, off);
    store_as<C>(out, ot, off[0],
                apply_binary<C>(op, load_as<C>(a, at, off[1]), load_as<C>(b, bt, off[2])));
  }
}

bool is_comparison(BinaryOp op) {
  switch (op) {
    case BinaryOp::Eq: case BinaryOp::Ne: case BinaryOp::Lt: case BinaryOp::Le:
    case BinaryOp::Gt: case BinaryOp::Ge: case BinaryOp::LogicalAnd: case BinaryOp::LogicalOr:
      return true;
    default: return false;
  }
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  if (!is_comparison(op) && dense_float_path({&out, &a, &b})) {
    visit_half_float(out.dtype(), [&](auto tag) {
      using T = decltype(tag);
      dense_binary<T>(op, static_cast<const T*>(a.raw_data()), static_cast<const T*>(b.raw_data()),
                      static_cast<T*>(out.raw_data()), n, ctx.stream,
                      std::make_index_sequence<static_cast<size_t>(BinaryOp::GeluBackward) + 1>{});
    });
    TESSERA_KERNEL_CHECK("dense_binary_kernel");
    return;
  }
  PeriodicOperand pa, pb;
  unsigned grid = 0;
  bool packed = false;
  if (!is_comparison(op) && periodic_binary_path(a, b, out, grid, packed, pa, pb)) {
    visit_half_float(out.dtype(), [&](auto tag) {
      using T = decltype(tag);
      periodic_binary<T>(op, pa, pb, static_cast<T*>(out.raw_data()), n, packed, grid, ctx.stream,
                         std::make_index_sequence<static_cast<size_t>(BinaryOp::GeluBackward) + 1>{});
    });
    TESSERA_KERNEL_CHECK("periodic_binary_kernel");
    return;
  }
  auto it = make_iter<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()});
  // Computed in the promoted type of the inputs; a floating output of integer inputs (true
  // division) computes in double. Comparisons ignore the (bool) output type.
  const DType promoted = promote_types(a.dtype(), b.dtype());
  ComputeKind k = is_comparison(op) ? compute_kind({promoted})
                                    : compute_kind({promoted, out.dtype()});
  visit_compute(k, [&](auto tag) {
    using C = decltype(tag);
    binary_kernel<C><<<grid_for(n), kThreads, 0, ctx.stream>>>(
        op, a.raw_data(), a.dtype(), b.raw_data(), b.dtype(), out.raw_data(), out.dtype(), it, n,
        iter_is_contiguous(it));
  });
  TESSERA_KERNEL_CHECK("binary_kernel");
}

// ---- where ----
template <class C>
__global__ void where_kernel(const void* cond, DType ct, const void* a, DType at, const void* b,
                             DType bt, void* out, DType ot, StridedIter<4> it, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[4];
    it.offsets(i, off);
    const bool c = load_as<int64_t>(cond, ct, off[1]) != 0 || load_as<double>(cond, ct, off[1]) != 0;
    store_as<C>(out, ot, off[0], c ? load_as<C>(a, at, off[2]) : load_as<C>(b, bt, off[3]));
  }
}

void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  auto it = make_iter<4>(out.shape(),
                         {&out.strides(), &cond.strides(), &a.strides(), &b.strides()});
  visit_compute(compute_kind({out.dtype()}), [&](auto tag) {
    using C = decltype(tag);
    where_kernel<C><<<grid_for(n), kThreads, 0, ctx.stream>>>(
        cond.raw_data(), cond.dtype(), a.raw_data(), a.dtype(), b.raw_data(), b.dtype(),
        out.raw_data(), out.dtype(), it, n);
  });
  TESSERA_KERNEL_CHECK("where_kernel");
}

// ---- column sums (bias gradients), alone or after GELU's backward ----

// kGelu: in place over d [rows, H], d = d * gelu'(pre), each element as binary(GeluBackward)
// computes and rounds it; then (and without kGelu, of d as it is) the column sums of the
// values over this block's chunk of rows into partial[chunk, H]. A thread owns one pack of 8
// columns down the chunk, so the sums need no atomics and their order (row order) is fixed by the
// shapes. The loads of kColumnSumRows rows are issued before any is used: with one row at a time a
// thread had one pair of 16-byte loads in flight, and the kernel ran at 71% of the copy rate.
constexpr int kColumnSumThreads = 128, kColumnSumRows = 4;

template <class T, bool kGelu>
__global__ void __launch_bounds__(kColumnSumThreads)
    column_sums_kernel(const T* __restrict__ pre, T* __restrict__ d, int64_t rows, int64_t H,
                       int64_t rows_per_chunk, acc_t<T>* __restrict__ partial) {
  using A = acc_t<T>;
  const int64_t packs_per_row = H / kPack;
  const int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (p >= packs_per_row) return;
  const int64_t first = blockIdx.y * rows_per_chunk;
  const int64_t last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  const BinaryFn<BinaryOp::GeluBackward> fn;
  A sum[kPack] = {};
  auto finish_row = [&](int64_t i, const Pack8<T>& x, const Pack8<T>& g) {
    if constexpr (kGelu) {
      Pack8<T> out;
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        out.v[k] = from_acc<T>(fn(to_acc<A>(x.v[k]), to_acc<A>(g.v[k])));
        sum[k] += to_acc<A>(out.v[k]);
      }
      store_pack(d, i, out);
    } else {
#pragma unroll
      for (int k = 0; k < kPack; ++k) sum[k] += to_acc<A>(g.v[k]);
    }
  };
  auto load_pre = [&](int64_t i) { return kGelu ? load_pack(pre, i) : Pack8<T>{}; };
  int64_t r = first;
  for (; r + kColumnSumRows <= last; r += kColumnSumRows) {
    Pack8<T> x[kColumnSumRows], g[kColumnSumRows];
#pragma unroll
    for (int j = 0; j < kColumnSumRows; ++j) {
      x[j] = load_pre((r + j) * packs_per_row + p);
      g[j] = load_pack(d, (r + j) * packs_per_row + p);
    }
#pragma unroll
    for (int j = 0; j < kColumnSumRows; ++j) finish_row((r + j) * packs_per_row + p, x[j], g[j]);
  }
  for (; r < last; ++r) {
    const int64_t i = r * packs_per_row + p;
    finish_row(i, load_pre(i), load_pack(d, i));
  }
#pragma unroll
  for (int k = 0; k < kPack; ++k) partial[blockIdx.y * H + p * kPack + k] = sum[k];
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CUDA);
  t.fill = fill;
  t.copy = copy;
  t.random = random;
  t.unary = unary;
  t.binary = binary;
  t.where = where;
  return true;
}();

}  // namespace

namespace {

// column_sums_kernel's launch: false (nothing done) unless d is a contiguous, 16-byte aligned
// f32/f16/bf16 matrix with rows of whole packs, sums a contiguous [H] of its dtype and (kGelu)
// pre shaped, typed and aligned as d.
template <bool kGelu>
bool column_sums_pass(const Tensor& pre, const Tensor& d, const Tensor& sums) {
  const DType t = d.dtype();
  const auto aligned = [](const Tensor& u) {
    return reinterpret_cast<uintptr_t>(u.raw_data()) % 16 == 0;
  };
  if (!(t == DType::f32 || t == DType::bf16 || t == DType::f16) || d.dim() != 2 ||
      !d.is_contiguous() || !aligned(d) || d.size(1) % kPack != 0)
    return false;
  const bool pre_fits =
      !kGelu || (pre.shape() == d.shape() && pre.dtype() == t && pre.device() == d.device() &&
                 pre.is_contiguous() && aligned(pre));
  const bool sums_fit = sums.defined() && sums.shape() == Shape{d.size(1)} && sums.dtype() == t &&
                        sums.device() == d.device() && sums.is_contiguous();
  if (!pre_fits || !sums_fit) return false;
  const int64_t rows = d.size(0), H = d.size(1);
  KernelContext ctx(d);
  if (rows == 0 || H == 0) {
    TESSERA_CUDA_CHECK(cudaMemsetAsync(sums.raw_data(), 0, sums.nbytes(), ctx.stream));
    return true;
  }
  // About eight blocks per SM in all; chunks of at least 16 rows.
  const int64_t col_blocks = (H / kPack + kColumnSumThreads - 1) / kColumnSumThreads;
  const int64_t want = std::max<int64_t>(1, 8 * multiprocessor_count() / col_blocks);
  const int64_t rows_per_chunk = std::max<int64_t>(16, (rows + want - 1) / want);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  visit_half_float(t, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    Tensor partial = empty({chunks, H}, {.dtype = DType::f32, .device = d.device()});
    column_sums_kernel<T, kGelu>
        <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)),
           kColumnSumThreads, 0, ctx.stream>>>(
            kGelu ? static_cast<const T*>(pre.raw_data()) : nullptr, static_cast<T*>(d.raw_data()),
            rows, H, rows_per_chunk, partial.data<A>());
    TESSERA_KERNEL_CHECK("column_sums_kernel");
    add_column_partials<T>(ctx.stream, /*accumulate=*/false, partial.data<A>(), nullptr, chunks, H,
                           static_cast<T*>(sums.raw_data()), nullptr);
  });
  return true;
}

}  // namespace

bool gelu_backward_with_bias_grad(const Tensor& pre, const Tensor& d, const Tensor& dbias) {
  return column_sums_pass<true>(pre, d, dbias);
}

bool column_sums(const Tensor& g, const Tensor& sums) {
  return column_sums_pass<false>(Tensor(), g, sums);
}

namespace {
struct SumScaledFn {
  float scale;
  __device__ __forceinline__ float operator()(float x, float y) const { return (x + y) * scale; }
};

template <class T>
__global__ void sum_scaled_unaligned_kernel(const T* a, const T* b, T* out, int64_t n,
                                            SumScaledFn fn) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_acc<T>(fn(to_acc<float>(a[i]), to_acc<float>(b[i])));
}
}  // namespace

void sum_scaled(const Tensor& a, const Tensor& b, double scale, const Tensor& out) {
  const DType t = out.dtype();
  TESSERA_CHECK((t == DType::f32 || t == DType::f16 || t == DType::bf16) && a.dtype() == t &&
                    b.dtype() == t,
                "sum_scaled: a, b and out must share one dtype of f32, f16 and bf16, got ",
                dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " and ", dtype_name(t));
  TESSERA_CHECK(a.numel() == out.numel() && b.numel() == out.numel(),
                "sum_scaled: sizes differ: a ", shape_str(a.shape()), ", b ", shape_str(b.shape()),
                ", out ", shape_str(out.shape()));
  TESSERA_CHECK(a.is_contiguous() && b.is_contiguous() && out.is_contiguous(),
                "sum_scaled: a, b and out must be contiguous");
  TESSERA_CHECK(a.device() == out.device() && b.device() == out.device() && out.device().is_cuda(),
                "sum_scaled: a, b and out must be on one CUDA device, got ", a.device().str(), ", ",
                b.device().str(), " and ", out.device().str());
  const int64_t n = out.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  const SumScaledFn fn{static_cast<float>(scale)};
  visit_half_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = static_cast<const T*>(a.raw_data());
    const T* pb = static_cast<const T*>(b.raw_data());
    T* po = static_cast<T*>(out.raw_data());
    if (aligned16({pa, pb, po}))
      dense_binary_kernel<T><<<grid_for((n + kPack - 1) / kPack), kThreads, 0, ctx.stream>>>(
          pa, pb, po, n, fn);
    else
      sum_scaled_unaligned_kernel<T><<<grid_for(n), kThreads, 0, ctx.stream>>>(pa, pb, po, n, fn);
  });
  TESSERA_KERNEL_CHECK("sum_scaled");
}

}  // namespace tessera::cuda
