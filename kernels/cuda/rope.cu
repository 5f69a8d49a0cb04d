// CUDA kernel of the rotary position embeddings: one thread per 8 rotated pairs (16-byte packs),
// or per pair for odd layouts; the input is read through its strides, so no layout copy runs
// first. The CPU kernel (kernels/cpu/rope.cpp) is the reference (tests/cuda).
#include "tessera/core/dispatch.h"
#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda {
namespace {

// Element strides of the rotary input [B, T, H, D].
struct RopeStrides {
  int64_t b, t, h, d;
};

// ---- RoPE ----
// x [B, T, H, D] read and out written through their strides. Pair (i, i + D/2) of a head:
//   out[i] = x[i] cos - x[i + D/2] sin,  out[i + D/2] = x[i + D/2] cos + x[i] sin.

// The readable version: one thread per rotated pair, any strides.
template <class T, class S>
__global__ void rope_kernel(const T* x, const S* cos, const S* sin, float sign, T* out, int64_t B,
                            int64_t Tn, int64_t H, int64_t D, RopeStrides xs, RopeStrides os) {
  using A = acc_t<T>;
  const int64_t half = D / 2, pairs = B * Tn * H * half;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half, row = p / half;  // row = (b * Tn + t) * H + h
    const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
    const T* in = x + b * xs.b + t * xs.t + h * xs.h;
    T* o = out + b * os.b + t * os.t + h * os.h;
    const A c = static_cast<A>(cos[t * half + i]), s = A(sign) * static_cast<A>(sin[t * half + i]);
    const A x1 = to_acc<A>(in[i * xs.d]), x2 = to_acc<A>(in[(i + half) * xs.d]);
    o[i * os.d] = from_acc<T>(x1 * c - x2 * s);
    o[(i + half) * os.d] = from_acc<T>(x2 * c + x1 * s);
  }
}

// The bandwidth-bound version (f32/f16/bf16, D/2 a multiple of 8, 16-byte aligned rows): one
// thread per 8 pairs, moving 16-byte packs of x, out and the f32 tables.
template <class T>
__global__ void rope_packed_kernel(const T* x, const float* cos, const float* sin, float sign,
                                   T* out, int64_t rows, int64_t Tn, int64_t H, int64_t D,
                                   RopeStrides xs, RopeStrides os) {
  const int64_t half = D / 2, row_packs = half / kPack, total = rows * row_packs;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < total;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = p % row_packs, row = p / row_packs;
    const int64_t h = row % H, t = (row / H) % Tn, b = row / (H * Tn);
    const T* in = x + b * xs.b + t * xs.t + h * xs.h;
    T* o = out + b * os.b + t * os.t + h * os.h;
    const Pack8<T> a = load_pack(in, j), bpk = load_pack(in + half, j);
    const Pack8<float> c = load_pack(cos + t * half, j), s = load_pack(sin + t * half, j);
    Pack8<T> lo, hi;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float x1 = to_float(a.v[k]), x2 = to_float(bpk.v[k]), sk = sign * s.v[k];
      lo.v[k] = from_float<T>(x1 * c.v[k] - x2 * sk);
      hi.v[k] = from_float<T>(x2 * c.v[k] + x1 * sk);
    }
    store_pack(o, j, lo);
    store_pack(o + half, j, hi);
  }
}

RopeStrides rope_strides(const Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// 16-byte packs along the head dim: unit stride, every head row on a 16-byte boundary.
bool rope_rows_packable(const RopeStrides& s) {
  return s.d == 1 && s.b % kPack == 0 && s.t % kPack == 0 && s.h % kPack == 0;
}

void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const Tensor& out) {
  KernelContext ctx(out);
  const int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const RopeStrides xs = rope_strides(x), os = rope_strides(out);
  const bool packed = x.dtype() != DType::f64 && half % kPack == 0 && rope_rows_packable(xs) &&
                      rope_rows_packable(os) &&
                      aligned16({x.raw_data(), out.raw_data(), cos.raw_data(), sin.raw_data()});
  const float sign = inverse ? -1.f : 1.f;
  visit_float(x.dtype(), "rope", [&](auto tag) {
    using T = decltype(tag);
    using S = acc_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    T* op = static_cast<T*>(out.raw_data());
    if constexpr (!std::is_same_v<T, double>) {
      if (packed) {
        rope_packed_kernel<T><<<grid_for(B * Tn * H * (half / kPack)), kThreads, 0, ctx.stream>>>(
            xp, cos.data<float>(), sin.data<float>(), sign, op, B * Tn * H, Tn, H, D, xs, os);
        TESSERA_KERNEL_CHECK("rope_packed_kernel");
        return;
      }
    }
    rope_kernel<T, S><<<grid_for(B * Tn * H * half), kThreads, 0, ctx.stream>>>(
        xp, static_cast<const S*>(cos.raw_data()), static_cast<const S*>(sin.raw_data()), sign, op,
        B, Tn, H, D, xs, os);
    TESSERA_KERNEL_CHECK("rope_kernel");
  });
}

const bool registered = [] {
  kernel_table(DeviceType::CUDA).rope = rope;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
