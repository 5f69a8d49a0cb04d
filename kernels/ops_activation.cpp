// Front-end of the activations with kernels of their own: GELU (tanh form) forward and
// backward, as element-wise entries of the kernel row.
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

using detail::check_float;
using detail::check_same_shape;

Tensor gelu(const Tensor& x) {
  check_float("gelu", x, "input");
  return unary(UnaryOp::Gelu, x);
}

Tensor gelu_backward(const Tensor& x, const Tensor& dy) {
  detail::common_device("gelu_backward", {&x, &dy});
  check_float("gelu_backward", x, "input");
  check_same_shape("gelu_backward", x, "input", dy, "gradient");
  Tensor out = binary(BinaryOp::GeluBackward, x, dy);
  return out.dtype() == x.dtype() ? out : raw::to(out, x.device(), x.dtype());
}

}  // namespace tessera::ops
