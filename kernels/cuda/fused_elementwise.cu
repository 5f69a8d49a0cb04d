// Dropout and the exact GELU in one pass each way (FusedKernelTable's dropout_* and
// gelu_erf_* entries), instead of the chains of element-wise kernels their compositions run:
//   dropout:  out = x * mask, dx = dy * mask, element i's mask drawn from core/philox.h's
//             word i of the draw (dropout_keeps: the composition's rand() >= p) and scaled by
//             dropout_kept_scale, the backward drawing it again (no mask in memory);
//   gelu_erf: out = gelu(x), dx = dy * gelu'(x) (core/activation_math.h).
// The CPU row (kernels/cpu/fused_elementwise.cpp) computes the same element functions, so the
// dropout gives the same bits on both devices. Contiguous operands of one shape and floating
// dtype; 8-element packs (two Philox blocks) where every pointer is 16-byte aligned.
#include "tessera/core/activation_math.h"
#include "tessera/core/philox.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

template <class T>
__global__ void dropout_kernel(const T* in, T* out, int64_t n, uint64_t seed, uint64_t offset,
                               uint64_t keep_from, acc_t<T> kept, bool packed) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (packed) {  // pack p: elements 8p .. 8p + 7, Philox blocks offset + 2p and + 2p + 1
    for (int64_t p = start; p < n / kPack; p += stride) {
      const Philox4 lo = philox4x32_10(seed, offset + 2 * uint64_t(p));
      const Philox4 hi = philox4x32_10(seed, offset + 2 * uint64_t(p) + 1);
      const Pack8<T> x = load_pack(in, p);
      Pack8<T> y;
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        const uint32_t word = j < 4 ? lo.v[j] : hi.v[j - 4];
        y.v[j] = from_acc<T>(to_acc<A>(x.v[j]) * (word >= keep_from ? kept : A(0)));
      }
      store_pack(out, p, y);
    }
    return;
  }
  for (int64_t i = start; i < n; i += stride)
    out[i] = from_acc<T>(to_acc<A>(in[i]) *
                         (dropout_keeps(seed, offset, uint64_t(i), keep_from) ? kept : A(0)));
}

template <class T>
__global__ void gelu_erf_forward_kernel(const T* x, T* out, int64_t n, bool packed) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (packed) {
    for (int64_t p = start; p < n / kPack; p += stride) {
      const Pack8<T> v = load_pack(x, p);
      Pack8<T> y;
#pragma unroll
      for (int j = 0; j < kPack; ++j) y.v[j] = from_acc<T>(gelu_erf_value(to_acc<A>(v.v[j])));
      store_pack(out, p, y);
    }
    return;
  }
  for (int64_t i = start; i < n; i += stride) out[i] = from_acc<T>(gelu_erf_value(to_acc<A>(x[i])));
}

template <class T>
__global__ void gelu_erf_backward_kernel(const T* dy, const T* x, T* dx, int64_t n, bool packed) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if (packed) {
    for (int64_t p = start; p < n / kPack; p += stride) {
      const Pack8<T> g = load_pack(dy, p), v = load_pack(x, p);
      Pack8<T> d;
#pragma unroll
      for (int j = 0; j < kPack; ++j)
        d.v[j] = from_acc<T>(to_acc<A>(g.v[j]) * gelu_erf_slope(to_acc<A>(v.v[j])));
      store_pack(dx, p, d);
    }
    return;
  }
  for (int64_t i = start; i < n; i += stride)
    dx[i] = from_acc<T>(to_acc<A>(dy[i]) * gelu_erf_slope(to_acc<A>(x[i])));
}


void dropout_apply(const char* op, const Tensor& in, const DropoutDraw& draw, const Tensor& out) {
  check_elementwise_entry_operands(op, DeviceType::CUDA, in, "input", out, "output");
  check_dropout_draw(op, draw);
  const int64_t n = in.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  const bool packed = n % kPack == 0 && aligned16({in.raw_data(), out.raw_data()});
  const uint64_t keep_from = dropout_keep_from(draw.p);
  const double kept = dropout_kept_scale(draw.p, in.dtype());
  visit_float(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dropout_kernel<T><<<grid_for(packed ? n / kPack : n), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(in.raw_data()), static_cast<T*>(out.raw_data()), n, draw.seed,
        draw.offset, keep_from, static_cast<acc_t<T>>(kept), packed);
  });
  TESSERA_KERNEL_CHECK("dropout_kernel");
}

}  // namespace

void dropout_forward(const Tensor& x, const DropoutDraw& draw, const Tensor& out) {
  dropout_apply("dropout_forward", x, draw, out);
}

void dropout_backward(const Tensor& dy, const DropoutDraw& draw, const Tensor& dx) {
  dropout_apply("dropout_backward", dy, draw, dx);
}

void gelu_erf_forward(const Tensor& x, const Tensor& out) {
  check_elementwise_entry_operands("gelu_erf_forward", DeviceType::CUDA, x, "x", out, "out");
  const int64_t n = x.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  const bool packed = n % kPack == 0 && aligned16({x.raw_data(), out.raw_data()});
  visit_float(x.dtype(), "gelu_erf_forward", [&](auto tag) {
    using T = decltype(tag);
    gelu_erf_forward_kernel<T><<<grid_for(packed ? n / kPack : n), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(x.raw_data()), static_cast<T*>(out.raw_data()), n, packed);
  });
  TESSERA_KERNEL_CHECK("gelu_erf_forward_kernel");
}

void gelu_erf_backward(const Tensor& dy, const Tensor& x, const Tensor& dx) {
  check_elementwise_entry_operands("gelu_erf_backward", DeviceType::CUDA, x, "x", dy, "dy");
  check_elementwise_entry_operands("gelu_erf_backward", DeviceType::CUDA, x, "x", dx, "dx");
  const int64_t n = x.numel();
  if (n == 0) return;
  KernelContext ctx(dx);
  const bool packed = n % kPack == 0 && aligned16({dy.raw_data(), x.raw_data(), dx.raw_data()});
  visit_float(x.dtype(), "gelu_erf_backward", [&](auto tag) {
    using T = decltype(tag);
    gelu_erf_backward_kernel<T><<<grid_for(packed ? n / kPack : n), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
        static_cast<T*>(dx.raw_data()), n, packed);
  });
  TESSERA_KERNEL_CHECK("gelu_erf_backward_kernel");
}

}  // namespace tessera::cuda
