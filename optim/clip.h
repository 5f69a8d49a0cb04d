// Global-norm gradient clipping (torch.nn.utils.clip_grad_norm_) and the gradient
// helpers it and the loss scaler share. Parameters without a gradient are skipped.
// Sums are accumulated in float64 on CPU (f32 partial sums per tensor elsewhere).
#pragma once
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::optim {

// Sum of squares of every gradient element (the square of the global L2 norm).
// The dist layer adds these across shards before taking the root.
double grad_norm_squared(const std::vector<Tensor>& params);
// sqrt(grad_norm_squared(params)).
double grad_norm(const std::vector<Tensor>& params);
// Multiplies every gradient by `factor` in place (never recorded on the tape).
void scale_grads_(const std::vector<Tensor>& params, double factor);
// Scales gradients by max_norm / (norm + 1e-6) when that is below 1; returns the
// norm before clipping (inf/NaN when a gradient is not finite, as PyTorch does).
double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm);
// The same decided on the device, with no host read (so a CUDA graph can record it): returns
// the norm before clipping as a 0-d f32 tensor on the gradients' device; max_norm <= 0 only
// measures. The scaled gradients are bit for bit those of clip_grad_norm_. Needs contiguous
// gradients on one device that has the fused norm and clip kernels (an error says which is
// missing).
Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm);

// Clips `grads` in place by the factor of `norm` as clip_grad_norm_ would: times
// max_norm / (norm + 1e-6) when that is below 1 (or the norm is not finite). `norm` is one
// value: on the gradients' CUDA device (clip_grad_norm_on_device_'s) nothing waits for it;
// elsewhere it is read on the host.
void clip_grads_by_norm_(const std::vector<Tensor>& grads, const Tensor& norm, double max_norm);

// Multiplies every gradient by `factor` and reports whether all of them are finite
// (one pass per gradient; the loss scaler's unscale).
bool scale_grads_and_check_finite_(const std::vector<Tensor>& params, double factor);

}  // namespace tessera::optim
