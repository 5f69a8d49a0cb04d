// Front-end of the losses: cross-entropy over the last (class) dim, forward (mean, sum or
// per-row) and backward. The fused classifier (losses and gradient in one pass) is reached
// through kernels/fused_table.h by autograd/functions_loss.cpp.
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

using detail::check_float;
using detail::row_shape;

namespace {

struct CrossEntropyRows {
  Tensor logits;   // [N, V]
  Tensor targets;  // [N]
};

CrossEntropyRows cross_entropy_rows(const char* op, const Tensor& logits, const Tensor& targets) {
  detail::common_device(op, {&logits, &targets});
  check_float(op, logits, "logits");
  TESSERA_CHECK(targets.dtype() == DType::i32 || targets.dtype() == DType::i64, op,
                ": targets must be int32 or int64, got ", detail::describe(targets));
  TESSERA_CHECK(logits.dim() >= 1, op, ": logits ", detail::describe(logits), " need a class dim");
  const Shape lead = row_shape(logits);
  TESSERA_CHECK(targets.shape() == lead, op, ": targets ", detail::describe(targets),
                " must have the shape of logits ", detail::describe(logits),
                " without its last (class) dimension, i.e. ", shape_str(lead));
  const int64_t V = logits.shape().back();
  return {raw::reshape(logits, {shape_numel(lead), V}), raw::reshape(targets, {shape_numel(lead)})};
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  const CrossEntropyRows rows = cross_entropy_rows("cross_entropy", logits, targets);
  const Device dev = logits.device();
  const int64_t N = rows.logits.shape()[0], V = rows.logits.shape()[1];
  if (reduction == Reduction::None) {
    // Per-row losses: -log_softmax gathered at each target, 0 for ignored rows.
    const Tensor ignored = binary(BinaryOp::Eq, rows.targets, static_cast<double>(ignore_index));
    const Tensor safe = where(ignored, zeros({}, {.dtype = rows.targets.dtype(), .device = dev}),
                              rows.targets);
    TESSERA_CHECK(N == 0 || (amin(safe).item() >= 0 && amax(safe).item() < V),
                  "cross_entropy: a target is out of range for ", V, " classes (targets ",
                  detail::describe(targets), ", ignore_index ", ignore_index, ")");
    const Tensor flat = raw::view(log_softmax(rows.logits, 1), {N * V, 1});
    const Tensor index = add(mul(arange(0, static_cast<double>(N), 1, {.dtype = DType::i64, .device = dev}),
                                 static_cast<double>(V)),
                             safe);
    const Tensor picked = raw::view(embedding(flat, index), {N});
    const Tensor loss = where(ignored, zeros({}, {.dtype = logits.dtype(), .device = dev}),
                              unary(UnaryOp::Neg, picked));
    return raw::view(loss, targets.shape());
  }
  // The sum of the row losses: f64 for f64 logits, so f64 stays f64 end to end.
  const DType total_dtype = logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor total = empty({}, {.dtype = total_dtype, .device = dev});
  Tensor count = empty({}, {.dtype = DType::i64, .device = dev});
  if (N == 0) {
    raw::fill_(total, 0.0);
    raw::fill_(count, 0.0);
  } else {
    checked_kernel(detail::kernels_for(dev).cross_entropy, "cross_entropy", dev)(
        rows.logits, rows.targets, ignore_index, total, count);
  }
  Tensor loss = reduction == Reduction::Mean ? div(total, count) : total;
  return loss.dtype() == logits.dtype() ? loss : raw::to(loss, dev, logits.dtype());
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, double grad,
                              int64_t ignore_index, Reduction reduction) {
  const CrossEntropyRows rows = cross_entropy_rows("cross_entropy_backward", logits, targets);
  TESSERA_CHECK(reduction != Reduction::None,
                "cross_entropy_backward: supports the Mean and Sum reductions only");
  const Device dev = logits.device();
  double scale = grad;
  if (reduction == Reduction::Mean) {
    const double used =
        sum(binary(BinaryOp::Ne, rows.targets, static_cast<double>(ignore_index))).item();
    scale = used > 0 ? grad / used : 0.0;
  }
  Tensor dlogits = empty(rows.logits.shape(), {.dtype = logits.dtype(), .device = dev});
  if (dlogits.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).cross_entropy_backward, "cross_entropy_backward", dev)(
        rows.logits, rows.targets, ignore_index, scale, dlogits);
  }
  return raw::view(dlogits, logits.shape());
}

}  // namespace tessera::ops
