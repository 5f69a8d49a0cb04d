// Differentiable scans and selection: gather, scatter, scatter_add, index_select, max/min over
// a dim with their indices, topk, cumsum. The gradient of a selection scatters back to the
// positions it read (scatter_add), and that of a scatter gathers from the positions it wrote.
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

namespace {

// A gradient of `shape` that is zero except for g added at the positions index names.
Tensor scatter_grad(const Tensor& g, const Shape& shape, int64_t dim, const Tensor& index) {
  return ops::scatter_add(zeros(shape, {.dtype = g.dtype(), .device = g.device()}), dim, index, g);
}

// g (the index's shape) placed in the corner of zeros of src's shape (scatter reads only
// the index-shaped corner of a larger src).
Tensor pad_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor full_grad = zeros(shape, {.dtype = g.dtype(), .device = g.device()});
  Tensor corner = full_grad;
  for (int64_t d = 0; d < g.dim(); ++d) corner = ops::narrow(corner, d, 0, g.size(d));
  ops::copy_(corner, g);
  return full_grad;
}

// The values and indices of a selection along dim, with the values' gradient scattered back.
ValuesIndices record_selection(const char* name, const Tensor& x, int64_t dim, Tensor values,
                               Tensor indices) {
  record(name, {x}, {values},
         [name, dim, shape = x.shape(), si = SavedTensor::input(indices)](const BackwardArgs& a) {
           return Grads{scatter_grad(a.grad(), shape, dim, si.unpack(name))};
         });
  return {values, indices};
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  Tensor y = ops::gather(x, dim, index);
  if (!autograd::any_requires_grad({x})) return y;
  const int64_t d = wrap_dim(dim, std::max<int64_t>(x.dim(), 1), "gather");
  record("GatherBackward", {x, index}, {y},
         [d, shape = x.shape(), si = SavedTensor::input(index)](const BackwardArgs& a) {
           if (shape.empty()) return Grads{a.grad(), Tensor()};
           return Grads{scatter_grad(a.grad(), shape, d, si.unpack("GatherBackward")), Tensor()};
         });
  return y;
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor y = ops::scatter_add(x, dim, index, src);
  if (!autograd::any_requires_grad({x, src})) return y;
  record("ScatterAddBackward", {x, index, src}, {y},
         [dim, src_shape = src.shape(), si = SavedTensor::input(index)](const BackwardArgs& a) {
           Tensor grad_src;
           if (a.needs(2))
             grad_src =
                 pad_to(ops::gather(a.grad(), dim, si.unpack("ScatterAddBackward")), src_shape);
           return Grads{a.needs(0) ? a.grad() : Tensor(), Tensor(), grad_src};
         });
  return y;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor y = ops::scatter(x, dim, index, src);
  if (!autograd::any_requires_grad({x, src})) return y;
  record("ScatterBackward", {x, index, src}, {y},
         [dim, src_shape = src.shape(), si = SavedTensor::input(index)](const BackwardArgs& a) {
           const Tensor index = si.unpack("ScatterBackward");
           Tensor grad_x, grad_src;
           // Overwritten positions pass nothing back to x; they pass their gradient to src.
           if (a.needs(0)) {
             const Tensor nothing =
                 zeros(index.shape(), {.dtype = a.grad().dtype(), .device = a.grad().device()});
             grad_x = ops::scatter(a.grad(), dim, index, nothing);
           }
           if (a.needs(2)) grad_src = pad_to(ops::gather(a.grad(), dim, index), src_shape);
           return Grads{grad_x, Tensor(), grad_src};
         });
  return y;
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  Tensor y = ops::index_select(x, dim, index);
  if (!autograd::any_requires_grad({x})) return y;
  const int64_t d = wrap_dim(dim, x.dim(), "index_select");
  record("IndexSelectBackward", {x, index}, {y},
         [d, shape = x.shape(), si = SavedTensor::input(index)](const BackwardArgs& a) {
           Tensor grad = zeros(shape, {.dtype = a.grad().dtype(), .device = a.grad().device()});
           ops::index_add_(grad, d, si.unpack("IndexSelectBackward"), ops::contiguous(a.grad()));
           return Grads{grad, Tensor()};
         });
  return y;
}

namespace {
// max/min along a dim: the gradient goes to the position argmax/argmin chose (as PyTorch).
ValuesIndices extreme_along(const char* name, bool is_max, const Tensor& x, int64_t dim,
                            bool keepdim) {
  TESSERA_CHECK(x.dim() >= 1, name, ": ", autograd::describe(x), " has no dim to reduce");
  const int64_t d = wrap_dim(dim, x.dim(), name);
  const Tensor indices = is_max ? ops::argmax(x, d, true) : ops::argmin(x, d, true);
  ValuesIndices r{ops::gather(x, d, indices), indices};
  if (autograd::any_requires_grad({x}))
    r = record_selection(is_max ? "MaxBackward" : "MinBackward", x, d, r.values, r.indices);
  if (keepdim) return r;
  return {r.values.squeeze(d), ops::squeeze(r.indices, d)};
}
}  // namespace

ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_along("max", true, x, dim, keepdim);
}
ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim) {
  return extreme_along("min", false, x, dim, keepdim);
}

ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  ops::TopK r = ops::topk(x, k, dim, largest);
  if (!autograd::any_requires_grad({x}) || x.dim() == 0) return {r.values, r.indices};
  return record_selection("TopkBackward", x, wrap_dim(dim, x.dim(), "topk"), r.values, r.indices);
}

Tensor cumsum(const Tensor& x, int64_t dim) {
  Tensor y = ops::cumsum(x, dim);
  if (!autograd::any_requires_grad({x})) return y;
  // Element i feeds every output j >= i: the gradient is the running sum from the end.
  record("CumsumBackward", {x}, {y}, [dim](const BackwardArgs& a) {
    return Grads{ops::cumsum(a.grad(), dim, /*reverse=*/true)};
  });
  return y;
}

}  // namespace tessera
