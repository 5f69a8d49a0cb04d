// In-place arithmetic under autograd (add_, sub_, mul_, div_) and the history rewrite of a
// view's base after an in-place write into the view (PyTorch's CopySlices).
//
// An in-place op bumps the tensor's version counter, so a backward that saved the old value
// raises naming the node (SavedTensor::unpack); the tensor's grad_fn becomes the op's node,
// whose inputs are the old value's history and the operand.
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::describe;
using autograd::meta_of;
using autograd::record;
using autograd::SavedTensor;
using autograd::util::sum_to_shape;
using Grads = std::vector<Tensor>;

namespace autograd {

void mark_view(const Tensor& view, const Tensor& input) {
  AutogradMeta& meta = meta_of(view);
  meta.is_view = true;
  const AutogradMeta* input_meta = input.impl().autograd.get();
  meta.view_base = input_meta && input_meta->view_base ? input_meta->view_base : input.impl_ptr();
}

bool is_graph_view(const Tensor& t) {
  const AutogradMeta* meta = t.impl().autograd.get();
  return meta != nullptr && meta->is_view && meta->view_base != nullptr;
}

namespace {

// The view's elements inside a contiguous tensor of the base's shape.
Tensor view_region(const Tensor& like_base, const Tensor& base, const Shape& shape,
                   const Shape& strides, int64_t offset) {
  return ops::as_strided(like_base, shape, strides, like_base.offset() + offset - base.offset());
}

// t's shape with each expanded (stride-0) dim cut to 1: every location t covers, once.
Shape distinct_shape(const Tensor& t) {
  Shape shape = t.shape();
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.stride(d) == 0) shape[d] = 1;
  return shape;
}

}  // namespace

void check_view_write_allowed(const char* op, const Tensor& view) {
  if (!is_grad_enabled() || !is_graph_view(view)) return;
  const Tensor base(meta_of(view).view_base);
  const AutogradMeta* base_meta = base.impl().autograd.get();
  TESSERA_CHECK(!(base_meta && base_meta->requires_grad && !base_meta->grad_fn), op, ": a view (",
                describe(view), ") of a leaf tensor that requires grad (", describe(base),
                ") cannot be modified in place while grad mode is on");
  TESSERA_CHECK(base.is_contiguous(), op, ": writing in place into a view (", describe(view),
                ") of a non-contiguous tensor in a graph (", describe(base),
                ") is not supported; clone the base first");
}

void rebase_view_history(const char* op, const Tensor& view) {
  check_view_write_allowed(op, view);
  const Tensor base(meta_of(view).view_base);
  const Shape shape = view.shape(), strides = view.strides(), distinct = distinct_shape(view);
  // An expanded view (fill_) is handled below; other shared locations would need their
  // gradients summed per location.
  ops::check_no_internal_overlap(op, ops::as_strided(view, distinct, strides, view.offset()));
  const int64_t offset = view.offset();
  const Tensor base_geometry = ops::alias(base);  // geometry only (shape, offset)
  // New base = old base with the region replaced by the view's new value.
  record("CopySlices", {base, view}, {base}, [=](const BackwardArgs& a) {
    Tensor grad_base = ops::clone(a.grad());  // contiguous, the base's shape
    Tensor region = view_region(grad_base, base_geometry, shape, strides, offset);
    Tensor grad_view = a.needs(1) ? ops::clone(region) : Tensor();
    ops::fill_(region, 0.0);
    return Grads{grad_base, grad_view};
  });
  // The view reads the new base from now on; the elements of an expanded dim read one
  // location, which gets their summed gradient.
  record("AsStridedBackward", {base}, {view}, [=](const BackwardArgs& a) {
    Tensor grad_base =
        zeros(base_geometry.shape(), {.dtype = a.grad().dtype(), .device = a.grad().device()});
    const Tensor region = view_region(grad_base, base_geometry, distinct, strides, offset);
    ops::copy_(region, distinct == shape ? a.grad() : ops::sum_to(a.grad(), distinct));
    return Grads{grad_base};
  });
}

}  // namespace autograd

namespace {

// Refuses what PyTorch refuses for `self.op_(...)` under grad mode.
void check_inplace(const char* op, const Tensor& self) {
  ops::check_no_internal_overlap(op, self);
  if (!autograd::is_grad_enabled()) return;
  const autograd::AutogradMeta* meta = self.impl().autograd.get();
  TESSERA_CHECK(!(meta && meta->requires_grad && !meta->grad_fn), op,
                ": a leaf tensor that requires grad (", describe(self),
                ") cannot be modified in place while grad mode is on; wrap it in NoGradGuard");
  autograd::check_view_write_allowed(op, self);
}

// self = op(self, other) in place, recorded when a gradient is needed.
Tensor& inplace_binary(const char* name, BinaryOp op, Tensor& self, const Tensor& other) {
  check_inplace(name, self);
  if (!autograd::any_requires_grad({self, other})) {
    ops::binary_(op, self, other);
    return self;
  }
  const bool self_grad = self.requires_grad(), other_grad = other.requires_grad();
  // What each side's gradient reads: mul needs the other operand and div the divisor; both
  // need self's old value (cloned: the op overwrites it) for d/d(other), as PyTorch saves it.
  SavedTensor saved_other, saved_old_self;
  if ((op == BinaryOp::Mul && self_grad) || op == BinaryOp::Div)
    saved_other = SavedTensor::input(other);
  if ((op == BinaryOp::Mul || op == BinaryOp::Div) && other_grad)
    saved_old_self = SavedTensor::input(ops::clone(self));
  const Shape self_shape = self.shape(), other_shape = other.shape();
  ops::binary_(op, self, other);
  record(name, {self, other}, {self}, [=](const BackwardArgs& a) {
    const Tensor& g = a.grad();
    Tensor grad_self, grad_other;
    switch (op) {
      case BinaryOp::Add:
        grad_self = g, grad_other = g;
        break;
      case BinaryOp::Sub:
        grad_self = g, grad_other = a.needs(1) ? ops::unary(UnaryOp::Neg, g) : Tensor();
        break;
      case BinaryOp::Mul:
        if (a.needs(0)) grad_self = ops::mul(g, saved_other.unpack(name));
        if (a.needs(1)) grad_other = ops::mul(g, saved_old_self.unpack(name));
        break;
      default:  // Div: d(s/o)/ds = 1/o, d(s/o)/do = -s/o^2
        grad_self = ops::div(g, saved_other.unpack(name));
        if (a.needs(1)) {
          const Tensor quotient = ops::div(saved_old_self.unpack(name), saved_other.unpack(name));
          grad_other = ops::unary(UnaryOp::Neg, ops::mul(grad_self, quotient));
        }
        break;
    }
    return Grads{a.needs(0) ? sum_to_shape(grad_self, self_shape) : Tensor(),
                 a.needs(1) ? sum_to_shape(grad_other, other_shape) : Tensor()};
  });
  if (autograd::is_graph_view(self)) autograd::rebase_view_history(name, self);
  return self;
}

Tensor scalar_operand(double value, const Tensor& like) {
  return full({}, value, {.dtype = like.dtype(), .device = like.device()});
}

}  // namespace

Tensor& add_(Tensor& self, const Tensor& other) {
  return inplace_binary("add_", BinaryOp::Add, self, other);
}
Tensor& sub_(Tensor& self, const Tensor& other) {
  return inplace_binary("sub_", BinaryOp::Sub, self, other);
}
Tensor& mul_(Tensor& self, const Tensor& other) {
  return inplace_binary("mul_", BinaryOp::Mul, self, other);
}
Tensor& div_(Tensor& self, const Tensor& other) {
  return inplace_binary("div_", BinaryOp::Div, self, other);
}
Tensor& add_(Tensor& self, double other) { return add_(self, scalar_operand(other, self)); }
Tensor& sub_(Tensor& self, double other) { return sub_(self, scalar_operand(other, self)); }
Tensor& mul_(Tensor& self, double other) { return mul_(self, scalar_operand(other, self)); }
Tensor& div_(Tensor& self, double other) { return div_(self, scalar_operand(other, self)); }

}  // namespace tessera
