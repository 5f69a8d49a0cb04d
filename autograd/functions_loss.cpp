// Differentiable losses: cross_entropy (ops::cross_entropy forward, its backward from the
// saved logits) and fused_cross_entropy, whose forward computes the per-row losses and the
// logits' gradient in one pass (the device's fused `classifier`, kernels/fused_table.h), so
// the backward is only a scaling.
#include "tessera/autograd/functions.h"
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/fused_table.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  const ops::Reduction op_reduction = reduction == Reduction::Mean  ? ops::Reduction::Mean
                                      : reduction == Reduction::Sum ? ops::Reduction::Sum
                                                                    : ops::Reduction::None;
  Tensor loss = ops::cross_entropy(logits, targets, ignore_index, op_reduction);
  record("CrossEntropyBackward", {logits, targets}, {loss},
         [sl = SavedTensor::input(logits), st = SavedTensor::input(targets), ignore_index,
          op_reduction](const BackwardArgs& a) {
           const Tensor logits = sl.unpack("CrossEntropyBackward"),
                        targets = st.unpack("CrossEntropyBackward");
           if (op_reduction != ops::Reduction::None) {
             // One scalar scales every row; reading it costs one sync, cheaper than a pass over [N,
             // V].
             return Grads{ops::cross_entropy_backward(logits, targets, a.grad().item(),
                                                      ignore_index, op_reduction),
                          Tensor()};
           }
           // Per-row losses: (softmax - onehot) of each row times that row's gradient.
           Tensor per_row =
               ops::cross_entropy_backward(logits, targets, 1.0, ignore_index, ops::Reduction::Sum);
           return Grads{ops::mul(per_row, ops::unsqueeze(a.grad(), a.grad().dim())), Tensor()};
         });
  return loss;
}

Tensor fused_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                           Reduction reduction, bool consume_logits) {
  const char* op = "fused_cross_entropy";
  TESSERA_CHECK(logits.defined() && logits.dim() >= 1, op,
                ": logits must be a tensor [..., V], got ",
                logits.defined() ? autograd::describe(logits) : std::string("undefined"));
  const auto fused_classifier = fused_kernel_table(logits.device().type).classifier;
  TESSERA_CHECK(fused_classifier != nullptr, op, ": no fused classifier kernel for ",
                logits.device().str(), " tensors (logits ", autograd::describe(logits),
                "); use cross_entropy, or put the logits on a CUDA device");
  TESSERA_CHECK(is_floating(logits.dtype()) && logits.dtype() != DType::f64, op,
                ": logits must be f32, f16 or bf16, got ", autograd::describe(logits));
  Shape row_shape(logits.shape().begin(), logits.shape().end() - 1);
  TESSERA_CHECK(targets.shape() == row_shape && targets.device() == logits.device(), op,
                ": targets must be ", shape_str(row_shape), " on ", logits.device().str(), ", got ",
                autograd::describe(targets));
  const int64_t V = logits.size(-1);
  const int64_t rows = logits.numel() / std::max<int64_t>(V, 1);
  // The kernel overwrites its input with the gradient: work on a private copy unless the
  // caller hands the logits over (then the version bump flags any later reader).
  Tensor work = consume_logits && logits.is_contiguous() ? ops::alias(logits) : ops::clone(logits);
  if (consume_logits) logits.impl().version++;
  work = ops::reshape(work, {rows, V});
  const Tensor flat_targets = ops::contiguous(ops::reshape(targets, {rows}));
  const TensorOptions f32{.dtype = DType::f32, .device = logits.device()};

  // f16 would flush (softmax - onehot) / N to zero for large N: its kernel writes the
  // unscaled gradient and the backward applies 1/N (read on the host) together with the
  // incoming (loss-scaled) gradient. bf16 and f32 have the range to take the scale in the
  // kernel, which reads it from device memory: no host read of the row count, so the step
  // needs no synchronisation here and a CUDA graph can record it (core/graph_capture.h).
  const bool scale_in_kernel = logits.dtype() != DType::f16;
  double dloss_scale = 1.0;
  Tensor device_scale;  // 1 / counted rows, f32 on the device (the kernel's scale)
  if (reduction == Reduction::Mean) {
    const Tensor counted = ops::sum(ops::binary(BinaryOp::Ne, flat_targets, double(ignore_index)));
    if (scale_in_kernel) {
      // 1 / count in f64 rounded to f32: the value the host computed before, bit for bit.
      const TensorOptions f64{.dtype = DType::f64, .device = logits.device()};
      device_scale = ops::to(ops::binary(BinaryOp::Div, full({}, 1.0, f64),
                                         ops::to(counted, logits.device(), DType::f64)),
                             logits.device(), DType::f32);
    } else {
      dloss_scale = 1.0 / static_cast<double>(counted.item());
    }
  }
  const double backward_scale = scale_in_kernel ? 1.0 : dloss_scale;
  Tensor row_losses = empty({rows}, f32);
  fused_classifier(work, flat_targets, ignore_index, /*dloss_scale=*/1.0, row_losses, device_scale);
  Tensor loss = reduction == Reduction::None  ? ops::reshape(row_losses, row_shape)
                : reduction == Reduction::Sum ? ops::sum(row_losses)
                : device_scale.defined()      ? ops::mul(ops::sum(row_losses), device_scale)
                                              : ops::mul(ops::sum(row_losses), dloss_scale);
  const Shape logits_shape = logits.shape();
  const auto scale_in_place = fused_kernel_table(logits.device().type).scale_by_device_scalar_;
  autograd::record(
      "FusedCrossEntropyBackward", {logits, targets}, {loss},
      [dlogits = ops::reshape(work, logits_shape), reduction, backward_scale,
       scale_in_place](const autograd::BackwardArgs& a) {
        if (reduction != Reduction::None && backward_scale == 1.0 && scale_in_place &&
            !a.retain_graph) {
          // The gradient buffer is this node's own and runs once: scaled in place
          // by the incoming gradient (rounded to the logits' dtype, as the other
          // routes round it), which the kernel skips when it is 1 (the usual
          // loss.backward()). No host read and no second [N, V] buffer: a
          // multiplication over the logits was 4% of a GPT-2 124M step.
          scale_in_place(dlogits, ops::to(a.grad(), dlogits.device(), dlogits.dtype()));
          return std::vector<Tensor>{dlogits, Tensor()};
        }
        if (reduction == Reduction::None) {
          // Each row's (softmax - onehot) times that row's incoming gradient.
          const Tensor g = ops::to(a.grad(), dlogits.device(), dlogits.dtype());
          return std::vector<Tensor>{ops::mul(dlogits, ops::unsqueeze(g, g.dim())), Tensor()};
        }
        if (graph_capture_underway()) {
          // The incoming gradient stays on the device; rounded to the logits'
          // dtype first, as the host path's scalar is, so both give equal bits.
          Tensor scale = ops::to(a.grad(), dlogits.device(), dlogits.dtype());
          if (backward_scale != 1.0) scale = ops::mul(scale, backward_scale);
          return std::vector<Tensor>{ops::mul(dlogits, scale), Tensor()};
        }
        // One scalar scales every row; reading it costs one sync, cheaper than
        // a pass over [N, V] when it is 1 (the usual loss.backward()).
        const double scale = a.grad().item() * backward_scale;
        return std::vector<Tensor>{scale == 1.0 ? dlogits : ops::mul(dlogits, scale), Tensor()};
      });
  return loss;
}

}  // namespace tessera
