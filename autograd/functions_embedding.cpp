// Differentiable embedding lookups: the dense backward (into the offered gradient
// destination where there is one) and the lookup whose weight gradient goes to an
// EmbeddingGradSink (dist/sparse_embedding.h). Kernels: kernels/ops_index.cpp.
#include "tessera/autograd/functions.h"

namespace tessera {

using autograd::BackwardArgs;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  Tensor y = ops::embedding(weight, indices);
  record("EmbeddingBackward", {weight, indices}, {y},
         [saved = SavedTensor::input(indices), rows = weight.size(0)](const BackwardArgs& a) {
           const Tensor& dy = a.grad();
           const Tensor indices = saved.unpack("EmbeddingBackward");
           // Into the memory the engine offers for the weight's gradient: its DDP bucket slot
           // (overwritten), or a tied lm_head's gradient already there (added into: no zero
           // fill of the table, no separate add).
           if (const autograd::GradDestination* d = a.destination(0);
               d != nullptr && d->tensor.is_contiguous()) {
             ops::embedding_backward_into(d->tensor, dy, indices, d->accumulate);
             return Grads{d->tensor, Tensor()};
           }
           Tensor grad_weight =
               empty({rows, dy.shape().back()}, {.dtype = dy.dtype(), .device = dy.device()});
           ops::embedding_backward_into(grad_weight, dy, indices, /*accumulate=*/false);
           return Grads{grad_weight, Tensor()};
         });
  return y;
}

Tensor embedding(const Tensor& weight, const Tensor& indices,
                 const std::shared_ptr<EmbeddingGradSink>& sink) {
  const bool recording = autograd::is_grad_enabled() && weight.requires_grad();
  if (!sink || !recording || !sink->accepts(weight, indices)) return embedding(weight, indices);
  Tensor y = ops::embedding(weight, indices);
  // No edge into the weight: forced, so the output still carries dY back to the sink.
  record(
      "EmbeddingSinkBackward", {}, {y},
      [sink, saved = SavedTensor::input(indices)](const BackwardArgs& a) {
        const Tensor idx = saved.unpack("EmbeddingSinkBackward");
        const int64_t n = idx.numel();
        sink->take(ops::reshape(idx, {n}).contiguous(),
                   ops::reshape(a.grad(), {n, a.grad().size(-1)}).contiguous());
        return Grads{};
      },
      /*force=*/true);
  return y;
}

}  // namespace tessera
