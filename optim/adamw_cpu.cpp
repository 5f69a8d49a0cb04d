#include "tessera/optim/adamw_cpu.h"

#include "tessera/optim/fused_update.h"

namespace tessera::optim::detail {

namespace {

// Element access by bits for bf16 (a struct copy per element would keep the loops scalar).
template <class T, class A>
inline A load(const T* data, int64_t i) {
  if constexpr (std::is_same_v<T, BFloat16>)
    return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(data)[i]);
  else
    return static_cast<A>(data[i]);
}
template <class T, class A>
inline void store(T* data, int64_t i, A value) {
  if constexpr (std::is_same_v<T, BFloat16>)
    reinterpret_cast<uint16_t*>(data)[i] = float_to_bf16_bits(value);
  else
    data[i] = static_cast<T>(value);
}

// P: the parameter's storage type, G: the gradient's, A: the moments' (and the update's).
template <class P, class G, class A>
void adamw_loop(P* p, const G* g, A* m, A* v, int64_t n, const AdamWCoefficients<A>& c) {
  parallel_ranges(n, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i)
      store(p, i, adamw_update_element(load<P, A>(p, i), load<G, A>(g, i), m[i], v[i], c));
  });
}

template <class P, class G>
void adamw_master_loop(P* p, float* master, const G* g, float* m, float* v, int64_t n,
                       const AdamWCoefficients<float>& c) {
  parallel_ranges(n, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float updated = adamw_update_element(master[i], load<G, float>(g, i), m[i], v[i], c);
      master[i] = updated;
      store(p, i, updated);
    }
  });
}

void check_operands(const char* op, const Tensor& param, const Tensor& grad, const Tensor& m,
                    const Tensor& v, DType moments) {
  TESSERA_CHECK(param.device().is_cpu() && grad.device().is_cpu() && m.device().is_cpu() &&
                    v.device().is_cpu(),
                op, ": every operand must be on the CPU");
  TESSERA_CHECK(
      param.is_contiguous() && grad.is_contiguous() && m.is_contiguous() && v.is_contiguous(), op,
      ": every operand must be contiguous");
  TESSERA_CHECK(
      grad.numel() == param.numel() && m.numel() == param.numel() && v.numel() == param.numel(), op,
      ": parameter of ", param.numel(), " elements, gradient of ", grad.numel(), ", moments of ",
      m.numel(), " and ", v.numel());
  TESSERA_CHECK(m.dtype() == moments && v.dtype() == moments, op, ": moments must be ",
                dtype_name(moments), " for ", dtype_name(param.dtype()), " parameters, got ",
                dtype_name(m.dtype()), " and ", dtype_name(v.dtype()));
}

}  // namespace

void adamw_cpu(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               const AdamWCoefficients<double>& coeffs) {
  check_operands("adamw_cpu", param, grad, m, v, state_dtype(param.dtype()));
  TESSERA_CHECK(grad.dtype() == param.dtype(), "adamw_cpu: gradient ", dtype_name(grad.dtype()),
                " for a ", dtype_name(param.dtype()), " parameter");
  const int64_t n = param.numel();
  visit_dtype(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      adamw_loop<T, T, double>(param.data<T>(), grad.data<T>(), m.data<double>(), v.data<double>(),
                               n, coeffs);
    } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Half> ||
                         std::is_same_v<T, BFloat16>) {
      adamw_loop<T, T, float>(param.data<T>(), grad.data<T>(), m.data<float>(), v.data<float>(), n,
                              rounded_to<float>(coeffs));
    } else {
      TESSERA_CHECK(false, "adamw_cpu: ", dtype_name(param.dtype()),
                    " parameters cannot be trained (floating dtypes only)");
    }
  });
}

void adamw_cpu_master(const Tensor& param, const Tensor& master, const Tensor& grad,
                      const Tensor& m, const Tensor& v, const AdamWCoefficients<double>& coeffs) {
  check_operands("adamw_cpu_master", master, grad, m, v, DType::f32);
  TESSERA_CHECK(master.dtype() == DType::f32 && param.device().is_cpu() && param.is_contiguous() &&
                    param.numel() == master.numel() &&
                    (param.dtype() == DType::f16 || param.dtype() == DType::bf16) &&
                    (grad.dtype() == param.dtype() || grad.dtype() == DType::f32),
                "adamw_cpu_master: needs a contiguous f16/bf16 parameter of ", master.numel(),
                " elements on the CPU with an f32 master and a gradient in its dtype or f32, "
                "got a ",
                dtype_name(param.dtype()), " parameter of ", param.numel(), " elements, master ",
                dtype_name(master.dtype()), ", gradient ", dtype_name(grad.dtype()));
  const AdamWCoefficients<float> c = rounded_to<float>(coeffs);
  const int64_t n = master.numel();
  visit_dtype(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
      if (grad.dtype() == DType::f32)
        adamw_master_loop<T, float>(param.data<T>(), master.data<float>(), grad.data<float>(),
                                    m.data<float>(), v.data<float>(), n, c);
      else
        adamw_master_loop<T, T>(param.data<T>(), master.data<float>(), grad.data<T>(),
                                m.data<float>(), v.data<float>(), n, c);
    }
  });
}

}  // namespace tessera::optim::detail
