// Front-end of the Llama-style layer kernels: RMSNorm (forward/backward, alone or with the
// residual add of a pre-norm block fused in) and rotary position embeddings (tables and
// rotation).
#include <cmath>
#include <vector>

#include "tessera/core/fused_dispatch.h"
#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {
namespace {

Shape row_shape(const Tensor& x) { return Shape(x.shape().begin(), x.shape().end() - 1); }

// Statistics and tables keep f64 for f64 inputs, f32 otherwise.
DType stat_dtype(DType x) { return x == DType::f64 ? DType::f64 : DType::f32; }

void check_rms_input(const char* op, const Tensor& x, const Tensor& weight) {
  TESSERA_CHECK(is_floating(x.dtype()), op, ": input must be a float tensor, got ",
                detail::describe(x));
  TESSERA_CHECK(x.dim() >= 1 && x.shape().back() > 0, op, ": input ", detail::describe(x),
                " needs a non-empty last dimension");
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
  RmsNormOutput r{empty(x.shape(), {.dtype = x.dtype(), .device = dev}),
                  empty(row_shape(x), {.dtype = stat_dtype(x.dtype()), .device = dev})};
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
  ResidualRmsNormOutput r{empty(x.shape(), like), empty(x.shape(), like),
                          empty(row_shape(x), {.dtype = stat_dtype(x.dtype()), .device = dev})};
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

RopeTables rope_tables(int64_t start, int64_t count, int64_t head_dim, double theta, DType dtype,
                       Device device) {
  TESSERA_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "rope_tables: head_dim must be even and "
                "positive, got ",
                head_dim);
  TESSERA_CHECK(start >= 0 && count >= 0 && theta > 0, "rope_tables: start ", start, ", count ",
                count, " and theta ", theta, " must be non-negative (theta positive)");
  const int64_t half = head_dim / 2;
  // Angles in f64 (exact to f32 and f64 rounding of the result, at any position).
  std::vector<double> cos_values(count * half), sin_values(count * half);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
    for (int64_t p = 0; p < count; ++p) {
      const double angle = static_cast<double>(start + p) * inv_freq;
      cos_values[p * half + i] = std::cos(angle);
      sin_values[p * half + i] = std::sin(angle);
    }
  }
  const TensorOptions host{.dtype = stat_dtype(dtype)};
  RopeTables t{from_vector<double>(cos_values, {count, half}, host),
               from_vector<double>(sin_values, {count, half}, host)};
  if (!device.is_cpu()) {
    t.cos = raw::to(t.cos, device, t.cos.dtype());
    t.sin = raw::to(t.sin, device, t.sin.dtype());
  }
  return t;
}

void rope_into(const Tensor& x, const RopeTables& tables, bool inverse, const Tensor& out) {
  const Device dev = detail::common_device("rope", {&x, &tables.cos, &tables.sin, &out});
  TESSERA_CHECK(is_floating(x.dtype()) && x.dim() == 4 && x.size(3) % 2 == 0, "rope: input ",
                detail::describe(x), " must be a float [B, T, H, D] tensor with an even D");
  TESSERA_CHECK(out.shape() == x.shape() && out.dtype() == x.dtype(), "rope: output ",
                detail::describe(out), " must have the input's shape and dtype ",
                detail::describe(x));
  check_no_internal_overlap("rope", out);
  const Shape want{x.size(1), x.size(3) / 2};
  const DType table_dtype = stat_dtype(x.dtype());
  for (const Tensor* t : {&tables.cos, &tables.sin}) {
    TESSERA_CHECK(t->shape() == want, "rope: tables ", detail::describe(*t), " must be ",
                  shape_str(want), " ([T, D/2]) for input ", detail::describe(x));
  }
  const Tensor cos = raw::contiguous(raw::to(tables.cos, dev, table_dtype));
  const Tensor sin = raw::contiguous(raw::to(tables.sin, dev, table_dtype));
  if (out.numel() > 0)
    checked_kernel(detail::kernels_for(dev).rope, "rope", dev)(x, cos, sin, inverse, out);
}

Tensor rope(const Tensor& x, const RopeTables& tables, bool inverse) {
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  rope_into(x, tables, inverse, out);
  return out;
}

}  // namespace tessera::ops
