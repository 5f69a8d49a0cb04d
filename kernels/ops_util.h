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

// The checks the op families share, each naming the op and the operand's role.
inline void check_float(const char* op, const Tensor& t, const char* role) {
  TESSERA_CHECK(is_floating(t.dtype()), op, ": ", role, " must be a float tensor, got ",
                describe(t));
}

inline void check_same_shape(const char* op, const Tensor& a, const char* a_role, const Tensor& b,
                             const char* b_role) {
  TESSERA_CHECK(a.shape() == b.shape(), op, ": ", a_role, " ", describe(a), " and ", b_role, " ",
                describe(b), " must have the same shape");
}

// `what` ("indices", "index", ...) of an indexing op must be int32 or int64.
inline void check_index_dtype(const char* op, const Tensor& index, const char* what) {
  TESSERA_CHECK(index.dtype() == DType::i32 || index.dtype() == DType::i64, op, ": ", what,
                " must be int32 or int64, got ", describe(index));
}

// x's shape without its last dim: the rows of an op over the last dim (norms, losses).
inline Shape row_shape(const Tensor& x) { return Shape(x.shape().begin(), x.shape().end() - 1); }

// The dtype of saved row statistics (norms) and of rotary tables: f64 for f64 inputs (an f64
// backward stays f64-accurate), f32 otherwise.
inline DType stat_dtype(DType x) { return x == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace tessera::ops::detail
