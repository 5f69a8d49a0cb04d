// Front-end of the indexing ops (embedding gather, index_add_ scatter, index_select) and of
// joining/splitting (cat, stack as cat of unsqueezed views, split/chunk as narrow views).
#include <cmath>
#include <numeric>

#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  const Device dev = detail::common_device("embedding", {&weight, &indices});
  TESSERA_CHECK(weight.dim() == 2, "embedding: weight must be 2-D [num_embeddings, dim], got ",
                detail::describe(weight));
  detail::check_index_dtype("embedding", indices, "indices");
  const int64_t C = weight.shape()[1];
  Shape out_shape = indices.shape();
  out_shape.push_back(C);
  Tensor out = empty({indices.numel(), C}, {.dtype = weight.dtype(), .device = dev});
  if (indices.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).embedding, "embedding", dev)(weight, indices, out);
  }
  return raw::view(out, out_shape);
}

void embedding_backward_into(const Tensor& out_in, const Tensor& dy, const Tensor& indices,
                             bool accumulate, double scale) {
  const Device dev = detail::common_device("embedding_backward", {&out_in, &dy, &indices});
  detail::check_index_dtype("embedding_backward", indices, "indices");
  TESSERA_CHECK(dy.dim() == indices.dim() + 1 &&
                    Shape(dy.shape().begin(), dy.shape().end() - 1) == indices.shape(),
                "embedding_backward: gradient ", detail::describe(dy),
                " must have the indices' shape ", shape_str(indices.shape()), " plus one dim");
  const int64_t C = dy.shape().back(), n = indices.numel();
  TESSERA_CHECK(out_in.dim() == 2 && out_in.shape()[1] == C, "embedding_backward: destination ",
                detail::describe(out_in), " must be [num_rows, ", C, "] for the gradient ",
                detail::describe(dy));
  TESSERA_CHECK(is_floating(dy.dtype()) && is_floating(out_in.dtype()),
                "embedding_backward: gradient ", detail::describe(dy), " and destination ",
                detail::describe(out_in), " must have floating dtypes");
  TESSERA_CHECK(std::isfinite(scale), "embedding_backward: scale must be finite, got ", scale);
  // The kernels write a contiguous destination; a strided one goes through a copy.
  const bool direct = out_in.is_contiguous();
  Tensor out = direct       ? out_in
               : accumulate ? raw::contiguous(out_in)
                            : empty(out_in.shape(), {.dtype = out_in.dtype(), .device = dev});
  checked_kernel(detail::kernels_for(dev).embedding_backward, "embedding_backward", dev)(
      raw::reshape(dy, {n, C}), raw::reshape(indices, {n}), accumulate, scale, out);
  if (!direct) raw::copy_(out_in, out);
  ++out_in.impl().version;
}

Tensor embedding_backward(const Tensor& dy, const Tensor& indices, int64_t num_rows) {
  TESSERA_CHECK(num_rows >= 0, "embedding_backward: num_rows must be non-negative, got ", num_rows);
  TESSERA_CHECK(dy.dim() >= 1, "embedding_backward: gradient ", detail::describe(dy),
                " has no dims");
  Tensor grad = empty({num_rows, dy.shape().back()}, {.dtype = dy.dtype(), .device = dy.device()});
  embedding_backward_into(grad, dy, indices, /*accumulate=*/false);
  return grad;
}

void index_add_(const Tensor& out, int64_t dim_in, const Tensor& index, const Tensor& src) {
  const Device dev = detail::common_device("index_add_", {&out, &index, &src});
  detail::check_index_dtype("index_add_", index, "indices");
  TESSERA_CHECK(index.dim() <= 1, "index_add_: index must be 1-D, got ", detail::describe(index));
  TESSERA_CHECK(out.dim() == src.dim() && out.dim() >= 1, "index_add_: source ",
                detail::describe(src), " and destination ", detail::describe(out),
                " must have the same number of dims");
  const int64_t dim = wrap_dim(dim_in, out.dim(), "index_add_");
  for (int64_t d = 0; d < out.dim(); ++d) {
    const int64_t want = d == dim ? index.numel() : out.shape()[d];
    TESSERA_CHECK(src.shape()[d] == want, "index_add_: source ", detail::describe(src),
                  " does not match destination ", detail::describe(out), " with ", index.numel(),
                  " indices along dim ", dim);
  }
  TESSERA_CHECK(out.dtype() == src.dtype(), "index_add_: source ", detail::describe(src),
                " and destination ", detail::describe(out), " must have the same dtype");
  if (src.numel() == 0) return;
  checked_kernel(detail::kernels_for(dev).index_add, "index_add_", dev)(
      out, dim, raw::reshape(index, {index.numel()}), src);
  ++out.impl().version;
}

Tensor index_select(const Tensor& x, int64_t dim_in, const Tensor& index) {
  detail::common_device("index_select", {&x, &index});
  detail::check_index_dtype("index_select", index, "indices");
  TESSERA_CHECK(index.dim() <= 1, "index_select: index must be 1-D, got ", detail::describe(index));
  TESSERA_CHECK(x.dim() >= 1, "index_select: input ", detail::describe(x), " has no dims");
  const int64_t dim = wrap_dim(dim_in, x.dim(), "index_select");
  // Gather rows of x viewed as [size(dim), rest]: move dim to the front first.
  std::vector<int64_t> order(x.dim());
  std::iota(order.begin(), order.end(), 0);
  order.erase(order.begin() + dim);
  order.insert(order.begin(), dim);
  const Tensor moved = raw::permute(x, order);
  const int64_t rows = x.shape()[dim];
  const int64_t rest = rows == 0 ? 0 : x.numel() / rows;
  Tensor table = raw::reshape(moved, {rows, rest});
  Tensor gathered = embedding(table, raw::reshape(index, {index.numel()}));  // [n, rest]
  Shape moved_shape = moved.shape();
  moved_shape[0] = index.numel();
  Tensor out = raw::view(gathered, moved_shape);
  std::vector<int64_t> inverse(x.dim());
  for (int64_t i = 0; i < x.dim(); ++i) inverse[order[i]] = i;
  return raw::contiguous(raw::permute(out, inverse));
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim_in) {
  TESSERA_CHECK(!xs.empty(), "cat: expects a non-empty list of tensors");
  const Tensor& first = xs.front();
  TESSERA_CHECK(first.defined(), "cat: tensor 0 is undefined");
  TESSERA_CHECK(first.dim() >= 1, "cat: zero-dimensional tensor 0 cannot be concatenated");
  const int64_t dim = wrap_dim(dim_in, first.dim(), "cat");
  Shape shape = first.shape();
  shape[dim] = 0;
  DType dtype = first.dtype();
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& t = xs[i];
    TESSERA_CHECK(t.defined(), "cat: tensor ", i, " is undefined");
    TESSERA_CHECK(t.device() == first.device(), "cat: tensor ", i, " ", detail::describe(t),
                  " is on another device than tensor 0 ", detail::describe(first));
    bool ok = t.dim() == first.dim();
    for (int64_t d = 0; ok && d < t.dim(); ++d) ok = d == dim || t.shape()[d] == first.shape()[d];
    TESSERA_CHECK(ok, "cat: tensor ", i, " ", detail::describe(t), " does not match tensor 0 ",
                  detail::describe(first), " outside dimension ", dim);
    shape[dim] += t.shape()[dim];
    dtype = promote_types(dtype, t.dtype());
  }
  Tensor out = empty(shape, {.dtype = dtype, .device = first.device()});
  int64_t at = 0;
  for (const Tensor& t : xs) {
    const int64_t n = t.shape()[dim];
    if (n > 0) raw::copy_(raw::narrow(out, dim, at, n), t);
    at += n;
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim_in) {
  TESSERA_CHECK(!xs.empty(), "stack: expects a non-empty list of tensors");
  TESSERA_CHECK(xs.front().defined(), "stack: tensor 0 is undefined");
  const int64_t dim = wrap_dim(dim_in, xs.front().dim() + 1, "stack");
  std::vector<Tensor> views;
  for (size_t i = 0; i < xs.size(); ++i) {
    TESSERA_CHECK(xs[i].defined() && xs[i].shape() == xs.front().shape(), "stack: tensor ", i, " ",
                  detail::describe(xs[i]), " does not have the shape of tensor 0 ",
                  detail::describe(xs.front()));
    views.push_back(raw::unsqueeze(xs[i], dim));
  }
  return cat(views, dim);
}

std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes,
                                int64_t dim_in) {
  detail::common_device("split", {&x});
  TESSERA_CHECK(x.dim() >= 1, "split: zero-dimensional tensor cannot be split");
  const int64_t dim = wrap_dim(dim_in, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    TESSERA_CHECK(s >= 0, "split: negative size in ", shape_str(sizes));
    total += s;
  }
  TESSERA_CHECK(total == x.shape()[dim], "split: sizes ", shape_str(sizes), " sum to ", total,
                " but dimension ", dim, " of ", detail::describe(x), " has ", x.shape()[dim]);
  std::vector<Tensor> out;
  int64_t at = 0;
  for (int64_t s : sizes) {
    out.push_back(raw::narrow(x, dim, at, s));
    at += s;
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim_in) {
  detail::common_device("split", {&x});
  TESSERA_CHECK(x.dim() >= 1, "split: zero-dimensional tensor cannot be split");
  TESSERA_CHECK(split_size > 0, "split: split_size must be positive, got ", split_size);
  const int64_t dim = wrap_dim(dim_in, x.dim(), "split");
  const int64_t n = x.shape()[dim];
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < n; at += split_size) sizes.push_back(std::min(split_size, n - at));
  if (sizes.empty()) sizes.push_back(0);
  return split_sizes(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim_in) {
  detail::common_device("chunk", {&x});
  TESSERA_CHECK(chunks > 0, "chunk: number of chunks must be positive, got ", chunks);
  TESSERA_CHECK(x.dim() >= 1, "chunk: zero-dimensional tensor cannot be chunked");
  const int64_t n = x.shape()[wrap_dim(dim_in, x.dim(), "chunk")];
  const int64_t size = std::max<int64_t>(1, (n + chunks - 1) / chunks);
  return split(x, size, dim_in);
}

}  // namespace tessera::ops
