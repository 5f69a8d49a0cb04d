#include "tessera/autograd/autocast.h"

#include "tessera/core/error.h"

namespace tessera::autograd {

namespace {
thread_local std::optional<DType> compute_dtype;
}  // namespace

AutocastGuard::AutocastGuard(DType compute) : previous_(compute_dtype) {
  TESSERA_CHECK(compute == DType::bf16 || compute == DType::f16 || compute == DType::f32,
                "AutocastGuard: compute dtype must be bf16, f16 or f32, got ", dtype_name(compute));
  compute_dtype = compute == DType::f32 ? std::nullopt : std::optional<DType>(compute);
}

AutocastGuard::~AutocastGuard() { compute_dtype = previous_; }

std::optional<DType> autocast_dtype() { return compute_dtype; }

Tensor autocast(const Tensor& x) {
  if (!compute_dtype || !x.defined()) return x;
  const DType d = x.dtype();
  if (d != DType::f32 && d != DType::f16 && d != DType::bf16) return x;
  return d == *compute_dtype ? x : x.to(*compute_dtype);
}

}  // namespace tessera::autograd
