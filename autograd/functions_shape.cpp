// Differentiable joining and splitting: cat, stack, split, chunk.
#include "tessera/autograd/function_util.h"
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using Grads = std::vector<Tensor>;

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  Tensor y = ops::cat(xs, dim);
  if (!autograd::any_requires_grad(xs)) return y;
  if (xs.size() == 1 && y.is_same(xs[0])) y = ops::clone(y);  // the output needs its own history
  const int64_t d = wrap_dim(dim, y.dim(), "cat");
  std::vector<int64_t> sizes;
  for (const Tensor& x : xs) sizes.push_back(x.size(d));
  record("CatBackward", xs, {y},
         [sizes, d](const BackwardArgs& a) { return ops::split_sizes(a.grad(), sizes, d); });
  return y;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  Tensor y = ops::stack(xs, dim);
  if (!autograd::any_requires_grad(xs)) return y;
  const int64_t d = wrap_dim(dim, y.dim(), "stack");
  record("StackBackward", xs, {y},
         [d, count = static_cast<int64_t>(xs.size())](const BackwardArgs& a) {
           Grads grads;
           for (int64_t i = 0; i < count; ++i) grads.push_back(ops::select(a.grad(), d, i));
           return grads;
         });
  return y;
}

// The pieces are views of x; the gradient of x is the pieces' gradients joined again
// (zeros for pieces no gradient reached).
static std::vector<Tensor> record_pieces(const char* name, const Tensor& x,
                                         std::vector<Tensor> pieces, int64_t dim) {
  const int64_t d = wrap_dim(dim, x.dim(), name);
  for (Tensor& piece : pieces) {
    if (piece.is_same(x)) piece = ops::alias(x);  // each piece needs its own history
  }
  if (autograd::record(name, {x}, pieces,
                       [d](const BackwardArgs& a) { return Grads{ops::cat(a.grad_outputs, d)}; })) {
    for (const Tensor& piece : pieces) autograd::mark_view(piece, x);
  }
  return pieces;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  return record_pieces("SplitBackward", x, ops::split(x, split_size, dim), dim);
}
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  return record_pieces("SplitBackward", x, ops::split_sizes(x, sizes, dim), dim);
}
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  return record_pieces("ChunkBackward", x, ops::chunk(x, chunks, dim), dim);
}

}  // namespace tessera
