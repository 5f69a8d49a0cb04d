#include "tessera/nn/layers.h"

#include <tuple>

#include "tessera/autograd/functions.h"
#include "tessera/core/deferred_init.h"
#include "tessera/kernels/fused_table.h"

namespace tessera::nn {

namespace {
Tensor normal_init(const Shape& shape, double std, Generator* gen, TensorOptions opts) {
  TESSERA_CHECK(is_floating(opts.dtype), "nn: parameters must be floating point, got ",
                dtype_name(opts.dtype));
  // A placeholder under deferred initialisation (core/deferred_init.h).
  return init_normal(shape, 0.0, std, gen, opts);
}
}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, double init_std,
               Generator* gen, TensorOptions opts) {
  TESSERA_CHECK(in_features > 0 && out_features > 0,
                "Linear: features must be positive, got in=", in_features, " out=", out_features);
  weight =
      register_parameter("weight", normal_init({in_features, out_features}, init_std, gen, opts));
  if (with_bias) bias = register_parameter("bias", init_constant({out_features}, 0.0, opts));
}

Tensor Linear::forward(const Tensor& x) {
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0), "Linear: input shape ",
                shape_str(x.shape()), " does not end in in_features = ", weight.size(0));
  return linear(x, weight, bias);
}

TorchLinear::TorchLinear(int64_t in_features, int64_t out_features, double init_std, Generator* gen,
                         TensorOptions opts, bool with_bias) {
  TESSERA_CHECK(in_features > 0 && out_features > 0,
                "TorchLinear: features must be positive, got in=", in_features,
                " out=", out_features);
  weight =
      register_parameter("weight", normal_init({out_features, in_features}, init_std, gen, opts));
  if (with_bias) bias = register_parameter("bias", init_constant({out_features}, 0.0, opts));
}

Tensor TorchLinear::forward(const Tensor& x) {
  TESSERA_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "TorchLinear: input shape ",
                shape_str(x.shape()), " does not end in in_features = ", weight.size(1));
  return linear(x, weight.t(), bias);
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, double init_std, Generator* gen,
                     TensorOptions opts) {
  TESSERA_CHECK(num_embeddings > 0 && dim > 0, "Embedding: sizes must be positive, got ",
                num_embeddings, " x ", dim);
  weight = register_parameter("weight", normal_init({num_embeddings, dim}, init_std, gen, opts));
}

void Embedding::set_padding_idx(int64_t index) {
  TESSERA_CHECK(index >= -1 && index < weight.size(0), "Embedding: padding_idx ", index,
                " is outside [0, ", weight.size(0), ") (-1: none)");
  padding_idx = index;
  if (index < 0) return;
  check_not_deferred(weight, "weight", "Embedding::set_padding_idx");
  ops::fill_(ops::narrow(weight, 0, index, 1), 0.0);
}

Tensor Embedding::forward(const Tensor& indices) {
  const Tensor rows = embedding(weight, indices, grad_sink);
  if (padding_idx < 0) return rows;
  // The padding positions take their rows from a detached copy of the lookup: same values, no
  // path back into the weight.
  const Tensor is_padding =
      ops::unsqueeze(ops::binary(BinaryOp::Eq, indices, double(padding_idx)), -1);
  return where(is_padding, rows.detach(), rows);
}

LayerNorm::LayerNorm(int64_t dim, double eps_, bool with_bias, TensorOptions opts) : eps(eps_) {
  weight = register_parameter("weight", init_constant({dim}, 1.0, opts));
  if (with_bias) bias = register_parameter("bias", init_constant({dim}, 0.0, opts));
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, weight, bias, eps); }

std::pair<Tensor, Tensor> LayerNorm::forward_residual(const Tensor& x, const Tensor& residual,
                                                      const Tensor& residual_bias) {
  Tensor sum;
  Tensor normed = call_with_hooks(x, [&] {
    Tensor out;
    // The op adds its x_bias to its first operand: the projection's output goes first then.
    std::tie(sum, out) = residual_bias.defined()
                             ? residual_layer_norm(residual, x, weight, bias, eps, residual_bias)
                             : residual_layer_norm(x, residual, weight, bias, eps);
    return out;
  });
  return {sum, normed};
}

Tensor GELU::forward(const Tensor& x) { return exact ? gelu_erf(x) : gelu(x); }

Dropout::Dropout(double p_, Generator* gen) : p(p_), gen_(gen) {
  TESSERA_CHECK(p >= 0 && p < 1, "Dropout: p must lie in [0, 1), got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p == 0) return x;
  return dropout(x, p, true, gen_);
}

Tensor language_model_loss(const Tensor& logits, const Tensor& targets) {
  // The device's fused classifier where it has one (CUDA; and a size-only dry run taking the
  // GPU's routes, which must allocate what the GPU does), else the composed cross entropy.
  if (fused_kernel_table(logits.device().type).classifier != nullptr &&
      logits.dtype() != DType::f64)
    return fused_cross_entropy(logits, targets, -100, Reduction::Mean, /*consume_logits=*/true);
  return cross_entropy(logits, targets);
}

}  // namespace tessera::nn
