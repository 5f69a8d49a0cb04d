// The CPU row's element-wise fused entries (kernels/fused_table.h): dropout with its mask
// drawn in the same pass (the composition's bits: core/philox.h's words, the kept scale of
// dropout_kept_scale), and the exact GELU forward and backward in one pass each
// (core/activation_math.h). The CUDA kernels (kernels/cuda/fused_elementwise.cu) compute the
// same element functions.
#include "tessera/core/activation_math.h"
#include "tessera/core/philox.h"
#include "tessera/kernels/cpu/lanes.h"
#include "tessera/kernels/cpu/strided.h"
#include "tessera/kernels/fused_table.h"

namespace tessera::cpu {
namespace {

// fn(T{}) for the floating element type T of `like` (the callers checked it is one).
template <class Fn>
void each_float_element(const Tensor& like, Fn&& fn) {
  visit_dtype(like.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                  std::is_same_v<T, BFloat16>)
      fn(T{});
  });
}

// out[i] = in[i] * (kept ? scale : 0), four elements per Philox block, as the composition's
// multiply rounds (the product in compute_t, then the dtype).
void dropout_apply(const char* op, const Tensor& in, const DropoutDraw& draw, const Tensor& out) {
  check_elementwise_entry_operands(op, DeviceType::CPU, in, "input", out, "output");
  check_dropout_draw(op, draw);
  const uint64_t keep_from = dropout_keep_from(draw.p);
  const double scale = dropout_kept_scale(draw.p, in.dtype());
  const int64_t n = in.numel();
  each_float_element(in, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* x = static_cast<const T*>(in.raw_data());
    T* y = static_cast<T*>(out.raw_data());
    const C kept = static_cast<C>(scale);
    const int64_t blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
    for (int64_t b = 0; b < blocks; ++b) {
      const Philox4 words = philox4x32_10(draw.seed, draw.offset + static_cast<uint64_t>(b));
      for (int64_t j = 0; j < 4 && 4 * b + j < n; ++j) {
        const int64_t i = 4 * b + j;
        const C mask = words.v[j] >= keep_from ? kept : C(0);
        y[i] = convert<T>(convert<C>(x[i]) * mask);
      }
    }
  });
}

void dropout_forward(const Tensor& x, const DropoutDraw& draw, const Tensor& out) {
  dropout_apply("dropout_forward", x, draw, out);
}
void dropout_backward(const Tensor& dy, const DropoutDraw& draw, const Tensor& dx) {
  dropout_apply("dropout_backward", dy, draw, dx);
}

void gelu_erf_forward(const Tensor& x, const Tensor& out) {
  check_elementwise_entry_operands("gelu_erf_forward", DeviceType::CPU, x, "x", out, "out");
  const int64_t n = x.numel();
  each_float_element(x, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T* in = static_cast<const T*>(x.raw_data());
    T* y = static_cast<T*>(out.raw_data());
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
    for (int64_t i = 0; i < n; ++i) y[i] = convert<T>(gelu_erf_value(convert<C>(in[i])));
  });
}

void gelu_erf_backward(const Tensor& dy, const Tensor& x, const Tensor& dx) {
  check_elementwise_entry_operands("gelu_erf_backward", DeviceType::CPU, x, "x", dy, "dy");
  check_elementwise_entry_operands("gelu_erf_backward", DeviceType::CPU, x, "x", dx, "dx");
  const int64_t n = x.numel();
  each_float_element(x, [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const T *in = static_cast<const T*>(x.raw_data()), *g = static_cast<const T*>(dy.raw_data());
    T* out = static_cast<T*>(dx.raw_data());
#pragma omp parallel for schedule(static) if (n >= kParallelGrain)
    for (int64_t i = 0; i < n; ++i)
      out[i] = convert<T>(convert<C>(g[i]) * gelu_erf_slope(convert<C>(in[i])));
  });
}

const bool registered = [] {
  FusedKernelTable& t = fused_kernel_table(DeviceType::CPU);
  t.dropout_forward = dropout_forward;
  t.dropout_backward = dropout_backward;
  t.gelu_erf_forward = gelu_erf_forward;
  t.gelu_erf_backward = gelu_erf_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
