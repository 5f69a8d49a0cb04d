// The basic layers. Initialisation follows GPT-2 (weights N(0, 0.02), biases 0,
// LayerNorm 1/0); `gen` = nullptr draws from the default generator.
#pragma once
#include <memory>
#include <utility>

#include "tessera/core/random.h"
#include "tessera/nn/module.h"

namespace tessera {
class EmbeddingGradSink;  // autograd/functions.h
}

namespace tessera::nn {

// y = x·W + b with W stored [in, out] (GPT-2's Conv1D layout, the HF tensor layout).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, double init_std = 0.02,
         Generator* gen = nullptr, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Linear"; }

  Tensor weight;  // [in, out]
  Tensor bias;    // [out], undefined without bias
};

// y = x · weightᵀ + bias with weight [out, in] (torch.nn.Linear's layout, the layout Hugging
// Face files hold for Llama's and BERT's projections); bias [out] only when asked for (zeros).
class TorchLinear : public Module {
 public:
  TorchLinear(int64_t in_features, int64_t out_features, double init_std, Generator* gen,
              TensorOptions opts, bool bias = false);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "TorchLinear"; }
  Tensor weight;  // [out, in]
  Tensor bias;    // [out], undefined without bias
};

// Rows of weight [num_embeddings, dim] picked by integer indices.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, double init_std = 0.02, Generator* gen = nullptr,
            TensorOptions opts = {});
  Tensor forward(const Tensor& indices) override;
  std::string type_name() const override { return "Embedding"; }

  Tensor weight;
  // torch.nn.Embedding's padding_idx: lookups of this row pass no gradient to it (its values
  // are looked up as usual). -1: none.
  int64_t padding_idx = -1;
  // torch.nn.Embedding(padding_idx = index) at construction: sets padding_idx and zeroes that
  // row (-1: no padding row).
  void set_padding_idx(int64_t index);
  // Where the lookup's weight gradient goes instead of weight.grad when it accepts (see
  // EmbeddingGradSink); null, or one that accepts nothing: the ordinary backward. DDP sets it.
  std::shared_ptr<EmbeddingGradSink> grad_sink;
};

// Normalises over the last dimension; weight 1, bias 0 at init.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true, TensorOptions opts = {});
  Tensor forward(const Tensor& x) override;
  // The residual add in front of this norm fused into it (residual_layer_norm): returns
  // {x + residual, forward(x + residual)}; with residual_bias (the bias of the projection
  // that produced residual, left out of it) {x + (residual + residual_bias), ...}. The
  // module's hooks run around it, seeing x as the input and the normalised tensor as the
  // output.
  std::pair<Tensor, Tensor> forward_residual(const Tensor& x, const Tensor& residual,
                                             const Tensor& residual_bias = Tensor());
  std::string type_name() const override { return "LayerNorm"; }

  Tensor weight, bias;
  double eps;
};

// GELU: the tanh approximation by default (GPT-2's "gelu_new"), or with exact = true the erf
// form (torch.nn.GELU(), Hugging Face's "gelu": BERT, DistilBERT).
class GELU : public Module {
 public:
  explicit GELU(bool exact = false) : exact(exact) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "GELU"; }
  bool exact;
};

// Zeroes elements with probability p while training (scaling the rest by 1/(1-p));
// identity in eval mode. Draws from `gen` (seeded by the caller) or the default generator.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.0, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Dropout"; }

  double p;

 private:
  Generator* gen_;
};

// The causal language-model loss: mean cross-entropy of logits [B, T, V] against next-token
// targets [B, T] (-100 ignored). Where the device has a fused classifier (a GPU) it gives the
// loss and dlogits in one pass, in the logits' memory (nothing else reads them), so no
// [B, T, V] gradient buffer is allocated: the logits must not be used after this call.
Tensor language_model_loss(const Tensor& logits, const Tensor& targets);

}  // namespace tessera::nn
