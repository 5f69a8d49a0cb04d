// Front-end of the element-wise ops: broadcasting, type promotion, output allocation,
// then one call into the device's kernel row.
#include <algorithm>
#include <cmath>

#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {
namespace detail {

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return ::tessera::detail::concat(dtype_name(t.dtype()), shape_str(t.shape()), " on ", t.device().str());
}

Device common_device(const char* op, std::initializer_list<const Tensor*> operands) {
  int index = 0;
  for (const Tensor* t : operands) {
    TESSERA_CHECK(t->defined(), op, ": operand ", index, " is an undefined tensor");
    ++index;
  }
  const Tensor* first = *operands.begin();
  for (const Tensor* t : operands) {
    if (t->device() != first->device()) {
      std::string all;
      for (const Tensor* u : operands) all += (all.empty() ? "" : ", ") + describe(*u);
      TESSERA_FAIL(op, ": operands are on different devices (", all, ")");
    }
  }
  return first->device();
}

std::vector<int64_t> normalize_dims(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, std::max<int64_t>(ndim, 1), op));
  std::sort(out.begin(), out.end());
  TESSERA_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), op,
                ": a dimension is repeated in ", shape_str(dims));
  if (ndim == 0) out.clear();  // dim 0 / -1 of a scalar reduces nothing
  return out;
}

Tensor scalar_tensor(double value, DType dtype, Device device) {
  return full({}, value, {.dtype = dtype, .device = device});
}

Tensor like_input(const char* op, const char* what, const Tensor& t, const Tensor& x) {
  TESSERA_CHECK(t.defined() && t.shape() == x.shape() && t.device() == x.device(), op, ": ", what,
                " ", describe(t), " must have the input's shape and device ", describe(x));
  return t.dtype() == x.dtype() ? t : raw::to(t, x.device(), x.dtype());
}

}  // namespace detail

using detail::describe;
using detail::expanded;

namespace {

bool unary_needs_float(UnaryOp op) {
  switch (op) {
    case UnaryOp::Exp: case UnaryOp::Log: case UnaryOp::Sqrt: case UnaryOp::Rsqrt:
    case UnaryOp::Tanh: case UnaryOp::Sigmoid: case UnaryOp::Gelu: case UnaryOp::Sin:
    case UnaryOp::Cos: case UnaryOp::Reciprocal: case UnaryOp::Log1p: case UnaryOp::Expm1:
    case UnaryOp::Erf:
      return true;
    default:
      return false;
  }
}

bool binary_returns_bool(BinaryOp op) {
  switch (op) {
    case BinaryOp::Eq: case BinaryOp::Ne: case BinaryOp::Lt: case BinaryOp::Le:
    case BinaryOp::Gt: case BinaryOp::Ge: case BinaryOp::LogicalAnd: case BinaryOp::LogicalOr:
      return true;
    default:
      return false;
  }
}

// Division and the GELU gradient of integers are computed in f32, as PyTorch's true division.
bool binary_needs_float(BinaryOp op) { return op == BinaryOp::Div || op == BinaryOp::GeluBackward; }

// The dtype the op's result has for operands promoting to `promoted`.
DType binary_result_dtype(BinaryOp op, DType promoted) {
  if (binary_returns_bool(op)) return DType::boolean;
  if (binary_needs_float(op) && is_integral(promoted)) return DType::f32;
  return promoted;
}

void run_binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  const Device dev = out.device();
  Tensor lhs = expanded(a, out.shape()), rhs = expanded(b, out.shape());
  if (binary_needs_float(op) && is_integral(promote_types(a.dtype(), b.dtype()))) {
    lhs = raw::to(lhs, dev, DType::f32);
    rhs = raw::to(rhs, dev, DType::f32);
  }
  checked_kernel(detail::kernels_for(dev).binary, binary_op_name(op), dev)(op, lhs, rhs, out);
}

// Dtype a Python-style scalar takes next to a tensor of dtype t: t, unless t is integral and
// the scalar is not a whole number.
DType scalar_operand_dtype(DType t, double value) {
  if (is_integral(t) && std::floor(value) != value) return DType::f32;
  if (t == DType::boolean && value != 0 && value != 1) return DType::i64;
  return t;
}

}  // namespace

Tensor unary(UnaryOp op, const Tensor& x) {
  const Device dev = detail::common_device(unary_op_name(op), {&x});
  DType dtype = x.dtype();
  if (op == UnaryOp::LogicalNot) dtype = DType::boolean;
  else if (unary_needs_float(op) && is_integral(dtype)) dtype = DType::f32;
  Tensor out = empty(x.shape(), {.dtype = dtype, .device = dev});
  if (out.numel() == 0) return out;
  checked_kernel(detail::kernels_for(dev).unary, unary_op_name(op), dev)(op, x, out);
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_op_name(op);
  const Device dev = detail::common_device(name, {&a, &b});
  const Shape shape = raw::broadcast_shapes(a.shape(), b.shape(), name);
  const DType dtype = binary_result_dtype(op, promote_types(a.dtype(), b.dtype()));
  Tensor out = empty(shape, {.dtype = dtype, .device = dev});
  if (out.numel() > 0) run_binary(op, a, b, out);
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, double b) {
  detail::common_device(binary_op_name(op), {&a});
  return binary(op, a, detail::scalar_tensor(b, scalar_operand_dtype(a.dtype(), b), a.device()));
}

bool has_internal_overlap(const Tensor& t) {
  if (t.numel() <= 1 || t.is_non_overlapping_and_dense()) return false;
  // Dims that step (size > 1), by increasing stride: the elements are distinct when each
  // stride passes the whole extent of the smaller ones (the usual case for views).
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    if (t.stride(d) == 0) return true;
    dims.emplace_back(std::abs(t.stride(d)), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t extent = 0;
  bool nested = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= extent) nested = false;
    extent += stride * (size - 1);
  }
  // An unusual as_strided layout: compare the element offsets themselves (beyond a few
  // million elements that is too costly; such a layout is let through, as PyTorch does).
  constexpr int64_t kMaxOffsetsCompared = int64_t{1} << 22;
  if (nested || t.numel() > kMaxOffsetsCompared) return false;
  std::vector<int64_t> offsets{0};
  for (const auto& [stride, size] : dims) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * size);
    for (int64_t i = 0; i < size; ++i) {
      for (int64_t o : offsets) next.push_back(o + i * stride);
    }
    offsets.swap(next);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

void check_no_internal_overlap(const char* op, const Tensor& t) {
  TESSERA_CHECK(!has_internal_overlap(t), op, ": unsupported operation: more than one element of "
                "the written-to tensor ", describe(t), " (strides ", shape_str(t.strides()),
                ") refers to a single memory location; clone() it before writing in place");
}

void binary_(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_op_name(op);
  const Device dev = detail::common_device(name, {&a, &b});
  check_no_internal_overlap(name, a);
  const Shape shape = raw::broadcast_shapes(a.shape(), b.shape(), name);
  TESSERA_CHECK(shape == a.shape(), name, "_: in-place result of shape ", shape_str(shape),
                " does not fit the destination ", describe(a), " (operand ", describe(b), ")");
  if (a.numel() == 0) return;
  run_binary(op, a, b, a);
  ++a.impl().version;
  (void)dev;
}

void binary_(BinaryOp op, const Tensor& a, double b) {
  detail::common_device(binary_op_name(op), {&a});
  binary_(op, a, detail::scalar_tensor(b, scalar_operand_dtype(a.dtype(), b), a.device()));
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const Device dev = detail::common_device("where", {&cond, &a, &b});
  TESSERA_CHECK(cond.dtype() == DType::boolean || cond.dtype() == DType::u8,
                "where: condition must be bool (or uint8), got ", describe(cond));
  const Shape shape = raw::broadcast_shapes(
      raw::broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = empty(shape, {.dtype = promote_types(a.dtype(), b.dtype()), .device = dev});
  if (out.numel() == 0) return out;
  checked_kernel(detail::kernels_for(dev).where, "where", dev)(
      expanded(cond, shape), expanded(a, shape), expanded(b, shape), out);
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  const Device dev = detail::common_device("masked_fill", {&x, &mask});
  TESSERA_CHECK(mask.dtype() == DType::boolean || mask.dtype() == DType::u8,
                "masked_fill: mask must be bool (or uint8), got ", describe(mask));
  const Shape shape = raw::broadcast_shapes(x.shape(), mask.shape(), "masked_fill");
  TESSERA_CHECK(shape == x.shape(), "masked_fill: mask ", describe(mask),
                " does not broadcast to the input ", describe(x));
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (out.numel() == 0) return out;
  const Tensor fill = detail::scalar_tensor(value, x.dtype(), dev);
  checked_kernel(detail::kernels_for(dev).where, "masked_fill", dev)(
      expanded(mask, shape), expanded(fill, shape), x, out);
  return out;
}

Tensor add_scaled(const Tensor& a, const Tensor& b, double alpha) {
  const Device dev = detail::common_device("add_scaled", {&a, &b});
  const Shape shape = raw::broadcast_shapes(a.shape(), b.shape(), "add_scaled");
  const DType dtype = promote_types(a.dtype(), b.dtype());
  const auto fused = detail::kernels_for(dev).add_scaled;
  if (!fused || is_integral(dtype)) return add(a, mul(b, alpha));
  Tensor out = empty(shape, {.dtype = dtype, .device = dev});
  if (out.numel() > 0) fused(expanded(a, shape), expanded(b, shape), alpha, out);
  return out;
}

namespace {
// Both operands broadcast together, as contiguous f64 host tensors.
std::pair<std::vector<double>, std::vector<double>> host_f64_pair(const Tensor& a, const Tensor& b,
                                                                  const char* op) {
  TESSERA_CHECK(a.defined() && b.defined(), op, ": undefined tensor");
  const Shape shape = raw::broadcast_shapes(a.shape(), b.shape(), op);
  auto host = [&](const Tensor& t) {
    return raw::contiguous(raw::to(expanded(t, shape), Device::cpu(), DType::f64))
        .to_vector<double>();
  };
  return {host(a), host(b)};
}
}  // namespace

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  const auto [x, y] = host_f64_pair(a, b, "allclose");
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return false;
    if (x[i] == y[i]) continue;  // equal infinities
    if (!(std::fabs(x[i] - y[i]) <= atol + rtol * std::fabs(y[i]))) return false;
  }
  return true;
}

double max_rel_error(const Tensor& a, const Tensor& b) {
  const auto [x, y] = host_f64_pair(a, b, "max_rel_error");
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double diff = std::fabs(x[i] - y[i]);
    if (std::isnan(diff) && !(std::isnan(x[i]) && std::isnan(y[i]))) return INFINITY;
    if (!std::isnan(diff)) max_diff = std::max(max_diff, diff);
    if (!std::isnan(y[i])) max_ref = std::max(max_ref, std::fabs(y[i]));
  }
  if (max_diff == 0) return 0;
  return max_diff / (max_ref > 0 ? max_ref : 1.0);
}

}  // namespace tessera::ops
