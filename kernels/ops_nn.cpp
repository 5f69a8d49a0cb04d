// Front-end of the fused neural-network ops: softmax / log_softmax, layer norm, GELU and
// cross-entropy, forward and backward.
#include <cmath>
#include <numeric>

#include "tessera/core/fused_dispatch.h"
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {
namespace {

void check_float(const char* op, const Tensor& t, const char* role) {
  TESSERA_CHECK(is_floating(t.dtype()), op, ": ", role, " must be a float tensor, got ",
                detail::describe(t));
}

void check_same_shape(const char* op, const Tensor& a, const char* a_role, const Tensor& b,
                      const char* b_role) {
  TESSERA_CHECK(a.shape() == b.shape(), op, ": ", a_role, " ", detail::describe(a), " and ",
                b_role, " ", detail::describe(b), " must have the same shape");
}

Tensor softmax_impl(const Tensor& x, int64_t dim_in, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  const Device dev = detail::common_device(name, {&x});
  check_float(name, x, "input");
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (x.dim() == 0) {  // a scalar is a one-element row
    raw::fill_(out, log ? 0.0 : 1.0);
    return out;
  }
  const int64_t dim = wrap_dim(dim_in, x.dim(), name);
  if (out.numel() > 0) checked_kernel(detail::kernels_for(dev).softmax, name, dev)(x, dim, log, out);
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

Tensor softmax_backward(const Tensor& y, const Tensor& dy, int64_t dim_in, bool log) {
  const char* name = log ? "log_softmax_backward" : "softmax_backward";
  const Device dev = detail::common_device(name, {&y, &dy});
  check_float(name, y, "output");
  check_same_shape(name, y, "output", dy, "gradient");
  Tensor dyc = dy.dtype() == y.dtype() ? dy : raw::to(dy, dev, y.dtype());
  Tensor dx = empty(y.shape(), {.dtype = y.dtype(), .device = dev});
  if (y.dim() == 0) {
    raw::fill_(dx, 0.0);  // softmax of one element is constant
    return dx;
  }
  const int64_t dim = wrap_dim(dim_in, y.dim(), name);
  if (dx.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).softmax_backward, name, dev)(y, dyc, dim, log, dx);
  }
  return dx;
}

namespace {
void check_norm_param(const char* op, const Tensor& p, const char* role, const Tensor& x) {
  if (!p.defined()) return;
  TESSERA_CHECK(p.dim() == 1 && p.shape()[0] == x.shape().back(), op, ": ", role, " ",
                detail::describe(p), " must be [", x.shape().back(), "] for input ",
                detail::describe(x));
  TESSERA_CHECK(p.dtype() == x.dtype(), op, ": ", role, " ", detail::describe(p),
                " must have the input's dtype (input ", detail::describe(x), ")");
  TESSERA_CHECK(p.device() == x.device(), op, ": ", role, " ", detail::describe(p),
                " is on another device than the input ", detail::describe(x));
}

void check_layer_norm_operands(const char* op, const Tensor& x, const Tensor& weight,
                               const Tensor& bias) {
  check_float(op, x, "input");
  TESSERA_CHECK(x.dim() >= 1 && x.shape().back() > 0, op, ": input ", detail::describe(x),
                " needs a non-empty last dimension");
  check_norm_param(op, weight, "weight", x);
  check_norm_param(op, bias, "bias", x);
}

Shape row_shape(const Tensor& x) { return Shape(x.shape().begin(), x.shape().end() - 1); }

// Saved row statistics are f64 for f64 inputs (an f64 backward stays f64-accurate), f32 else.
DType layer_norm_stat_dtype(DType x) { return x == DType::f64 ? DType::f64 : DType::f32; }

Tensor layer_norm_stat(const Tensor& x, Device dev) {
  return empty(row_shape(x), {.dtype = layer_norm_stat_dtype(x.dtype()), .device = dev});
}

// The checks and outputs of both backward forms; `kernel(dev, dy converted, grads)` fills them.
template <class Kernel>
// kernel_writes_param_grads: the kernel overwrites dweight/dbias (else it adds into zeros).
LayerNormGrads layer_norm_backward_with(const char* op, const Tensor& dy, const Tensor& x,
                                        const Tensor& weight, const Tensor& mean,
                                        const Tensor& rstd, bool need_weight_grads,
                                        bool kernel_writes_param_grads, Kernel&& kernel) {
  const Device dev = detail::common_device(op, {&dy, &x, &mean, &rstd});
  check_float(op, x, "input");
  check_same_shape(op, x, "input", dy, "gradient");
  TESSERA_CHECK(x.dim() >= 1, op, ": input ", detail::describe(x), " has no dims");
  check_norm_param(op, weight, "weight", x);
  for (const Tensor* stat : {&mean, &rstd}) {
    const DType want = layer_norm_stat_dtype(x.dtype());
    TESSERA_CHECK(stat->shape() == row_shape(x) && stat->dtype() == want, op, ": saved statistics ",
                  detail::describe(*stat), " must be ", dtype_name(want), shape_str(row_shape(x)),
                  " for input ", detail::describe(x));
  }
  LayerNormGrads g;
  const Tensor dyc = dy.dtype() == x.dtype() ? dy : raw::to(dy, dev, x.dtype());
  g.dx = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (need_weight_grads) {
    const TensorOptions like{.dtype = x.dtype(), .device = dev};
    const bool written = kernel_writes_param_grads && x.numel() > 0;
    g.dweight = written ? empty({x.shape().back()}, like) : zeros({x.shape().back()}, like);
    g.dbias = written ? empty({x.shape().back()}, like) : zeros({x.shape().back()}, like);
  }
  if (x.numel() > 0) kernel(dev, dyc, g);
  return g;
}
}  // namespace

LayerNormOutput layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const Device dev = detail::common_device("layer_norm", {&x});
  check_layer_norm_operands("layer_norm", x, weight, bias);
  LayerNormOutput r{empty(x.shape(), {.dtype = x.dtype(), .device = dev}), layer_norm_stat(x, dev),
                    layer_norm_stat(x, dev)};
  if (x.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).layer_norm, "layer_norm", dev)(x, weight, bias, eps,
                                                                           r.out, r.mean, r.rstd);
  }
  return r;
}

LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                   const Tensor& mean, const Tensor& rstd, bool need_weight_grads) {
  const char* op = "layer_norm_backward";
  return layer_norm_backward_with(op, dy, x, weight, mean, rstd, need_weight_grads,
                                  /*kernel_writes_param_grads=*/false,
                                  [&](Device dev, const Tensor& dyc, LayerNormGrads& g) {
                                    checked_kernel(detail::kernels_for(dev).layer_norm_backward, op,
                                                   dev)(dyc, x, weight, mean, rstd, g.dx, g.dweight,
                                                        g.dbias);
                                  });
}

ResidualLayerNormOutput residual_layer_norm(const Tensor& x, const Tensor& residual,
                                            const Tensor& weight, const Tensor& bias, double eps,
                                            const Tensor& x_bias) {
  const char* op = "residual_layer_norm";
  const Device dev = detail::common_device(op, {&x, &residual});
  check_layer_norm_operands(op, x, weight, bias);
  TESSERA_CHECK(residual.shape() == x.shape() && residual.dtype() == x.dtype(), op, ": residual ",
                detail::describe(residual), " must match the input ", detail::describe(x),
                " (shape and dtype)");
  check_norm_param(op, x_bias, "x_bias", x);
  TESSERA_CHECK(eps >= 0, op, ": eps must be non-negative, got ", eps);
  const auto fused = fused_kernel_table(dev.type).residual_layer_norm;
  if (fused == nullptr || x.numel() == 0) {
    // The composition: the adds, then the norm of the rounded sum (what the kernel computes).
    const Tensor biased = x_bias.defined() ? binary(BinaryOp::Add, x, x_bias) : x;
    Tensor sum = binary(BinaryOp::Add, biased, residual);
    LayerNormOutput r = layer_norm(sum, weight, bias, eps);
    return {sum, r.out, r.mean, r.rstd};
  }
  const TensorOptions like{.dtype = x.dtype(), .device = dev};
  ResidualLayerNormOutput r{empty(x.shape(), like), empty(x.shape(), like), layer_norm_stat(x, dev),
                            layer_norm_stat(x, dev)};
  fused(x, residual, x_bias, weight, bias, eps, r.sum, r.out, r.mean, r.rstd);
  return r;
}

LayerNormGrads layer_norm_backward_residual(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                            const Tensor& mean, const Tensor& rstd,
                                            const Tensor& dresidual, bool need_weight_grads,
                                            bool need_x_bias_grad) {
  const char* op = "layer_norm_backward_residual";
  const Tensor dres =
      dresidual.defined() ? detail::like_input(op, "residual gradient", dresidual, x) : Tensor();
  // The fused kernel writes the parameter gradients; the plain one adds into zeros.
  const auto fused = fused_kernel_table(x.device().type).layer_norm_backward_residual;
  LayerNormGrads grads = layer_norm_backward_with(
      op, dy, x, weight, mean, rstd, need_weight_grads,
      /*kernel_writes_param_grads=*/fused != nullptr,
      [&](Device dev, const Tensor& dyc, LayerNormGrads& g) {
        if (fused) {
          if (need_x_bias_grad)
            g.dx_bias = empty({x.shape().back()}, {.dtype = x.dtype(), .device = dev});
          fused(dyc, x, weight, mean, rstd, dres, g.dx, g.dweight, g.dbias, g.dx_bias);
          return;
        }
        checked_kernel(detail::kernels_for(dev).layer_norm_backward, op, dev)(
            dyc, x, weight, mean, rstd, g.dx, g.dweight, g.dbias);
        if (dres.defined()) binary_(BinaryOp::Add, g.dx, dres);
      });
  if (need_x_bias_grad && !grads.dx_bias.defined()) {
    // The composition (and an empty x): dx summed over every dim but the last, as a Linear's
    // bias gradient is.
    std::vector<int64_t> rows(static_cast<size_t>(x.dim() - 1));
    std::iota(rows.begin(), rows.end(), int64_t(0));
    grads.dx_bias = rows.empty() ? grads.dx : sum(grads.dx, rows, false);
  }
  return grads;
}

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
