// Tensor's view/copy members and autograd interface (declared in core/tensor.h).
//
// Views compute with the tape-free ops:: versions and record a node whose backward
// maps the gradient back to the input's geometry. In-place writes (copy_, fill_)
// follow PyTorch: refused on a leaf that requires grad while grad mode is on, and
// otherwise they rewrite the tensor's history (its new grad_fn cuts the old value
// off and passes the gradient to the source of the copy).
#include <functional>

#include "tessera/autograd/autograd.h"
#include "tessera/core/autograd_hooks.h"
#include "tessera/kernels/ops.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::describe;
using autograd::meta_of;

namespace {

using ViewFn = std::function<Tensor(const Tensor&)>;

// Records a view op; `backward` maps the output gradient to the input's geometry. For a view
// that only re-lays its input out, `forward_view` is the op itself on a tensor of the input's
// geometry (the gradient of the input is then exactly `backward` of that view's gradient), so
// the engine can hand a leaf's gradient destination on through it (Node::destination_view).
Tensor record_view(const char* name, const Tensor& input, const Tensor& out, ViewFn backward,
                   ViewFn forward_view = nullptr) {
  if (out.is_same(input)) return out;  // the op was the identity (e.g. contiguous())
  auto node = autograd::record(name, {input}, {out},
                               [backward = std::move(backward)](const BackwardArgs& a) {
                                 return std::vector<Tensor>{backward(a.grad())};
                               });
  if (node) {
    if (out.shares_storage(input)) autograd::mark_view(out, input);
    node->destination_view = std::move(forward_view);
  }
  return out;
}

// Gradient of a view that takes a region of its input: zeros with the region filled.
Tensor record_region_view(const char* name, const Tensor& input, const Tensor& out,
                          std::function<Tensor(const Tensor&)> same_view) {
  const Shape input_shape = input.shape();
  return record_view(
      name, input, out, [input_shape, same_view = std::move(same_view)](const Tensor& g) {
        Tensor full_grad = zeros(input_shape, {.dtype = g.dtype(), .device = g.device()});
        ops::copy_(same_view(full_grad), g);
        return full_grad;
      });
}

// Gradient of a view that only renames the elements' shape.
Tensor record_reshape(const char* name, const Tensor& input, const Tensor& out) {
  const Shape input_shape = input.shape(), out_shape = out.shape();
  return record_view(
      name, input, out, [input_shape](const Tensor& g) { return ops::reshape(g, input_shape); },
      [out_shape](const Tensor& t) { return ops::reshape(t, out_shape); });
}

// Refuses in-place writes PyTorch refuses. `may_overlap`: a write of one value (fill_), which
// PyTorch lets into memory that several elements share (an expanded view).
void check_inplace_allowed(const char* op, const Tensor& self, bool may_overlap = false) {
  if (!may_overlap) ops::check_no_internal_overlap(op, self);
  if (!autograd::is_grad_enabled()) return;
  const autograd::AutogradMeta* meta = self.impl().autograd.get();
  if (meta == nullptr) return;
  TESSERA_CHECK(!(meta->requires_grad && !meta->grad_fn), op,
                ": a leaf tensor that requires grad (", describe(self),
                ") cannot be modified in place while grad mode is on; wrap it in NoGradGuard");
  autograd::check_view_write_allowed(op, self);
}

}  // namespace

// ---- views ----

Tensor Tensor::view(const Shape& s) const {
  return record_reshape("ViewBackward", *this, ops::view(*this, s));
}
Tensor Tensor::reshape(const Shape& s) const {
  return record_reshape("ReshapeBackward", *this, ops::reshape(*this, s));
}
Tensor Tensor::flatten(int64_t start, int64_t end) const {
  return record_reshape("FlattenBackward", *this, ops::flatten(*this, start, end));
}
Tensor Tensor::squeeze(int64_t d) const {
  return record_reshape("SqueezeBackward", *this, ops::squeeze(*this, d));
}
Tensor Tensor::squeeze() const {
  return record_reshape("SqueezeBackward", *this, ops::squeeze(*this));
}
Tensor Tensor::unsqueeze(int64_t d) const {
  return record_reshape("UnsqueezeBackward", *this, ops::unsqueeze(*this, d));
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  const ViewFn swap = [d0, d1](const Tensor& t) { return ops::transpose(t, d0, d1); };
  return record_view("TransposeBackward", *this, ops::transpose(*this, d0, d1), swap, swap);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  Tensor out = ops::permute(*this, dims);
  std::vector<int64_t> inverse(dims.size());
  for (size_t i = 0; i < dims.size(); ++i)
    inverse[wrap_dim(dims[i], dim(), "permute")] = static_cast<int64_t>(i);
  return record_view(
      "PermuteBackward", *this, out,
      [inverse](const Tensor& g) { return ops::permute(g, inverse); },
      [dims](const Tensor& t) { return ops::permute(t, dims); });
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return record_region_view("NarrowBackward", *this, ops::narrow(*this, d, start, length),
                            [=](const Tensor& t) { return ops::narrow(t, d, start, length); });
}
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return record_region_view("SliceBackward", *this, ops::slice(*this, d, start, end, step),
                            [=](const Tensor& t) { return ops::slice(t, d, start, end, step); });
}
Tensor Tensor::select(int64_t d, int64_t index) const {
  return record_region_view("SelectBackward", *this, ops::select(*this, d, index),
                            [=](const Tensor& t) { return ops::select(t, d, index); });
}

Tensor Tensor::expand(const Shape& s) const {
  const Shape input_shape = shape();
  return record_view("ExpandBackward", *this, ops::expand(*this, s),
                     [input_shape](const Tensor& g) { return ops::sum_to(g, input_shape); });
}

// ---- copies ----

Tensor Tensor::contiguous() const {
  return record_view("ContiguousBackward", *this, ops::contiguous(*this),
                     [](const Tensor& g) { return g; });
}
Tensor Tensor::clone() const {
  return record_view("CloneBackward", *this, ops::clone(*this), [](const Tensor& g) { return g; });
}
Tensor Tensor::to(Device d, DType t) const {
  const Device input_device = device();
  const DType input_dtype = dtype();
  return record_view("ToBackward", *this, ops::to(*this, d, t),
                     [=](const Tensor& g) { return ops::to(g, input_device, input_dtype); });
}
Tensor Tensor::to(Device d) const { return to(d, dtype()); }
Tensor Tensor::to(DType t) const { return to(device(), t); }

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace_allowed("copy_", *this);
  const bool rewrites_history = autograd::any_requires_grad({*this, src});
  ops::copy_(*this, src);
  if (rewrites_history) {
    // Inputs are the old value (fully overwritten: no gradient) and the source.
    const Shape src_shape = src.shape();
    autograd::record("CopyBackward", {*this, src}, {*this}, [src_shape](const BackwardArgs& a) {
      return std::vector<Tensor>{Tensor(),
                                 a.needs(1) ? ops::sum_to(a.grad(), src_shape) : Tensor()};
    });
    if (autograd::is_graph_view(*this)) autograd::rebase_view_history("copy_", *this);
  }
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_inplace_allowed("fill_", *this, /*may_overlap=*/true);
  const bool rewrites_history = autograd::any_requires_grad({*this});
  ops::fill_(*this, value);
  if (rewrites_history) {
    autograd::record("FillBackward", {*this}, {*this},
                     [](const BackwardArgs&) { return std::vector<Tensor>{Tensor()}; });
    if (autograd::is_graph_view(*this)) autograd::rebase_view_history("fill_", *this);
  }
  return *this;
}

// ---- autograd interface ----

bool Tensor::requires_grad() const {
  const autograd::AutogradMeta* meta = impl().autograd.get();
  return meta != nullptr && (meta->requires_grad || meta->grad_fn != nullptr);
}

Tensor& Tensor::requires_grad_(bool on) {
  if (!is_leaf()) {
    TESSERA_CHECK(on,
                  "requires_grad_: only leaf tensors can stop requiring grad; this one was "
                  "made by ",
                  impl().autograd->grad_fn->name, " (use detach())");
    return *this;
  }
  TESSERA_CHECK(!on || is_floating(dtype()),
                "requires_grad_: only floating-point tensors can "
                "require grad, got ",
                describe(*this));
  if (on || impl().autograd) meta_of(*this).requires_grad = on;
  return *this;
}

// Core's factories reach requires_grad_ through this hook (core/autograd_hooks.h).
namespace {
const bool autograd_hooks_installed = [] {
  install_autograd_hooks({.set_requires_grad = [](const Tensor& t, bool on) {
    Tensor(t.impl_ptr()).requires_grad_(on);
  }});
  return true;
}();
}  // namespace

Tensor Tensor::grad() const {
  const autograd::AutogradMeta* meta = impl().autograd.get();
  return meta != nullptr ? meta->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    TESSERA_CHECK(g.shape() == shape() && g.dtype() == dtype() && g.device() == device(),
                  "set_grad: gradient (", describe(g), ") does not match the tensor (",
                  describe(*this), ")");
  }
  meta_of(*this).grad = g;
}

bool Tensor::is_leaf() const {
  const autograd::AutogradMeta* meta = impl().autograd.get();
  return meta == nullptr || meta->grad_fn == nullptr;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph);
}

Tensor Tensor::detach() const { return ops::alias(*this); }

}  // namespace tessera
