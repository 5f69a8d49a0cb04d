// Tensor's view/copy members and autograd interface.
// Initial version: views forward to the tape-free versions; the autograd layer
// replaces these with recording versions.
#include "core/tensor.h"

namespace tessera {

Tensor Tensor::view(const Shape& s) const { return raw::view(*this, s); }
Tensor Tensor::reshape(const Shape& s) const { return raw::reshape(*this, s); }
Tensor Tensor::flatten(int64_t a, int64_t b) const { return raw::flatten(*this, a, b); }
Tensor Tensor::transpose(int64_t a, int64_t b) const { return raw::transpose(*this, a, b); }
Tensor Tensor::permute(const std::vector<int64_t>& d) const { return raw::permute(*this, d); }
Tensor Tensor::narrow(int64_t d, int64_t s, int64_t l) const { return raw::narrow(*this, d, s, l); }
Tensor Tensor::slice(int64_t d, int64_t s, int64_t e, int64_t st) const {
  return raw::slice(*this, d, s, e, st);
}
Tensor Tensor::select(int64_t d, int64_t i) const { return raw::select(*this, d, i); }
Tensor Tensor::squeeze(int64_t d) const { return raw::squeeze(*this, d); }
Tensor Tensor::squeeze() const { return raw::squeeze(*this); }
Tensor Tensor::unsqueeze(int64_t d) const { return raw::unsqueeze(*this, d); }
Tensor Tensor::expand(const Shape& s) const { return raw::expand(*this, s); }
Tensor Tensor::contiguous() const { return raw::contiguous(*this); }
Tensor Tensor::clone() const { return raw::clone(*this); }
Tensor Tensor::to(Device d) const { return raw::to(*this, d, dtype()); }
Tensor Tensor::to(DType t) const { return raw::to(*this, device(), t); }
Tensor Tensor::to(Device d, DType t) const { return raw::to(*this, d, t); }
Tensor& Tensor::copy_(const Tensor& src) {
  raw::copy_(*this, src);
  return *this;
}
Tensor& Tensor::fill_(double v) {
  raw::fill_(*this, v);
  return *this;
}

bool Tensor::requires_grad() const { return false; }
Tensor& Tensor::requires_grad_(bool) { return *this; }
Tensor Tensor::grad() const { return Tensor(); }
void Tensor::set_grad(const Tensor&) const {}
bool Tensor::is_leaf() const { return true; }
void Tensor::backward(const Tensor&, bool) const {}
Tensor Tensor::detach() const { return raw::alias(*this); }

}  // namespace tessera
