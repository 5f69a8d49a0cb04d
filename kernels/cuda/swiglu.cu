// SwiGLU, Llama's MLP activation, in one pass each way instead of a chain of elementwise ops:
//   forward:  out = silu(gate) * up, silu(g) = g * s, s = sigmoid(g)
//   backward: dgate = dout * up * s * (1 + g (1 - s)),  dup = dout * silu(gate)
// Every element is independent; the math runs in the accumulation type (f32 for 16-bit and
// f32 inputs, f64 for f64). Contiguous tensors of one shape; 8-element packs when aligned.
#include <cmath>

#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"

namespace tessera::cuda {
namespace {

template <class A>
__device__ __forceinline__ A sigmoid_of(A g) {
  return A(1) / (A(1) + exp(-g));
}

// Each elementwise pass: n elements of the operands at the given pointers, by packs when
// `packed` (all pointers 16-byte aligned, n a multiple of 8), else one element per step.
template <class T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* out, int64_t n, bool packed) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  auto one = [](T g, T u) {
    const A gf = to_acc<A>(g);
    return from_acc<T>(gf * sigmoid_of(gf) * to_acc<A>(u));
  };
  if (packed) {
    for (int64_t p = start; p < n / kPack; p += stride) {
      const Pack8<T> g = load_pack(gate, p), u = load_pack(up, p);
      Pack8<T> o;
#pragma unroll
      for (int j = 0; j < kPack; ++j) o.v[j] = one(g.v[j], u.v[j]);
      store_pack(out, p, o);
    }
    return;
  }
  for (int64_t i = start; i < n; i += stride) out[i] = one(gate[i], up[i]);
}

template <class T>
__global__ void swiglu_backward_kernel(const T* dout, const T* gate, const T* up, T* dgate, T* dup,
                                       int64_t n, bool packed) {
  using A = acc_t<T>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  auto one = [](T d_in, T g_in, T u_in, T& dg, T& du) {
    const A d = to_acc<A>(d_in), g = to_acc<A>(g_in), u = to_acc<A>(u_in);
    const A s = sigmoid_of(g);
    dg = from_acc<T>(d * u * s * (A(1) + g * (A(1) - s)));
    du = from_acc<T>(d * g * s);
  };
  if (packed) {
    for (int64_t p = start; p < n / kPack; p += stride) {
      const Pack8<T> d = load_pack(dout, p), g = load_pack(gate, p), u = load_pack(up, p);
      Pack8<T> dg, du;
#pragma unroll
      for (int j = 0; j < kPack; ++j) one(d.v[j], g.v[j], u.v[j], dg.v[j], du.v[j]);
      store_pack(dgate, p, dg);
      store_pack(dup, p, du);
    }
    return;
  }
  for (int64_t i = start; i < n; i += stride) one(dout[i], gate[i], up[i], dgate[i], dup[i]);
}

void check_operands(const char* op,
                    std::initializer_list<std::pair<const char*, const Tensor*>> all) {
  const Tensor& first = *all.begin()->second;
  for (auto [name, t] : all)
    TESSERA_CHECK(
        t->defined() && t->shape() == first.shape() && t->dtype() == first.dtype() &&
            t->device() == first.device() && t->is_contiguous() && is_floating(t->dtype()) &&
            t->device().is_cuda(),
        op, ": ", name, " must be a contiguous floating CUDA tensor shaped and typed like ",
        all.begin()->first, " (", shape_str(first.shape()), " ", dtype_name(first.dtype()),
        "), got ",
        t->defined()
            ? shape_str(t->shape()) + " " + dtype_name(t->dtype()) + " on " + t->device().str()
            : std::string("an undefined tensor"));
}

}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  check_operands("swiglu_forward", {{"gate", &gate}, {"up", &up}, {"out", &out}});
  const int64_t n = gate.numel();
  if (n == 0) return;
  KernelContext ctx(out);
  const bool packed = n % kPack == 0 && aligned16({gate.raw_data(), up.raw_data(), out.raw_data()});
  visit_float(gate.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<grid_for(packed ? n / kPack : n), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(gate.raw_data()), static_cast<const T*>(up.raw_data()),
        static_cast<T*>(out.raw_data()), n, packed);
  });
  TESSERA_KERNEL_CHECK("swiglu_forward_kernel");
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup) {
  check_operands("swiglu_backward",
                 {{"gate", &gate}, {"dout", &dout}, {"up", &up}, {"dgate", &dgate}, {"dup", &dup}});
  const int64_t n = gate.numel();
  if (n == 0) return;
  KernelContext ctx(dgate);
  const bool packed = n % kPack == 0 && aligned16({dout.raw_data(), gate.raw_data(), up.raw_data(),
                                                   dgate.raw_data(), dup.raw_data()});
  visit_float(gate.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_for(packed ? n / kPack : n), kThreads, 0, ctx.stream>>>(
        static_cast<const T*>(dout.raw_data()), static_cast<const T*>(gate.raw_data()),
        static_cast<const T*>(up.raw_data()), static_cast<T*>(dgate.raw_data()),
        static_cast<T*>(dup.raw_data()), n, packed);
  });
  TESSERA_KERNEL_CHECK("swiglu_backward_kernel");
}

}  // namespace tessera::cuda
