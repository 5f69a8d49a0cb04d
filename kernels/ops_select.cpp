// Front-end of running sums, top-k, gather/scatter and sampling.
//
// gather and scatter_add are built on the embedding / index_add kernels of every device: an
// element's position in a contiguous tensor is a flat row of a [numel, 1] matrix, so
// "x[..., index[...], ...]" is "row lin of x viewed as [numel, 1]" with lin computed from
// the index and the strides. No device needs a kernel of its own for them.
#include <cmath>

#include "tessera/core/random.h"
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {
namespace {

// Checks an index for gather/scatter along dim of x (PyTorch's rule: same rank, each size at
// most x's except along dim) and its values in [0, x.size(dim)).
void check_gather_index(const char* op, const Tensor& x, int64_t dim, const Tensor& index) {
  detail::check_index_dtype(op, index, "index");
  TESSERA_CHECK(index.dim() == x.dim(), op, ": index ", detail::describe(index),
                " must have as many dims as the input ", detail::describe(x));
  for (int64_t d = 0; d < x.dim(); ++d) {
    TESSERA_CHECK(d == dim || index.size(d) <= x.size(d), op, ": index ", detail::describe(index),
                  " is larger than the input ", detail::describe(x), " in dim ", d);
  }
  if (index.numel() == 0) return;
  const double lo = amin(index).item(), hi = amax(index).item();
  TESSERA_CHECK(lo >= 0 && hi < static_cast<double>(x.size(dim)), op, ": index value ",
                lo < 0 ? lo : hi, " is out of range for dim ", dim, " of size ", x.size(dim),
                " (input ", detail::describe(x), ")");
}

// Flat positions (i64, index's shape) in a contiguous tensor of `shape` of the elements an
// index along dim names.
Tensor flat_positions(const Shape& shape, int64_t dim, const Tensor& index) {
  const Device dev = index.device();
  const Shape strides = contiguous_strides(shape);
  Tensor lin = mul(raw::to(index, dev, DType::i64), static_cast<double>(strides[dim]));
  for (int64_t d = 0; d < index.dim(); ++d) {
    if (d == dim || index.size(d) == 1) continue;
    Shape along(index.dim(), 1);
    along[d] = index.size(d);
    Tensor coord =
        arange(0, static_cast<double>(index.size(d)), 1, {.dtype = DType::i64, .device = dev});
    lin = add(lin, mul(raw::view(coord, along), static_cast<double>(strides[d])));
  }
  return raw::reshape(lin, {index.numel()});
}

// src restricted to the index's shape (scatter reads only that corner of a larger src).
Tensor corner(const Tensor& src, const Shape& shape) {
  Tensor t = src;
  for (int64_t d = 0; d < src.dim(); ++d) t = raw::narrow(t, d, 0, shape[d]);
  return t;
}

}  // namespace

Tensor cumsum(const Tensor& input, int64_t dim_in, bool reverse) {
  const Device dev = detail::common_device("cumsum", {&input});
  // Integer sums are int64 (as PyTorch), so they cannot wrap around in a narrower type.
  const Tensor x = is_integral(input.dtype()) ? raw::to(input, dev, DType::i64) : input;
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (x.dim() == 0) {
    raw::copy_(out, x);
    return out;
  }
  const int64_t dim = wrap_dim(dim_in, x.dim(), "cumsum");
  if (out.numel() > 0)
    checked_kernel(detail::kernels_for(dev).cumsum, "cumsum", dev)(x, dim, reverse, out);
  return out;
}

TopK topk(const Tensor& x, int64_t k, int64_t dim_in, bool largest) {
  const Device dev = detail::common_device("topk", {&x});
  const Tensor lanes = x.dim() == 0 ? raw::reshape(x, {1}) : x;
  const int64_t dim = wrap_dim(dim_in, lanes.dim(), "topk");
  TESSERA_CHECK(k >= 0 && k <= lanes.size(dim), "topk: k = ", k, " is out of range for dim ", dim,
                " of ", detail::describe(x));
  Shape shape = lanes.shape();
  shape[dim] = k;
  TopK r{empty(shape, {.dtype = x.dtype(), .device = dev}),
         empty(shape, {.dtype = DType::i64, .device = dev})};
  if (r.values.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).topk, "topk", dev)(lanes, k, dim, largest, r.values,
                                                               r.indices);
  }
  if (x.dim() == 0) return {raw::reshape(r.values, {}), raw::reshape(r.indices, {})};
  return r;
}

Tensor gather(const Tensor& x, int64_t dim_in, const Tensor& index) {
  const Device dev = detail::common_device("gather", {&x, &index});
  if (x.dim() == 0) {
    wrap_dim(dim_in, 1, "gather");
    return raw::reshape(gather(raw::reshape(x, {1}), 0, raw::reshape(index, {1})), {});
  }
  const int64_t dim = wrap_dim(dim_in, x.dim(), "gather");
  check_gather_index("gather", x, dim, index);
  if (index.numel() == 0) return empty(index.shape(), {.dtype = x.dtype(), .device = dev});
  const Tensor rows = raw::view(raw::contiguous(x), {x.numel(), 1});
  return raw::view(embedding(rows, flat_positions(x.shape(), dim, index)), index.shape());
}

Tensor scatter_add(const Tensor& x, int64_t dim_in, const Tensor& index, const Tensor& src) {
  const Device dev = detail::common_device("scatter_add", {&x, &index, &src});
  TESSERA_CHECK(x.dim() >= 1, "scatter_add: input ", detail::describe(x), " needs a dim");
  const int64_t dim = wrap_dim(dim_in, x.dim(), "scatter_add");
  check_gather_index("scatter_add", x, dim, index);
  TESSERA_CHECK(src.dim() == index.dim(), "scatter_add: src ", detail::describe(src),
                " must have the index's rank ", index.dim());
  for (int64_t d = 0; d < src.dim(); ++d) {
    TESSERA_CHECK(src.size(d) >= index.size(d), "scatter_add: src ", detail::describe(src),
                  " is smaller than the index ", detail::describe(index), " in dim ", d);
  }
  Tensor out = raw::clone(x);  // contiguous, never x's memory
  if (index.numel() == 0) return out;
  const Tensor part = raw::to(corner(src, index.shape()), dev, x.dtype());
  index_add_(raw::view(out, {out.numel(), 1}), 0, flat_positions(x.shape(), dim, index),
             raw::reshape(part, {index.numel(), 1}));
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim_in, const Tensor& index, const Tensor& src) {
  const Device dev = detail::common_device("scatter", {&x, &index, &src});
  TESSERA_CHECK(x.dim() >= 1, "scatter: input ", detail::describe(x), " needs a dim");
  const int64_t dim = wrap_dim(dim_in, x.dim(), "scatter");
  const Tensor ones_like_index = ones(index.shape(), {.dtype = DType::i64, .device = dev});
  const Tensor hits = scatter_add(zeros(x.shape(), {.dtype = DType::i64, .device = dev}), dim,
                                  index, ones_like_index);
  // Which of two writes to one position lands is unspecified in PyTorch; here it is refused.
  TESSERA_CHECK(hits.numel() == 0 || amax(hits).item() <= 1, "scatter: the index ",
                detail::describe(index), " writes some position of dim ", dim,
                " more than once (use scatter_add to sum such writes)");
  const Tensor written = binary(BinaryOp::Gt, hits, 0.0);
  const Tensor values =
      scatter_add(zeros(x.shape(), {.dtype = x.dtype(), .device = dev}), dim, index, src);
  return where(written, values, x);
}

Tensor multinomial(const Tensor& probs, int64_t num_samples, Generator* gen) {
  const Device dev = detail::common_device("multinomial", {&probs});
  TESSERA_CHECK(
      is_floating(probs.dtype()) && (probs.dim() == 1 || probs.dim() == 2) && probs.size(-1) > 0,
      "multinomial: probabilities must be a float [V] or [B, V] tensor with V > 0, got ",
      detail::describe(probs));
  TESSERA_CHECK(num_samples > 0, "multinomial: num_samples must be positive, got ", num_samples);
  const DType acc = probs.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor p = raw::to(probs, dev, acc);
  const double smallest = amin(p).item();  // NaN when any is NaN
  TESSERA_CHECK(!std::isnan(smallest), "multinomial: probabilities contain NaN (",
                detail::describe(probs), ")");
  TESSERA_CHECK(smallest >= 0, "multinomial: probabilities must be non-negative (",
                detail::describe(probs), ")");
  TESSERA_CHECK(std::isfinite(amax(p).item()), "multinomial: probabilities contain infinity (",
                detail::describe(probs), ")");
  const Tensor cdf = cumsum(p, -1);
  const Tensor total = raw::narrow(cdf, -1, cdf.size(-1) - 1, 1);  // [..., 1]
  TESSERA_CHECK(amin(total).item() > 0, "multinomial: a row of ", detail::describe(probs),
                " sums to zero");
  // Sample j of a row is the number of cdf entries <= u_j (u uniform in [0, total)): the
  // category whose interval [cdf[i-1], cdf[i]) holds u_j; zero-probability ones have none.
  Shape u_shape = p.shape();
  u_shape.back() = num_samples;
  const Tensor u = mul(rand(u_shape, {.dtype = acc, .device = dev}, gen), total);
  const Tensor below = binary(BinaryOp::Le, raw::unsqueeze(cdf, -2), raw::unsqueeze(u, -1));
  const Tensor count = sum(below, {-1});
  // u rounds up to total at most in the last place: never past the last category.
  return binary(BinaryOp::Minimum, count, static_cast<double>(p.size(-1) - 1));
}

Tensor sample_logits(const Tensor& logits, double temperature, int64_t top_k, Generator* gen) {
  detail::common_device("sample_logits", {&logits});
  TESSERA_CHECK(logits.dim() == 2 && is_floating(logits.dtype()),
                "sample_logits: logits must be a float [B, V] tensor, got ",
                detail::describe(logits));
  TESSERA_CHECK(temperature >= 0 && top_k >= 0, "sample_logits: temperature ", temperature,
                " and top_k ", top_k, " must be non-negative");
  if (temperature == 0) return argmax(logits, -1);
  const DType acc = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor scaled = mul(raw::to(logits, logits.device(), acc), 1.0 / temperature);
  if (top_k > 0 && top_k < logits.size(1)) {
    // Everything below the k-th largest logit of its row is never drawn.
    const Tensor kth = raw::narrow(topk(scaled, top_k, -1, true).values, -1, top_k - 1, 1);
    scaled = masked_fill(scaled, binary(BinaryOp::Lt, scaled, kth), -INFINITY);
  }
  return raw::view(multinomial(softmax(scaled, -1), 1, gen), {logits.size(0)});
}

}  // namespace tessera::ops
