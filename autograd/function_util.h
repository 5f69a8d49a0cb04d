// Small helpers shared by the differentiable functions (internal to autograd/).
#pragma once
#include <utility>
#include <vector>

#include "tessera/autograd/autograd.h"
#include "tessera/kernels/ops.h"

namespace tessera::autograd::util {

// A broadcast gradient summed back to its input's shape (no work when equal).
inline Tensor sum_to_shape(const Tensor& grad, const Shape& shape) {
  return grad.shape() == shape ? grad : ops::sum_to(grad, shape);
}

// ops::reshape that also handles a 0-d tensor (whose ops::reshape to an all-ones shape
// such as [1, 1] is refused by core at the time of writing): one element, any shape of
// numel 1, as a broadcast view.
inline Tensor reshape_grad(const Tensor& grad, const Shape& shape) {
  return grad.dim() == 0 ? ops::expand(grad, shape) : ops::reshape(grad, shape);
}

// Where a backward may write input i's gradient, computed as a contiguous result of `shape`
// and `dtype`, instead of allocating it: the destination offered for overwriting when its
// memory is exactly that, or with `transposed` (a matrix) when its transpose is (a torch-layout
// weight used as weight.t() sees its destination transposed); else undefined. The backward
// fills the returned tensor, then returns a.destination(i)->tensor itself as the gradient.
inline Tensor overwrite_target(const BackwardArgs& a, size_t i, const Shape& shape, DType dtype,
                               bool transposed = false) {
  const GradDestination* d = a.destination(i);
  if (d == nullptr || d->accumulate || d->tensor.dtype() != dtype) return Tensor();
  if (transposed && d->tensor.dim() != 2) return Tensor();
  Tensor target = transposed ? ops::transpose(d->tensor, 0, 1) : d->tensor;
  return target.shape() == shape && target.is_contiguous() ? target : Tensor();
}

// Input i's gradient `grad` as the backward returns it: added into the destination offered for
// accumulating (and that destination returned) when there is one of grad's shape and dtype;
// else grad itself. The same values as the engine's sum of the two.
inline Tensor add_into_destination(const BackwardArgs& a, size_t i, const Tensor& grad) {
  const GradDestination* d = a.destination(i);
  if (d == nullptr || !d->accumulate || !grad.defined() || grad.is_same(d->tensor) ||
      grad.shape() != d->tensor.shape() || grad.dtype() != d->tensor.dtype())
    return grad;
  ops::binary_(BinaryOp::Add, d->tensor, grad);
  return d->tensor;
}

// A bool mask as 0/1 values of `dtype`, to multiply gradients with.
inline Tensor mask_as(const Tensor& mask, DType dtype) {
  return ops::to(mask, mask.device(), dtype);
}

// A 0-d tensor holding `value`, of t's dtype and device.
inline Tensor scalar_like(double value, const Tensor& t) {
  return full({}, value, {.dtype = t.dtype(), .device = t.device()});
}

// Reduction dims wrapped into [0, ndim), sorted and unique; empty means all.
inline std::vector<int64_t> reduced_dims(const std::vector<int64_t>& dims, int64_t ndim,
                                         const char* op) {
  std::vector<bool> reduced(ndim, dims.empty());
  for (int64_t d : dims) reduced[wrap_dim(d, ndim, op)] = true;
  std::vector<int64_t> out;
  for (int64_t d = 0; d < ndim; ++d) {
    if (reduced[d]) out.push_back(d);
  }
  return out;
}

// `shape` with the reduced dims set to 1 (the keepdim shape of a reduction).
inline Shape keepdim_shape(Shape shape, const std::vector<int64_t>& sorted_dims) {
  for (int64_t d : sorted_dims) shape[d] = 1;
  return shape;
}

// `shape` without the reduced dims (the shape of a reduction without keepdim).
inline Shape drop_dims(const Shape& shape, const std::vector<int64_t>& sorted_dims) {
  Shape out;
  size_t next = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (next < sorted_dims.size() && sorted_dims[next] == d) {
      ++next;
    } else {
      out.push_back(shape[d]);
    }
  }
  return out;
}

// The matrix transpose of the last two dims.
inline Tensor mT(const Tensor& t) { return ops::transpose(t, -2, -1); }

// t as a matrix [rows, last dim] with every leading dim folded into the rows; unlike a
// reshape to {-1, n} this also holds when a dim is 0 (the -1 would be ambiguous).
inline Tensor fold_rows(const Tensor& t) {
  const Shape leading(t.shape().begin(), t.shape().end() - 1);
  return ops::reshape(t, {shape_numel(leading), t.size(-1)});
}

// The GEMMs of a Linear (functions_linalg.cpp), for fused nodes that own a projection
// (mlp_gelu in functions_activation.cpp, the attention's c_attn in functions_attention.cpp).
// Whether the fused GEMMs take the operands is the fused-op table's answer
// (fused_linear_operands, kernels/fused_table.h).
// y2 [rows, out] = x2d @ w (+ bias), one GEMM with the bias added in its epilogue where the
// device has one; and dW = x2dᵀ g, written into `into` (contiguous [in, out]) when defined.
Tensor linear_rows(const Tensor& x2d, const Tensor& w, const Tensor& bias);
Tensor linear_weight_grad(const Tensor& x2d, const Tensor& g, const Tensor& into);
// {dW = x2dᵀ g, db = g's column sums}, each only when wanted (else undefined); both from one
// GEMM (the bias gradient in its epilogue) where the device has it. into_w / into_b: memory
// they are written into (contiguous, of their shapes: offered destinations), or undefined.
std::pair<Tensor, Tensor> weight_and_bias_grads(const Tensor& x2d, const Tensor& g, bool want_w,
                                                bool want_b, const Tensor& into_w = Tensor(),
                                                const Tensor& into_b = Tensor());

}  // namespace tessera::autograd::util
