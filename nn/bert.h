// BERT (Devlin et al. 2018) as Hugging Face's BertModel / BertForSequenceClassification: word +
// learned position + token-type embeddings and their LayerNorm, post-LN encoder layers
// (self-attention -> add -> LayerNorm; dense -> GELU -> dense -> add -> LayerNorm) over a
// key-padding mask, the pooler (dense + tanh on [CLS]) and the classifier. A readable
// reference: each module is HF's, under HF's name, projections stored [out, in] as
// torch.nn.Linear stores them, so the state dict is a transformers model.safetensors.
#pragma once
#include <memory>
#include <string>

#include "tessera/nn/encoder.h"
#include "tessera/nn/layers.h"

namespace tessera::nn {

struct BertConfig {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  Activation hidden_act = Activation::GeluErf;
  double hidden_dropout_prob = 0.1;           // embeddings, both residual branches
  double attention_probs_dropout_prob = 0.1;  // the attention probabilities
  double classifier_dropout = -1;             // < 0: null in HF (hidden_dropout_prob is used)
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double initializer_range = 0.02;
  double layer_norm_eps = 1e-12;
  int64_t pad_token_id = 0;  // the word embedding's padding_idx; -1: none
  SequenceClassificationConfig labels;
  // Throws naming the field when the configuration cannot build a model.
  void validate() const;
};

// config.json <-> BertConfig (HF BertConfig keys; model_type "bert"; unknown keys ignored,
// position_embedding_type other than "absolute" refused).
BertConfig bert_config_from_json_file(const std::string& path);
void save_bert_config(const BertConfig& cfg, const std::string& path);

class BertEmbeddings : public Module {
 public:
  BertEmbeddings(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  // LayerNorm(word(ids) + token_type(types) + position(0..T-1)), then dropout.
  Tensor forward_embeddings(const Tensor& input_ids, const Tensor& token_type_ids);
  std::string type_name() const override { return "BertEmbeddings"; }
  Embedding word_embeddings, position_embeddings, token_type_embeddings;
  LayerNorm layer_norm;  // registered as "LayerNorm"
  Dropout dropout;
};

// query, key, value projections and the attention over them (HF's BertSelfAttention).
class BertSelfAttention : public Module {
 public:
  BertSelfAttention(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward_masked(const Tensor& x, const AttentionPadding& padding);
  std::string type_name() const override { return "BertSelfAttention"; }
  TorchLinear query, key, value;
  Dropout dropout;  // on the attention probabilities
  int64_t num_heads;
};

// LayerNorm(dropout(dense(x)) + residual): BertSelfOutput and BertOutput, which differ only in
// dense's input width.
class BertResidualOutput : public Module {
 public:
  BertResidualOutput(int64_t in_features, const BertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward_residual(const Tensor& x, const Tensor& residual);
  std::string type_name() const override { return "BertResidualOutput"; }
  TorchLinear dense;
  LayerNorm layer_norm;  // registered as "LayerNorm"
  Dropout dropout;
};

// HF's BertAttention: "self" and "output".
class BertAttention : public Module {
 public:
  BertAttention(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  std::string type_name() const override { return "BertAttention"; }
  BertSelfAttention self_attention;  // registered as "self"
  BertResidualOutput output;
};

// dense -> activation (HF's BertIntermediate).
class BertIntermediate : public Module {
 public:
  BertIntermediate(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "BertIntermediate"; }
  TorchLinear dense;
  Activation act;
};

class BertLayer : public Module {
 public:
  BertLayer(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  // x [B, T, C] -> [B, T, C], attention masked by `padding`.
  Tensor forward_masked(const Tensor& x, const AttentionPadding& padding);
  std::string type_name() const override { return "BertLayer"; }
  BertAttention attention;
  BertIntermediate intermediate;
  BertResidualOutput output;
};

// dense + tanh on the first ([CLS]) position.
class BertPooler : public Module {
 public:
  BertPooler(const BertConfig& cfg, Generator* gen, TensorOptions opts);
  Tensor forward(const Tensor& hidden_states) override;  // [B, T, C] -> [B, C]
  std::string type_name() const override { return "BertPooler"; }
  TorchLinear dense;
};

struct BertOutputs {
  Tensor last_hidden_state;  // [B, T, C]
  Tensor pooler_output;      // [B, C]
};

// HF's BertModel: embeddings, encoder.layer.{i}, pooler.
class BertModel : public Module {
 public:
  explicit BertModel(const BertConfig& cfg, Generator* gen = nullptr, TensorOptions opts = {});
  // input_ids [B, T] (T <= max_position_embeddings), attention_mask [B, T] (1 = token;
  // undefined: all), token_type_ids [B, T] (undefined: zeros).
  BertOutputs encode(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                     const Tensor& token_type_ids = Tensor());
  Tensor forward(const Tensor& input_ids) override { return encode(input_ids).last_hidden_state; }
  std::string type_name() const override { return "BertModel"; }
  const BertConfig& config() const { return cfg_; }

  BertEmbeddings embeddings;
  Module encoder;  // holds "layer"
  ModuleList layer;
  std::vector<BertLayer*> layers;
  BertPooler pooler;

 private:
  BertConfig cfg_;
};

// bert -> pooler_output -> dropout -> classifier [num_labels].
class BertForSequenceClassification : public SequenceClassifier {
 public:
  explicit BertForSequenceClassification(const BertConfig& cfg, Generator* gen = nullptr,
                                         TensorOptions opts = {});
  Tensor logits(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                const Tensor& token_type_ids = Tensor()) override;
  std::string type_name() const override { return "BertForSequenceClassification"; }
  bool takes_token_type_ids() const override { return true; }
  const SequenceClassificationConfig& labels_config() const override { return cfg_.labels; }
  const BertConfig& config() const { return cfg_; }

  void save_config(const std::string& path) const override;
  // config.json + model.safetensors written by transformers: this class's, or a pretrained
  // body's (BertModel, BertForPreTraining, BertForMaskedLM: the classifier then keeps its
  // initialisation, listed by newly_initialized_keys()).
  static std::unique_ptr<BertForSequenceClassification> from_pretrained(const std::string& dir,
                                                                        TensorOptions opts = {});

  BertModel bert;
  Dropout dropout;
  TorchLinear classifier;

 private:
  BertConfig cfg_;
};

}  // namespace tessera::nn
