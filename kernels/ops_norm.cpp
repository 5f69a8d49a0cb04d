// Front-end of the row norms over the last dim: layer norm and RMSNorm, forward and
// backward, each alone or with the residual add of a pre-norm block fused in (and, for
// layer norm, the bias of the projection before it). Kernels: kernels/cpu/layer_norm.cpp,
// rms_norm.cpp; kernels/cuda/layer_norm.cu, rms_norm.cu.
#include <numeric>
#include <vector>

#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

using detail::check_float;
using detail::check_same_shape;
using detail::row_shape;
using detail::stat_dtype;

namespace {

// The input of a row norm: a float tensor with a non-empty last dim.
void check_row_input(const char* op, const Tensor& x) {
  check_float(op, x, "input");
  TESSERA_CHECK(x.dim() >= 1 && x.shape().back() > 0, op, ": input ", detail::describe(x),
                " needs a non-empty last dimension");
}

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
  check_row_input(op, x);
  check_norm_param(op, weight, "weight", x);
  check_norm_param(op, bias, "bias", x);
}

// A saved per-row statistic (mean, rstd) of x, uninitialised.
Tensor row_stat(const Tensor& x, Device dev) {
  return empty(row_shape(x), {.dtype = stat_dtype(x.dtype()), .device = dev});
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
    const DType want = stat_dtype(x.dtype());
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
  LayerNormOutput r{empty(x.shape(), {.dtype = x.dtype(), .device = dev}), row_stat(x, dev),
                    row_stat(x, dev)};
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
  ResidualLayerNormOutput r{empty(x.shape(), like), empty(x.shape(), like), row_stat(x, dev),
                            row_stat(x, dev)};
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

namespace {

void check_rms_input(const char* op, const Tensor& x, const Tensor& weight) {
  check_row_input(op, x);
  if (!weight.defined()) return;
  TESSERA_CHECK(weight.dim() == 1 && weight.size(0) == x.shape().back() &&
                    weight.dtype() == x.dtype() && weight.device() == x.device(),
                op, ": weight ", detail::describe(weight), " must be [", x.shape().back(),
                "] of the input's dtype and device (input ", detail::describe(x), ")");
}

}  // namespace

RmsNormOutput rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Device dev = detail::common_device("rms_norm", {&x});
  check_rms_input("rms_norm", x, weight);
  TESSERA_CHECK(eps >= 0, "rms_norm: eps must be non-negative, got ", eps);
  RmsNormOutput r{empty(x.shape(), {.dtype = x.dtype(), .device = dev}), row_stat(x, dev)};
  if (x.numel() > 0) {
    checked_kernel(detail::kernels_for(dev).rms_norm, "rms_norm", dev)(x, weight, eps, r.out,
                                                                       r.rstd);
  }
  return r;
}

namespace {

// The checks and outputs of both backward forms; `kernel` fills them.
template <class Kernel>
RmsNormGrads rms_norm_backward_with(const char* op, const Tensor& dy, const Tensor& x,
                                    const Tensor& weight, const Tensor& rstd, bool need_weight_grad,
                                    Kernel&& kernel) {
  const Device dev = detail::common_device(op, {&dy, &x, &rstd});
  check_rms_input(op, x, weight);
  TESSERA_CHECK(rstd.shape() == row_shape(x) && rstd.dtype() == stat_dtype(x.dtype()), op,
                ": saved rstd ", detail::describe(rstd), " must be ",
                dtype_name(stat_dtype(x.dtype())), shape_str(row_shape(x)));
  const Tensor dyc = detail::like_input(op, "gradient", dy, x);
  RmsNormGrads g;
  g.dx = empty(x.shape(), {.dtype = x.dtype(), .device = dev});
  if (need_weight_grad && weight.defined()) {
    g.dweight = zeros({x.shape().back()}, {.dtype = x.dtype(), .device = dev});
  }
  if (x.numel() > 0) kernel(dev, dyc, g);
  return g;
}

}  // namespace

RmsNormGrads rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd, bool need_weight_grad) {
  return rms_norm_backward_with("rms_norm_backward", dy, x, weight, rstd, need_weight_grad,
                                [&](Device dev, const Tensor& dyc, RmsNormGrads& g) {
                                  checked_kernel(detail::kernels_for(dev).rms_norm_backward,
                                                 "rms_norm_backward",
                                                 dev)(dyc, x, weight, rstd, g.dx, g.dweight);
                                });
}

ResidualRmsNormOutput residual_rms_norm(const Tensor& x, const Tensor& residual,
                                        const Tensor& weight, double eps) {
  const char* op = "residual_rms_norm";
  const Device dev = detail::common_device(op, {&x, &residual});
  check_rms_input(op, x, weight);
  TESSERA_CHECK(residual.shape() == x.shape() && residual.dtype() == x.dtype(), op, ": residual ",
                detail::describe(residual), " must match the input ", detail::describe(x));
  TESSERA_CHECK(eps >= 0, op, ": eps must be non-negative, got ", eps);
  const auto fused = fused_kernel_table(dev.type).residual_rms_norm;
  if (fused == nullptr || x.numel() == 0) {
    // The composition: the add, then the norm of the rounded sum (what the kernel computes).
    Tensor sum = binary(BinaryOp::Add, x, residual);
    RmsNormOutput r = rms_norm(sum, weight, eps);
    return {sum, r.out, r.rstd};
  }
  const TensorOptions like{.dtype = x.dtype(), .device = dev};
  ResidualRmsNormOutput r{empty(x.shape(), like), empty(x.shape(), like), row_stat(x, dev)};
  fused(x, residual, r.sum, weight, eps, r.out, r.rstd);
  return r;
}

RmsNormGrads rms_norm_backward_residual(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                        const Tensor& rstd, const Tensor& dresidual,
                                        bool need_weight_grad) {
  const char* op = "rms_norm_backward_residual";
  const Tensor dres = detail::like_input(op, "residual gradient", dresidual, x);
  return rms_norm_backward_with(
      op, dy, x, weight, rstd, need_weight_grad,
      [&](Device dev, const Tensor& dyc, RmsNormGrads& g) {
        if (const auto fused = fused_kernel_table(dev.type).rms_norm_backward_residual) {
          fused(dyc, x, weight, rstd, dres, g.dx, g.dweight);
          return;
        }
        checked_kernel(detail::kernels_for(dev).rms_norm_backward, op, dev)(dyc, x, weight, rstd,
                                                                            g.dx, g.dweight);
        binary_(BinaryOp::Add, g.dx, dres);
      });
}

}  // namespace tessera::ops
