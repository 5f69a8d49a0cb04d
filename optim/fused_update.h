// Shared plumbing of the optimizers' fused per-parameter loops (internal to optim/).
//
// Each optimizer walks every element of a parameter once per step in one loop
// (CPU: OpenMP over chunks, or the calling thread's RangeRunner: optim/host_parallel.h);
// what differs is the per-element formula. These helpers
// give that loop its operands: the parameter's memory (contiguous), its gradient
// in the parameter's dtype, and moment buffers.
#pragma once
#include <omp.h>

#include <algorithm>
#include <functional>

#include "tessera/core/tensor.h"
#include "tessera/kernels/ops.h"
#include "tessera/optim/host_parallel.h"

namespace tessera::optim::detail {

// Splits [0, n) into one contiguous range per thread — the calling thread's RangeRunner's
// when it has one, else OpenMP's; small tensors run inline.
template <class Fn>
void parallel_ranges(int64_t n, Fn&& fn) {
  constexpr int64_t kSerialBelow = 1 << 15;
  if (n < kSerialBelow) {
    fn(int64_t{0}, n);
    return;
  }
  if (const RangeRunner* runner = current_range_runner()) {
    (*runner)(n, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
    return;
  }
  if (omp_get_max_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t chunk = (n + threads - 1) / threads;
    const int64_t begin = std::min(n, t * chunk);
    const int64_t end = std::min(n, begin + chunk);
    if (begin < end) fn(begin, end);
  }
}

// The gradient of p as a contiguous tensor of p's dtype on p's device.
inline Tensor grad_like_param(const Tensor& p, const Tensor& grad, const char* op) {
  TESSERA_CHECK(grad.shape() == p.shape(), op, ": gradient shape ", shape_str(grad.shape()),
                " differs from parameter shape ", shape_str(p.shape()));
  TESSERA_CHECK(grad.device() == p.device(), op, ": gradient on ", grad.device().str(),
                " but parameter on ", p.device().str());
  Tensor g = grad.dtype() == p.dtype() ? grad : ops::to(grad, p.device(), p.dtype());
  return ops::contiguous(g);
}

// Runs update(contiguous view of p) and writes back when p itself is not contiguous;
// bumps p's version like any in-place write.
inline void update_in_place(const Tensor& p, const std::function<void(const Tensor&)>& update) {
  if (p.is_contiguous()) {
    update(p);
  } else {
    Tensor work = ops::contiguous(p);
    update(work);
    ops::copy_(p, work);
  }
  p.impl().version++;
}

// The dtype moments are kept in: f32 for low-precision parameters, else the parameter's.
inline DType state_dtype(DType param) { return param == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace tessera::optim::detail
