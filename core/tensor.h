// Tensor: a typed, shaped, strided view of a Storage on one device.
//
// Core knows nothing about gradients. The members under "autograd interface"
// and the view/copy members are declared here so users can write
// `x.transpose(0, 1)`, `p.grad()` and `loss.backward()`, and are defined in
// autograd/ (they record the op on the tape when a gradient is needed). Code in
// core/ and kernels/ uses the raw, tape-free versions in namespace `raw`.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/dtype.h"
#include "tessera/core/error.h"

namespace tessera {

namespace autograd {
struct AutogradMeta;  // defined in autograd/
}

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3]"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);
// Wraps a possibly negative dim into [0, ndim); error names `op` when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  bool requires_grad = false;
};

// Counts in-place writes to a block of memory. Every view of one Storage shares the
// counter, so a tensor saved for backward notices writes made through any alias.
// raw::make points it at the storage's counter; it starts null so that creating a TensorImpl
// costs no allocation of its own (every op creates several).
struct VersionCounter {
  std::shared_ptr<uint64_t> count;
  VersionCounter& operator++() {
    ++*count;
    return *this;
  }
  uint64_t operator++(int) { return (*count)++; }
  operator uint64_t() const { return *count; }
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;       // in elements
  int64_t offset = 0;  // in elements, into storage
  DType dtype = DType::f32;
  VersionCounter version;  // bumped by in-place writes; shared with the storage's other views
  std::shared_ptr<autograd::AutogradMeta> autograd;  // null until autograd needs it
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  int64_t numel() const { return shape_numel(impl().shape); }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return numel() * element_size(); }
  bool is_contiguous() const;
  // True when the elements fill one dense block in some order (no gaps, no overlap).
  bool is_non_overlapping_and_dense() const;

  // Pointer to the first element (storage + offset).
  void* raw_data() const;
  template <class T>
  T* data() const {
    TESSERA_CHECK(DTypeOf<T>::value == dtype(), "Tensor::data: requested ",
                  dtype_name(DTypeOf<T>::value), " but tensor is ", dtype_name(dtype()));
    return static_cast<T*>(raw_data());
  }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  TensorImpl& impl() const {
    TESSERA_CHECK(impl_ != nullptr, "operation on an undefined Tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  // Identity of the underlying memory (for aliasing checks).
  bool shares_storage(const Tensor& o) const { return storage() == o.storage(); }

  // Host-side reads; copy from the device and convert as needed.
  double item() const;
  template <class T>
  std::vector<T> to_vector() const;

  std::string str() const;  // PyTorch-like text with values, shape, dtype, device

  // ---- views and copies (differentiable; defined in autograd/) ----
  Tensor view(const Shape& shape) const;     // error when not viewable
  Tensor reshape(const Shape& shape) const;  // view when possible, else copy
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor squeeze(int64_t dim) const;
  Tensor squeeze() const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor expand(const Shape& shape) const;
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor to(Device device, DType dtype) const;
  Tensor cpu() const { return to(Device::cpu()); }
  // In-place copy from src (broadcast to this shape, converted to this dtype).
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // ---- autograd interface (defined in autograd/) ----
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);
  Tensor grad() const;  // undefined when no gradient has been computed
  void set_grad(const Tensor& g) const;
  bool is_leaf() const;
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  Tensor detach() const;  // same memory, no history

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- factories ----
Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
// [start, end) by step; dtype i64 unless opts say otherwise.
Tensor arange(double start, double end, double step = 1.0,
              TensorOptions opts = {.dtype = DType::i64});
inline Tensor arange(double end) { return arange(0, end); }
// Copies host values (converted to opts.dtype) into a new tensor.
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions opts = {});
// Wraps existing memory without copying; `keep_alive` owns it.
Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                 std::shared_ptr<void> keep_alive = nullptr);

// ---- tape-free views and copies, for core/ and kernels/ (the layers above call them as ops::,
// kernels/ops.h) ----
namespace raw {
Tensor make(std::shared_ptr<Storage> storage, const Shape& shape, const Shape& strides,
            int64_t offset, DType dtype);
Tensor as_strided(const Tensor& t, const Shape& shape, const Shape& strides, int64_t offset);
Tensor view(const Tensor& t, const Shape& shape);
Tensor reshape(const Tensor& t, const Shape& shape);
Tensor flatten(const Tensor& t, int64_t start, int64_t end);
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1);
Tensor permute(const Tensor& t, const std::vector<int64_t>& dims);
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step);
Tensor select(const Tensor& t, int64_t dim, int64_t index);
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor squeeze(const Tensor& t);
Tensor unsqueeze(const Tensor& t, int64_t dim);
Tensor expand(const Tensor& t, const Shape& shape);
Tensor contiguous(const Tensor& t);
Tensor clone(const Tensor& t);
Tensor to(const Tensor& t, Device device, DType dtype);
void copy_(const Tensor& dst, const Tensor& src);
void fill_(const Tensor& dst, double value);
Tensor alias(const Tensor& t);  // a new TensorImpl over the same memory, no autograd state
// Shape that a and b broadcast to; error names `op` and both shapes otherwise.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
}  // namespace raw

}  // namespace tessera
