// Front-end of matmul with PyTorch's semantics: 1-D operands are promoted to matrices and
// the added dim removed again; batch dims broadcast; [..., M, K] @ [K, N] folds the batch
// into M when that is a view, so a Linear layer is one large GEMM.
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  const Device dev = detail::common_device("matmul", {&a_in, &b_in});
  TESSERA_CHECK(a_in.dim() >= 1 && b_in.dim() >= 1, "matmul: both operands need at least one "
                "dimension, got ", detail::describe(a_in), " @ ", detail::describe(b_in));
  TESSERA_CHECK(a_in.dtype() == b_in.dtype(), "matmul: operands must have the same dtype, got ",
                detail::describe(a_in), " @ ", detail::describe(b_in));
  TESSERA_CHECK(a_in.dtype() != DType::boolean && a_in.dtype() != DType::u8,
                "matmul: dtype ", dtype_name(a_in.dtype()), " is not supported (",
                detail::describe(a_in), " @ ", detail::describe(b_in), ")");
  const bool a_vec = a_in.dim() == 1, b_vec = b_in.dim() == 1;
  Tensor a = a_vec ? raw::unsqueeze(a_in, 0) : a_in;  // [K] -> [1, K]
  Tensor b = b_vec ? raw::unsqueeze(b_in, 1) : b_in;  // [K] -> [K, 1]
  const int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1];
  const int64_t N = b.shape()[b.dim() - 1];
  TESSERA_CHECK(b.shape()[b.dim() - 2] == K, "matmul: inner dimensions differ: ",
                shape_str(a_in.shape()), " @ ", shape_str(b_in.shape()), " (", K, " vs ",
                b.shape()[b.dim() - 2], ")");

  const Shape a_batch(a.shape().begin(), a.shape().end() - 2);
  const Shape b_batch(b.shape().begin(), b.shape().end() - 2);
  Shape result_shape = raw::broadcast_shapes(a_batch, b_batch, "matmul");
  const Shape batch = result_shape;
  if (!a_vec) result_shape.push_back(M);
  if (!b_vec) result_shape.push_back(N);

  const auto kernel = checked_kernel(detail::kernels_for(dev).matmul, "matmul", dev);
  // [..., M, K] @ [K, N]: one [batch*M, K] @ [K, N] product when a's rows can be flattened.
  if (b.dim() == 2 && a.dim() > 2) {
    Tensor folded = raw::reshape(a, {shape_numel(a_batch) * M, K});
    if (folded.shares_storage(a)) {
      Tensor out = empty({folded.shape()[0], N}, {.dtype = a.dtype(), .device = dev});
      if (out.numel() > 0) kernel(folded, b, out);
      return raw::view(out, result_shape);
    }
  }
  Shape a_full = batch, b_full = batch, out_full = batch;
  a_full.insert(a_full.end(), {M, K});
  b_full.insert(b_full.end(), {K, N});
  out_full.insert(out_full.end(), {M, N});
  Tensor out = empty(out_full, {.dtype = a.dtype(), .device = dev});
  if (out.numel() > 0) kernel(detail::expanded(a, a_full), detail::expanded(b, b_full), out);
  return raw::view(out, result_shape);
}

void matmul_out(const Tensor& a, const Tensor& b, const Tensor& out) {
  const Device dev = detail::common_device("matmul_out", {&a, &b, &out});
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
                    out.shape() == Shape({a.size(0), b.size(1)}),
                "matmul_out: expected a [M, K] @ b [K, N] into out [M, N], got ",
                detail::describe(a), " @ ", detail::describe(b), " into ", detail::describe(out));
  TESSERA_CHECK(a.dtype() == b.dtype() && out.dtype() == a.dtype() && out.is_contiguous(),
                "matmul_out: out (", detail::describe(out), ") must be contiguous and of the "
                "operands' dtype (", detail::describe(a), " @ ", detail::describe(b), ")");
  TESSERA_CHECK(a.dtype() != DType::boolean && a.dtype() != DType::u8, "matmul_out: dtype ",
                dtype_name(a.dtype()), " is not supported");
  if (out.numel() > 0) checked_kernel(detail::kernels_for(dev).matmul, "matmul", dev)(a, b, out);
}

}  // namespace tessera::ops
