// CPU kernel of the rotary position embeddings (Hugging Face's rotate_half pairing): pair
// (i, i + D/2) of each head of x [B, T, H, D] rotated by the angle of its position, or back
// with `inverse` (the gradient).
#include <omp.h>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"
#include "tessera/kernels/cpu/row_stats.h"

namespace tessera::cpu {
namespace {

void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), half = x.size(3) / 2;
  visit_dtype(x.dtype(), [&](auto tag) {
    using E = decltype(tag);
    if constexpr (is_float_type_v<E>) {
      using C = compute_t<E>;
      using S = stat_t<E>;
      const E* xp = static_cast<const E*>(x.raw_data());
      E* op = static_cast<E*>(out.raw_data());
      const S* cp = static_cast<const S*>(cos.raw_data());
      const S* sp = static_cast<const S*>(sin.raw_data());
      const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2), sd = x.stride(3);
      const int64_t ob = out.stride(0), ot = out.stride(1), oh = out.stride(2), od = out.stride(3);
      const C sign = inverse ? C(-1) : C(1);
#pragma omp parallel for collapse(2) schedule(static) if (x.numel() >= kParallelGrain)
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const S* ct = cp + t * half;
          const S* stab = sp + t * half;
          for (int64_t h = 0; h < H; ++h) {
            const E* in = xp + b * sb + t * st + h * sh;
            E* o = op + b * ob + t * ot + h * oh;
            for (int64_t i = 0; i < half; ++i) {
              const C x1 = convert<C>(in[i * sd]), x2 = convert<C>(in[(i + half) * sd]);
              const C c = C(ct[i]), s = sign * C(stab[i]);
              o[i * od] = convert<E>(C(x1 * c - x2 * s));
              o[(i + half) * od] = convert<E>(C(x2 * c + x1 * s));
            }
          }
        }
      }
    } else {
      TESSERA_FAIL("rope: dtype ", dtype_name(x.dtype()), " is not a float type");
    }
  });
}

const bool registered = [] {
  kernel_table(DeviceType::CPU).rope = rope;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
