// DistilBERT (Sanh et al. 2019) as Hugging Face's DistilBertModel /
// DistilBertForSequenceClassification: word + learned position embeddings and their
// LayerNorm, post-LN transformer blocks (self-attention -> add -> sa_layer_norm; lin1 -> GELU
// -> lin2 -> dropout -> add -> output_layer_norm) over a key-padding mask, and the head
// pre_classifier -> ReLU -> dropout -> classifier on the first ([CLS]) position. HF's module
// names and torch.nn.Linear layouts throughout, so the state dict is a transformers file.
#pragma once
#include <memory>
#include <string>

#include "tessera/nn/encoder.h"
#include "tessera/nn/layers.h"

namespace tessera::nn {

struct DistilBertConfig {
  int64_t vocab_size = 30522;
  int64_t max_position_embeddings = 512;
  int64_t n_layers = 6;
  int64_t n_heads = 12;
  int64_t dim = 768;
  int64_t hidden_dim = 3072;
  double dropout = 0.1;               // embeddings and the FFN output
  double attention_dropout = 0.1;     // the attention probabilities
  double seq_classif_dropout = 0.2;   // the classification head
  Activation activation = Activation::GeluErf;
  double initializer_range = 0.02;
  int64_t pad_token_id = 0;  // the word embedding's padding_idx; -1: none
  SequenceClassificationConfig labels;
  // Throws naming the field when the configuration cannot build a model.
  void validate() const;
};

// config.json <-> DistilBertConfig (HF keys; model_type "distilbert"; unknown keys ignored,
// sinusoidal_pos_embds = true refused).
DistilBertConfig distilbert_config_from_json_file(const std::string& path);
void save_distilbert_config(const DistilBertConfig& cfg, const std::string& path);

class DistilBertEmbeddings : public Module {
 public:
  DistilBertEmbeddings(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& input_ids) override;  // LayerNorm(words + positions), dropout
  std::string type_name() const override { return "DistilBertEmbeddings"; }
  Embedding word_embeddings, position_embeddings;
  LayerNorm layer_norm;  // registered as "LayerNorm"
  Dropout dropout;
};

// q_lin, k_lin, v_lin, the attention, out_lin (HF's MultiHeadSelfAttention).
class DistilBertAttention : public Module {
 public:
  DistilBertAttention(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward_masked(const Tensor& x, const AttentionPadding& padding);
  std::string type_name() const override { return "MultiHeadSelfAttention"; }
  TorchLinear q_lin, k_lin, v_lin, out_lin;
  Dropout dropout;  // on the attention probabilities
  int64_t n_heads;
};

// lin1 -> activation -> lin2 -> dropout (HF's FFN).
class DistilBertFFN : public Module {
 public:
  DistilBertFFN(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "FFN"; }
  TorchLinear lin1, lin2;
  Dropout dropout;
  Activation activation;
};

class DistilBertBlock : public Module {
 public:
  DistilBertBlock(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward_masked(const Tensor& x, const AttentionPadding& padding);
  std::string type_name() const override { return "TransformerBlock"; }
  DistilBertAttention attention;
  LayerNorm sa_layer_norm;
  DistilBertFFN ffn;
  LayerNorm output_layer_norm;
};

// HF's DistilBertModel: embeddings, transformer.layer.{i}.
class DistilBertModel : public Module {
 public:
  explicit DistilBertModel(const DistilBertConfig& cfg, Generator* gen = nullptr,
                           TensorOptions opts = {});
  // input_ids [B, T] (T <= max_position_embeddings), attention_mask [B, T] (1 = token;
  // undefined: all) -> last_hidden_state [B, T, dim].
  Tensor encode(const Tensor& input_ids, const Tensor& attention_mask = Tensor());
  Tensor forward(const Tensor& input_ids) override { return encode(input_ids); }
  std::string type_name() const override { return "DistilBertModel"; }
  const DistilBertConfig& config() const { return cfg_; }

  DistilBertEmbeddings embeddings;
  Module transformer;  // holds "layer"
  ModuleList layer;
  std::vector<DistilBertBlock*> blocks;

 private:
  DistilBertConfig cfg_;
};

// distilbert -> [CLS] -> pre_classifier -> ReLU -> dropout -> classifier [num_labels].
class DistilBertForSequenceClassification : public SequenceClassifier {
 public:
  explicit DistilBertForSequenceClassification(const DistilBertConfig& cfg,
                                               Generator* gen = nullptr, TensorOptions opts = {});
  // token_type_ids must be undefined: DistilBERT has no segments.
  Tensor logits(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                const Tensor& token_type_ids = Tensor()) override;
  std::string type_name() const override { return "DistilBertForSequenceClassification"; }
  const SequenceClassificationConfig& labels_config() const override { return cfg_.labels; }
  const DistilBertConfig& config() const { return cfg_; }

  void save_config(const std::string& path) const override;
  // config.json + model.safetensors written by transformers: this class's, or a pretrained
  // body's (DistilBertModel, DistilBertForMaskedLM: the head keeps its initialisation, listed
  // by newly_initialized_keys()).
  static std::unique_ptr<DistilBertForSequenceClassification> from_pretrained(
      const std::string& dir, TensorOptions opts = {});

  DistilBertModel distilbert;
  TorchLinear pre_classifier, classifier;
  Dropout dropout;

 private:
  DistilBertConfig cfg_;
};

}  // namespace tessera::nn
