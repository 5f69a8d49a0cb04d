// One AdamW update of one element, shared by every AdamW Tessera runs: the CPU loop
// (optim/adamw_cpu.cpp, which ZeRO-Offload's host optimizer is) and the CUDA multi-tensor
// kernel (kernels/cuda/multi_tensor.cu). Both take the same coefficients, computed once per
// step on the host in double and rounded to the moments' precision (adamw_coefficients), and
// run the same float operations in the same order, each rounded once:
//
//   p' = p·decay                                    decay     = 1 - lr·weight_decay
//   m  = β1·m + (1-β1)·g
//   v  = β2·v + ((1-β2)·g)·g
//   p' = p' - step_size·(m / (sqrt(v)/bc2_sqrt + eps))   step_size = lr / (1 - β1^t),
//                                                        bc2_sqrt  = sqrt(1 - β2^t)
//
// (PyTorch's order for torch.optim.AdamW.) So a GPU and a CPU given the same inputs produce
// the same bits, which is what lets ZeRO-Offload (AdamW on the host) match DDP (AdamW on the
// device) exactly. That needs every operation rounded on its own: no a·b+c fused into one
// FMA. On the device the operations are the _rn intrinsics, which nvcc never contracts; on
// the host the translation units that call adamw_update_element or compute the coefficients
// are compiled with -ffp-contract=off (CMakeLists.txt), and none may use -ffast-math.
#pragma once
#include <cmath>
#include <cstdint>

#include "tessera/core/half.h"  // TESSERA_HD

#if defined(__FAST_MATH__)
#error "AdamW's update must round every operation as IEEE does: build without -ffast-math"
#endif

namespace tessera {

// The per-step scalars of AdamW, in the precision of the update (A = float or double).
template <class A>
struct AdamWCoefficients {
  A decay;  // 1 - lr·weight_decay (1 exactly without weight decay)
  A beta1, one_minus_beta1;
  A beta2, one_minus_beta2;
  A step_size;              // lr / (1 - β1^step)
  A bias_correction2_sqrt;  // sqrt(1 - β2^step)
  A eps;
};

// Step `step` (1 on the first update) of AdamW, computed in double. Its float form is
// rounded_to<float>(): each value rounded once. One definition (core/adamw_math.cpp, compiled
// without FMA contraction) serves the CPU, the CUDA backend and graph replays alike.
AdamWCoefficients<double> adamw_coefficients(double lr, double beta1, double beta2, double eps,
                                             double weight_decay, int64_t step);

template <class A>
AdamWCoefficients<A> rounded_to(const AdamWCoefficients<double>& c) {
  return {static_cast<A>(c.decay),
          static_cast<A>(c.beta1),
          static_cast<A>(c.one_minus_beta1),
          static_cast<A>(c.beta2),
          static_cast<A>(c.one_minus_beta2),
          static_cast<A>(c.step_size),
          static_cast<A>(c.bias_correction2_sqrt),
          static_cast<A>(c.eps)};
}

namespace rn {
// Each operation rounded once to nearest. On a CUDA device: the _rn intrinsics (never
// contracted into FMAs, whatever -fmad says); elsewhere the plain operators.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqrt(double a) { return __dsqrt_rn(a); }
#else
template <class A>
inline A mul(A a, A b) {
  return a * b;
}
template <class A>
inline A add(A a, A b) {
  return a + b;
}
template <class A>
inline A sub(A a, A b) {
  return a - b;
}
template <class A>
inline A div(A a, A b) {
  return a / b;
}
template <class A>
inline A sqrt(A a) {
  return std::sqrt(a);
}
#endif
}  // namespace rn

// Updates the moments m and v in place and returns the new parameter value.
template <class A>
TESSERA_HD A adamw_update_element(A param, A grad, A& m, A& v, const AdamWCoefficients<A>& c) {
  const A decayed = rn::mul(param, c.decay);
  const A new_m = rn::add(rn::mul(c.beta1, m), rn::mul(c.one_minus_beta1, grad));
  const A new_v = rn::add(rn::mul(c.beta2, v), rn::mul(rn::mul(c.one_minus_beta2, grad), grad));
  m = new_m;
  v = new_v;
  const A denom = rn::add(rn::div(rn::sqrt(new_v), c.bias_correction2_sqrt), c.eps);
  return rn::sub(decayed, rn::mul(c.step_size, rn::div(new_m, denom)));
}

}  // namespace tessera
