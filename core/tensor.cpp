#include "tessera/core/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "tessera/core/autograd_hooks.h"
#include "tessera/core/dispatch.h"

namespace tessera {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  // A zero anywhere makes the count 0 however large the other sizes are.
  if (std::find(s.begin(), s.end(), int64_t{0}) != s.end()) return 0;
  int64_t n = 1;
  for (int64_t d : s)
    TESSERA_CHECK(!__builtin_mul_overflow(n, d, &n), "shape ", shape_str(s),
                  ": the element count overflows int64");
  return n;
}

namespace {
// Bytes of a contiguous `shape` of `dtype`, checked: what an allocation will ask for.
size_t checked_nbytes(const Shape& shape, DType dtype, const char* op) {
  size_t bytes = 0;
  TESSERA_CHECK(!__builtin_mul_overflow(static_cast<size_t>(shape_numel(shape)), dtype_size(dtype), &bytes),
                op, ": shape ", shape_str(shape), " of ", dtype_name(dtype), ": the byte count overflows");
  return bytes;
}
}  // namespace

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  TESSERA_CHECK(dim >= lo && dim <= hi, op, ": dimension ", dim, " out of range for a tensor of ",
                ndim, " dimension(s) (expected [", lo, ", ", hi, "])");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

bool Tensor::is_non_overlapping_and_dense() const {
  std::vector<int64_t> order(dim());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return strides()[a] < strides()[b];
  });
  int64_t expected = 1;
  for (int64_t i : order) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  return static_cast<char*>(storage()->data()) + offset() * static_cast<int64_t>(element_size());
}

double Tensor::item() const {
  TESSERA_CHECK(numel() == 1, "item: tensor with ", numel(), " elements (shape ", shape_str(shape()),
                ") cannot be converted to a scalar");
  return to_vector<double>()[0];
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = raw::contiguous(raw::to(*this, Device::cpu(), DTypeOf<T>::value));
  const T* p = host.data<T>();
  return std::vector<T>(p, p + host.numel());
}

template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;
template std::vector<Half> Tensor::to_vector<Half>() const;
template std::vector<BFloat16> Tensor::to_vector<BFloat16>() const;

template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  auto bytes = raw::to(*this, Device::cpu(), DType::u8).to_vector<uint8_t>();
  return std::vector<bool>(bytes.begin(), bytes.end());
}

// ---- printing ----
namespace {

std::string format_value(double v, DType t, bool all_integral) {
  char buf[64];
  if (t == DType::boolean) return v != 0 ? "True" : "False";
  if (is_integral(t)) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  } else if (std::isnan(v)) {
    return "nan";
  } else if (std::isinf(v)) {
    return v > 0 ? "inf" : "-inf";
  } else if (all_integral) {
    std::snprintf(buf, sizeof buf, "%.0f.", v);
  } else if (v != 0 && (std::fabs(v) >= 1e4 || std::fabs(v) < 1e-4)) {
    std::snprintf(buf, sizeof buf, "%.4e", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.4f", v);
  }
  return buf;
}

void format_rec(std::string& out, const std::vector<double>& vals, const Shape& shape, size_t d,
                int64_t base, DType t, bool all_integral, int indent) {
  if (shape.empty()) {
    out += format_value(vals[0], t, all_integral);
    return;
  }
  const int64_t n = shape[d];
  int64_t inner = 1;
  for (size_t k = d + 1; k < shape.size(); ++k) inner *= shape[k];
  const int64_t edge = 3;
  const bool elide = n > 2 * edge;
  out += "[";
  for (int64_t i = 0; i < n; ++i) {
    if (elide && i == edge) {
      out += d + 1 == shape.size() ? "..., " : "...,\n" + std::string(indent + 1, ' ');
      i = n - edge - 1;
      continue;
    }
    if (d + 1 == shape.size()) {
      out += format_value(vals[base + i], t, all_integral);
    } else {
      format_rec(out, vals, shape, d + 1, base + i * inner, t, all_integral, indent + 1);
    }
    if (i + 1 < n) out += d + 1 == shape.size() ? ", " : ",\n" + std::string(indent + 1, ' ');
  }
  out += "]";
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::vector<double> vals = to_vector<double>();
  bool all_integral = std::all_of(vals.begin(), vals.end(), [](double v) {
    return std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e9;
  });
  std::string out = "tensor(";
  if (numel() == 0) {
    out += "[]";
  } else {
    format_rec(out, vals, shape(), 0, 0, dtype(), all_integral, 7);
  }
  out += ", shape=" + shape_str(shape()) + ", dtype=" + dtype_name(dtype()) +
         ", device=" + device().str() + ")";
  return out;
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

// ---- raw (tape-free) views ----
namespace raw {

Tensor make(std::shared_ptr<Storage> storage, const Shape& shape, const Shape& strides,
            int64_t offset, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  impl->version.count = impl->storage->version_counter();
  return Tensor(std::move(impl));
}

Tensor alias(const Tensor& t) { return make(t.storage(), t.shape(), t.strides(), t.offset(), t.dtype()); }

Tensor as_strided(const Tensor& t, const Shape& shape, const Shape& strides, int64_t offset) {
  TESSERA_CHECK(shape.size() == strides.size(), "as_strided: shape ", shape_str(shape),
                " and strides ", shape_str(strides), " differ in length");
  int64_t max_index = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    TESSERA_CHECK(shape[i] >= 0, "as_strided: negative size in shape ", shape_str(shape));
    if (shape[i] == 0) max_index = -1;
    if (max_index >= 0) max_index += (shape[i] - 1) * strides[i];
  }
  const int64_t capacity = static_cast<int64_t>(t.storage()->nbytes() / dtype_size(t.dtype()));
  TESSERA_CHECK(max_index < capacity, "as_strided: view of shape ", shape_str(shape), " strides ",
                shape_str(strides), " offset ", offset, " exceeds storage of ", capacity,
                " elements");
  return make(t.storage(), shape, strides, offset, t.dtype());
}

// Strides for viewing `t` as `shape` without copying, if possible (PyTorch's computeStride).
static bool view_strides(const Tensor& t, const Shape& shape, Shape& out) {
  const Shape& old_shape = t.shape();
  const Shape& old_strides = t.strides();
  out.assign(shape.size(), 0);
  if (t.numel() <= 1) {  // zero or one element: any shape is a view
    out = contiguous_strides(shape);
    return true;
  }
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.empty() ? 1 : old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    if (d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

static Shape infer_shape(const Shape& shape, int64_t numel, const char* op, const Shape& from) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TESSERA_CHECK(infer < 0, op, ": only one dimension can be -1 in ", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      TESSERA_CHECK(out[i] >= 0, op, ": invalid size in shape ", shape_str(shape));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    TESSERA_CHECK(known != 0 && numel % known == 0, op, ": shape ", shape_str(shape),
                  " is invalid for a tensor of shape ", shape_str(from), " (", numel,
                  " elements)");
    out[infer] = numel / known;
  }
  TESSERA_CHECK(shape_numel(out) == numel, op, ": shape ", shape_str(shape),
                " is invalid for a tensor of shape ", shape_str(from), " (", numel, " elements)");
  return out;
}

Tensor view(const Tensor& t, const Shape& shape) {
  Shape target = infer_shape(shape, t.numel(), "view", t.shape());
  Shape strides;
  TESSERA_CHECK(view_strides(t, target, strides), "view: a tensor of shape ", shape_str(t.shape()),
                " with strides ", shape_str(t.strides()), " cannot be viewed as ",
                shape_str(target), " without a copy; use reshape() or contiguous() first");
  return make(t.storage(), target, strides, t.offset(), t.dtype());
}

Tensor reshape(const Tensor& t, const Shape& shape) {
  Shape target = infer_shape(shape, t.numel(), "reshape", t.shape());
  Shape strides;
  if (view_strides(t, target, strides)) return make(t.storage(), target, strides, t.offset(), t.dtype());
  return view(contiguous(t), target);
}

Tensor flatten(const Tensor& t, int64_t start, int64_t end) {
  if (t.dim() == 0) return reshape(t, {1});
  start = wrap_dim(start, t.dim(), "flatten");
  end = wrap_dim(end, t.dim(), "flatten");
  TESSERA_CHECK(start <= end, "flatten: start dim ", start, " is after end dim ", end);
  Shape s(t.shape().begin(), t.shape().begin() + start);
  int64_t n = 1;
  for (int64_t i = start; i <= end; ++i) n *= t.shape()[i];
  s.push_back(n);
  s.insert(s.end(), t.shape().begin() + end + 1, t.shape().end());
  return reshape(t, s);
}

Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) {
  d0 = wrap_dim(d0, t.dim(), "transpose");
  d1 = wrap_dim(d1, t.dim(), "transpose");
  Shape shape = t.shape(), strides = t.strides();
  if (t.dim() == 0) return alias(t);
  std::swap(shape[d0], shape[d1]);
  std::swap(strides[d0], strides[d1]);
  return make(t.storage(), shape, strides, t.offset(), t.dtype());
}

Tensor permute(const Tensor& t, const std::vector<int64_t>& dims) {
  TESSERA_CHECK(static_cast<int64_t>(dims.size()) == t.dim(), "permute: got ", dims.size(),
                " dims for a tensor of shape ", shape_str(t.shape()));
  Shape shape(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], t.dim(), "permute");
    TESSERA_CHECK(!seen[d], "permute: dimension ", d, " repeated in ", shape_str(dims));
    seen[d] = true;
    shape[i] = t.shape()[d];
    strides[i] = t.strides()[d];
  }
  return make(t.storage(), shape, strides, t.offset(), t.dtype());
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  dim = wrap_dim(dim, t.dim(), "slice");
  TESSERA_CHECK(step > 0, "slice: step must be positive, got ", step);
  const int64_t n = t.shape()[dim];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = t.shape(), strides = t.strides();
  shape[dim] = (end - start + step - 1) / step;
  strides[dim] *= step;
  return make(t.storage(), shape, strides, t.offset() + start * t.strides()[dim], t.dtype());
}

Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, t.dim(), "narrow");
  const int64_t n = t.shape()[dim];
  if (start < 0) start += n;
  TESSERA_CHECK(start >= 0 && length >= 0 && start + length <= n, "narrow: range [", start, ", ",
                start + length, ") out of bounds for dimension ", dim, " of size ", n,
                " (shape ", shape_str(t.shape()), ")");
  return slice(t, dim, start, start + length, 1);
}

Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  dim = wrap_dim(dim, t.dim(), "select");
  const int64_t n = t.shape()[dim];
  TESSERA_CHECK(index >= -n && index < n, "select: index ", index,
                " out of range for dimension ", dim, " of size ", n, " (shape ",
                shape_str(t.shape()), ")");
  if (index < 0) index += n;
  Shape shape = t.shape(), strides = t.strides();
  const int64_t off = t.offset() + index * strides[dim];
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return make(t.storage(), shape, strides, off, t.dtype());
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  if (t.dim() == 0) return alias(t);
  dim = wrap_dim(dim, t.dim(), "squeeze");
  if (t.shape()[dim] != 1) return alias(t);
  Shape shape = t.shape(), strides = t.strides();
  shape.erase(shape.begin() + dim);
  strides.erase(strides.begin() + dim);
  return make(t.storage(), shape, strides, t.offset(), t.dtype());
}

Tensor squeeze(const Tensor& t) {
  Shape shape, strides;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.shape()[i] == 1) continue;
    shape.push_back(t.shape()[i]);
    strides.push_back(t.strides()[i]);
  }
  return make(t.storage(), shape, strides, t.offset(), t.dtype());
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  dim = wrap_dim(dim, t.dim() + 1, "unsqueeze");
  Shape shape = t.shape(), strides = t.strides();
  const int64_t st = dim < t.dim() ? t.strides()[dim] * t.shape()[dim] : 1;
  shape.insert(shape.begin() + dim, 1);
  strides.insert(strides.begin() + dim, st);
  return make(t.storage(), shape, strides, t.offset(), t.dtype());
}

Tensor expand(const Tensor& t, const Shape& shape) {
  TESSERA_CHECK(shape.size() >= static_cast<size_t>(t.dim()), "expand: cannot expand shape ",
                shape_str(t.shape()), " to fewer dimensions ", shape_str(shape));
  const size_t lead = shape.size() - t.dim();
  Shape out_shape(shape.size()), out_strides(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      TESSERA_CHECK(shape[i] >= 0, "expand: -1 not allowed for new leading dim in ", shape_str(shape));
      out_shape[i] = shape[i];
      out_strides[i] = 0;
      continue;
    }
    const int64_t have = t.shape()[i - lead];
    const int64_t want = shape[i] == -1 ? have : shape[i];
    if (have == want) {
      out_shape[i] = have;
      out_strides[i] = t.strides()[i - lead];
    } else {
      TESSERA_CHECK(have == 1, "expand: the size of dimension ", i - lead, " (", have,
                    ") must be 1 to expand shape ", shape_str(t.shape()), " to ", shape_str(shape));
      out_shape[i] = want;
      out_strides[i] = 0;
    }
  }
  return make(t.storage(), out_shape, out_strides, t.offset(), t.dtype());
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TESSERA_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ",
                  shape_str(b), " cannot be broadcast together (dimension ", i, ": ", da, " vs ",
                  db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// dst may be an expanded view (fill_ writes one value, so PyTorch allows it): its stride-0
// dims are cut to size 1 first, so the kernel writes each memory location once.
void fill_(const Tensor& dst, double value) {
  if (dst.numel() == 0) return;
  Shape distinct = dst.shape();
  for (int64_t d = 0; d < dst.dim(); ++d)
    if (dst.stride(d) == 0) distinct[d] = 1;
  checked_kernel(kernel_table(dst.device().type).fill, "fill_", dst.device())(
      distinct == dst.shape() ? dst : as_strided(dst, distinct, dst.strides(), dst.offset()),
      value);
  ++dst.impl().version;
}

void copy_(const Tensor& dst, const Tensor& src) {
  TESSERA_CHECK(src.defined() && dst.defined(), "copy_: undefined tensor");
  Tensor s = src.shape() == dst.shape() ? src : expand(src, dst.shape());
  if (dst.numel() == 0) return;
  ++dst.impl().version;
  if (s.device() == dst.device()) {
    checked_kernel(kernel_table(dst.device().type).copy, "copy_", dst.device())(dst, s);
    return;
  }
  // Across devices: convert and pack on the source side, move bytes, then scatter into dst.
  Tensor packed = empty(dst.shape(), {.dtype = dst.dtype(), .device = s.device()});
  checked_kernel(kernel_table(s.device().type).copy, "copy_", s.device())(packed, s);
  Tensor landed = dst.is_contiguous() ? dst : empty(dst.shape(), {.dtype = dst.dtype(), .device = dst.device()});
  const Device gpu = dst.device().is_cpu() ? s.device() : dst.device();
  device_backend(gpu.type).copy_bytes(landed.raw_data(), dst.device(), packed.raw_data(),
                                      s.device(), packed.nbytes());
  if (!landed.is_same(dst)) copy_(dst, landed);
}

Tensor contiguous(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
  copy_(out, t);
  return out;
}

Tensor clone(const Tensor& t) {
  Tensor out = empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
  copy_(out, t);
  return out;
}

Tensor to(const Tensor& t, Device device, DType dtype) {
  if (t.device() == device && t.dtype() == dtype) return t;
  Tensor out = empty(t.shape(), {.dtype = dtype, .device = device});
  copy_(out, t);
  return out;
}

}  // namespace raw

// ---- the autograd layer's hooks ----
namespace {
AutogradHooks& installed_hooks() {
  static AutogradHooks hooks;
  return hooks;
}
}  // namespace

void install_autograd_hooks(const AutogradHooks& hooks) { installed_hooks() = hooks; }

void detail::mark_requires_grad(const Tensor& t, const char* op) {
  auto set = installed_hooks().set_requires_grad;
  TESSERA_CHECK(set != nullptr, op, ": requires_grad asked for, but no autograd layer is loaded");
  set(t, true);
}

// ---- factories ----
Tensor empty(const Shape& shape, TensorOptions opts) {
  for (int64_t d : shape) TESSERA_CHECK(d >= 0, "empty: negative dimension in shape ", shape_str(shape));
  const size_t bytes = checked_nbytes(shape, opts.dtype, "empty");
  auto storage = std::make_shared<Storage>(bytes, opts.device);
  Tensor t = raw::make(std::move(storage), shape, contiguous_strides(shape), 0, opts.dtype);
  if (opts.requires_grad) detail::mark_requires_grad(t, "empty");
  return t;
}

Tensor full(const Shape& shape, double value, TensorOptions opts) {
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  raw::fill_(t, value);
  if (rg) detail::mark_requires_grad(t, "full");
  return t;
}
Tensor zeros(const Shape& shape, TensorOptions opts) { return full(shape, 0.0, opts); }
Tensor ones(const Shape& shape, TensorOptions opts) { return full(shape, 1.0, opts); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }

Tensor arange(double start, double end, double step, TensorOptions opts) {
  TESSERA_CHECK(step != 0, "arange: step must be non-zero");
  const int64_t n = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((end - start) / step)));
  std::vector<double> vals(n);
  for (int64_t i = 0; i < n; ++i) vals[i] = start + i * step;
  return from_vector(vals, {n}, opts);
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions opts) {
  TESSERA_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ",
                values.size(), " values do not fill shape ", shape_str(shape));
  std::shared_ptr<Storage> host;
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(values.begin(), values.end());
    const Tensor as_bytes = from_vector(bytes, shape, {.dtype = DType::u8, .device = opts.device});
    Tensor out = raw::to(as_bytes, opts.device, DType::boolean);
    if (opts.requires_grad) detail::mark_requires_grad(out, "from_vector");
    return out;
  } else {
    host = std::make_shared<Storage>(values.size() * sizeof(T), Device::cpu());
    if (!values.empty()) std::memcpy(host->data(), values.data(), values.size() * sizeof(T));
    Tensor src = raw::make(host, shape, contiguous_strides(shape), 0, DTypeOf<T>::value);
    Tensor out = raw::to(src, opts.device, opts.dtype);
    if (opts.requires_grad) detail::mark_requires_grad(out, "from_vector");
    return out;
  }
}

template Tensor from_vector(const std::vector<float>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<double>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<int32_t>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<int64_t>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<uint8_t>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<bool>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<Half>&, const Shape&, TensorOptions);
template Tensor from_vector(const std::vector<BFloat16>&, const Shape&, TensorOptions);

Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                 std::shared_ptr<void> keep_alive) {
  const size_t bytes = checked_nbytes(shape, dtype, "from_blob");
  auto storage = std::make_shared<Storage>(data, bytes, device, [keep_alive](void*) {});
  return raw::make(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

}  // namespace tessera
