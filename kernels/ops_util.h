// Helpers shared by the op front-ends (kernels/ops_*.cpp): operand checks with messages
// that name the op, shapes, dtypes and devices, and access to the dispatch row.
#pragma once
#include <initializer_list>
#include <string>

#include "tessera/core/dispatch.h"
#include "tessera/core/tensor.h"

namespace tessera::ops::detail {

// "float32[2, 3] on cpu" (or "undefined").
std::string describe(const Tensor& t);

// Checks every operand is defined and all share one device; returns it.
Device common_device(const char* op, std::initializer_list<const Tensor*> operands);

// The dispatch row of `device`.
inline const KernelTable& kernels_for(Device device) { return kernel_table(device.type); }

// t expanded (as a view) to `shape` unless it already has it.
inline Tensor expanded(const Tensor& t, const Shape& shape) {
  return t.shape() == shape ? t : raw::expand(t, shape);
}

// Reduction dims wrapped, sorted and de-duplicated; empty `dims` means all dims.
std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op);

// A 0-d tensor holding `value` in `dtype` on `device`.
Tensor scalar_tensor(double value, DType dtype, Device device);

// A tensor that must match x (the residual stream's other term or its gradient, in the fused
// residual norms): same shape and device, else an error naming `op` and `what`; one in another
// dtype comes back converted to x's.
Tensor like_input(const char* op, const char* what, const Tensor& t, const Tensor& x);

}  // namespace tessera::ops::detail
