// Front-end of the reductions: dims normalised, output allocated with the reduced dims kept
// as size 1 (the kernel contract), then viewed without them unless keepdim; and softmax /
// log_softmax along one dim, forward and backward.
#include <cmath>

#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

using detail::check_float;
using detail::check_same_shape;
namespace {

Shape kept_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out = shape;
  for (int64_t d : dims) out[d] = 1;
  return out;
}

Shape squeezed_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape out;
  size_t next = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (next < dims.size() && dims[next] == d) {
      ++next;
      continue;
    }
    out.push_back(shape[d]);
  }
  return out;
}

Tensor reduce(ReduceOp op, const Tensor& input, const std::vector<int64_t>& dims_in, bool keepdim) {
  const char* name = reduce_op_name(op);
  const Device dev = detail::common_device(name, {&input});
  const std::vector<int64_t> dims = detail::normalize_dims(dims_in, input.dim(), name);
  Tensor x = input;
  if (op == ReduceOp::Mean && is_integral(x.dtype())) x = raw::to(x, dev, DType::f32);
  int64_t reduced = 1;
  for (int64_t d : dims) reduced *= x.shape()[d];
  TESSERA_CHECK(reduced > 0 || !(op == ReduceOp::Max || op == ReduceOp::Min), name,
                ": cannot reduce over an empty dimension of ", detail::describe(input), " (dims ",
                shape_str(dims), ")");
  DType dtype = x.dtype();
  if (is_integral(dtype) && (op == ReduceOp::Sum || op == ReduceOp::Prod)) dtype = DType::i64;
  Tensor out = empty(kept_shape(x.shape(), dims), {.dtype = dtype, .device = dev});
  if (out.numel() > 0) {
    if (reduced == 0) {
      raw::fill_(out, op == ReduceOp::Prod ? 1.0 : (op == ReduceOp::Mean ? NAN : 0.0));
    } else {
      checked_kernel(detail::kernels_for(dev).reduce, name, dev)(op, x, dims, out);
    }
  }
  return keepdim ? out : raw::view(out, squeezed_shape(x.shape(), dims));
}

Tensor arg_reduce(bool is_max, const Tensor& x, int64_t dim_in, bool keepdim) {
  const char* name = is_max ? "argmax" : "argmin";
  const Device dev = detail::common_device(name, {&x});
  if (x.dim() == 0) {
    wrap_dim(dim_in, 1, name);
    return zeros({}, {.dtype = DType::i64, .device = dev});
  }
  const int64_t dim = wrap_dim(dim_in, x.dim(), name);
  TESSERA_CHECK(x.shape()[dim] > 0, name, ": cannot reduce over the empty dimension ", dim,
                " of ", detail::describe(x));
  Tensor out = empty(kept_shape(x.shape(), {dim}), {.dtype = DType::i64, .device = dev});
  if (out.numel() > 0) checked_kernel(detail::kernels_for(dev).arg_reduce, name, dev)(is_max, x, dim, out);
  return keepdim ? out : raw::view(out, squeezed_shape(x.shape(), {dim}));
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(ReduceOp::Sum, x, dims, keepdim);
}
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(ReduceOp::Mean, x, dims, keepdim);
}
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(ReduceOp::Max, x, dims, keepdim);
}
Tensor amin(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(ReduceOp::Min, x, dims, keepdim);
}
Tensor prod(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(ReduceOp::Prod, x, dims, keepdim);
}
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) { return arg_reduce(true, x, dim, keepdim); }
Tensor argmin(const Tensor& x, int64_t dim, bool keepdim) { return arg_reduce(false, x, dim, keepdim); }

Tensor sum_to(const Tensor& x, const Shape& shape) {
  detail::common_device("sum_to", {&x});
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  TESSERA_CHECK(lead >= 0, "sum_to: cannot sum ", detail::describe(x), " to the larger rank shape ",
                shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < lead) {
      dims.push_back(d);
      continue;
    }
    const int64_t want = shape[d - lead], have = x.shape()[d];
    TESSERA_CHECK(want == have || want == 1, "sum_to: shape ", shape_str(shape),
                  " is not broadcastable to ", detail::describe(x));
    if (want == 1 && have != 1) dims.push_back(d);
  }
  if (dims.empty()) return raw::view(x, shape);
  return raw::view(sum(x, dims, /*keepdim=*/true), shape);
}

namespace {

Tensor softmax_impl(const Tensor& x, int64_t dim_in, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  const Device dev = detail::common_device(name, {&x});
  check_float(name, x, "input");
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (x.dim() == 0) {  // a scalar is a one-element row
    raw::fill_(out, log ? 0.0 : 1.0);
    return out;
  }
  const int64_t dim = wrap_dim(dim_in, x.dim(), name);
  if (out.numel() > 0) checked_kernel(detail::kernels_for(dev).softmax, name, dev)(x, dim, log, out);
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

Tensor softmax_backward(const Tensor& y, const Tensor& dy, int64_t dim_in, bool log) {
  const char* name = log ? "log_softmax_backward" : "softmax_backward";
  const Device dev = detail::common_device(name, {&y, &dy});
  check_float(name, y, "output");
  check_same_shape(name, y, "output", dy, "gradient");
  Tensor dyc = dy.dtype() == y.dtype() ? dy : raw::to(dy, dev, y.dtype());
  Tensor dx = empty(y.shape(), {.dtype = y.dtype(), .device = dev});
  if (y.dim() == 0) {
    raw::fill_(dx, 0.0);  // softmax of one element is constant
    return dx;
  }
  const int64_t dim = wrap_dim(dim_in, y.dim(), name);
  if (dx.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).softmax_backward, name, dev)(y, dyc, dim, log, dx);
  }
  return dx;
}

}  // namespace tessera::ops
