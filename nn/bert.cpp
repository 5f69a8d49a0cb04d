#include "tessera/nn/bert.h"

#include <cmath>

#include "tessera/autograd/functions.h"

namespace tessera::nn {

void BertConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    TESSERA_CHECK(v > 0, "BertConfig: ", name, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(intermediate_size, "intermediate_size");
  positive(max_position_embeddings, "max_position_embeddings");
  positive(type_vocab_size, "type_vocab_size");
  TESSERA_CHECK(hidden_size % num_attention_heads == 0, "BertConfig: hidden_size (", hidden_size,
                ") must be a multiple of num_attention_heads (", num_attention_heads, ")");
  for (const auto& [p, name] : {std::pair{hidden_dropout_prob, "hidden_dropout_prob"},
                                {attention_probs_dropout_prob, "attention_probs_dropout_prob"}})
    TESSERA_CHECK(p >= 0 && p < 1, "BertConfig: ", name, " must lie in [0, 1), got ", p);
  TESSERA_CHECK(classifier_dropout < 1, "BertConfig: classifier_dropout must lie in [0, 1), got ",
                classifier_dropout);
  TESSERA_CHECK(pad_token_id < vocab_size, "BertConfig: pad_token_id (", pad_token_id,
                ") must be below vocab_size (", vocab_size, ")");
  labels.validate();
}

namespace {
const BertConfig& validated(const BertConfig& cfg) {
  cfg.validate();
  return cfg;
}

}  // namespace

BertEmbeddings::BertEmbeddings(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : word_embeddings(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range, gen, opts),
      position_embeddings(cfg.max_position_embeddings, cfg.hidden_size, cfg.initializer_range,
                          gen, opts),
      token_type_embeddings(cfg.type_vocab_size, cfg.hidden_size, cfg.initializer_range, gen, opts),
      layer_norm(cfg.hidden_size, cfg.layer_norm_eps, true, opts),
      dropout(cfg.hidden_dropout_prob) {
  word_embeddings.set_padding_idx(cfg.pad_token_id);
  register_module("word_embeddings", word_embeddings);
  register_module("position_embeddings", position_embeddings);
  register_module("token_type_embeddings", token_type_embeddings);
  register_module("LayerNorm", layer_norm);
  register_module("dropout", dropout);
}

Tensor BertEmbeddings::forward_embeddings(const Tensor& input_ids, const Tensor& token_type_ids) {
  const int64_t T = input_ids.size(1);
  TESSERA_CHECK(T <= position_embeddings.weight.size(0), "BertModel: sequence of ", T,
                " tokens exceeds max_position_embeddings ", position_embeddings.weight.size(0));
  const TensorOptions ids{.dtype = DType::i64, .device = input_ids.device()};
  const Tensor types = token_type_ids.defined() ? token_type_ids : zeros(input_ids.shape(), ids);
  const Tensor positions = arange(0.0, double(T), 1.0, ids);
  // HF's order of the adds: (words + token types) + positions.
  const Tensor summed =
      word_embeddings(input_ids) + token_type_embeddings(types) + position_embeddings(positions);
  return dropout(layer_norm(summed));
}

BertSelfAttention::BertSelfAttention(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : query(cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, gen, opts, true),
      key(cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, gen, opts, true),
      value(cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, gen, opts, true),
      dropout(cfg.attention_probs_dropout_prob),
      num_heads(cfg.num_attention_heads) {
  register_module("query", query);
  register_module("key", key);
  register_module("value", value);
  register_module("dropout", dropout);
}

Tensor BertSelfAttention::forward_masked(const Tensor& x, const Tensor& attn_mask) {
  const double p = dropout.is_training() ? dropout.p : 0.0;
  return multi_head_attention(query(x), key(x), value(x), num_heads, attn_mask, p);
}

BertResidualOutput::BertResidualOutput(int64_t in_features, const BertConfig& cfg, Generator* gen,
                                       TensorOptions opts)
    : dense(in_features, cfg.hidden_size, cfg.initializer_range, gen, opts, true),
      layer_norm(cfg.hidden_size, cfg.layer_norm_eps, true, opts),
      dropout(cfg.hidden_dropout_prob) {
  register_module("dense", dense);
  register_module("LayerNorm", layer_norm);
  register_module("dropout", dropout);
}

Tensor BertResidualOutput::forward_residual(const Tensor& x, const Tensor& residual) {
  return layer_norm(dropout(dense(x)) + residual);
}

BertAttention::BertAttention(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : self_attention(cfg, gen, opts), output(cfg.hidden_size, cfg, gen, opts) {
  register_module("self", self_attention);
  register_module("output", output);
}

BertIntermediate::BertIntermediate(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : dense(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, gen, opts, true),
      act(cfg.hidden_act) {
  register_module("dense", dense);
}

Tensor BertIntermediate::forward(const Tensor& x) { return activate(act, dense(x)); }

BertLayer::BertLayer(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : attention(cfg, gen, opts),
      intermediate(cfg, gen, opts),
      output(cfg.intermediate_size, cfg, gen, opts) {
  register_module("attention", attention);
  register_module("intermediate", intermediate);
  register_module("output", output);
}

// Between this layer's forward hooks, as operator() would run it: ZeRO-3 gathers a layer's
// parameters in them.
Tensor BertLayer::forward_masked(const Tensor& x, const Tensor& attn_mask) {
  return call_with_hooks(x, [&] {
    const Tensor heads = attention.self_attention.forward_masked(x, attn_mask);
    const Tensor attended = attention.output.forward_residual(heads, x);
    return output.forward_residual(intermediate(attended), attended);
  });
}

BertPooler::BertPooler(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : dense(cfg.hidden_size, cfg.hidden_size, cfg.initializer_range, gen, opts, true) {
  register_module("dense", dense);
}

Tensor BertPooler::forward(const Tensor& hidden_states) {
  return tanh(dense(hidden_states.select(1, 0)));
}

BertModel::BertModel(const BertConfig& cfg, Generator* gen, TensorOptions opts)
    : embeddings(validated(cfg), gen, opts), pooler(cfg, gen, opts), cfg_(cfg) {
  register_module("embeddings", embeddings);
  register_module("encoder", encoder);
  encoder.register_module("layer", layer);
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    layers.push_back(&layer.push_back(std::make_unique<BertLayer>(cfg, gen, opts)));
  register_module("pooler", pooler);
}

BertOutputs BertModel::encode(const Tensor& input_ids, const Tensor& attention_mask,
                              const Tensor& token_type_ids) {
  check_token_ids(input_ids, "BertModel");
  TESSERA_CHECK(!token_type_ids.defined() || token_type_ids.shape() == input_ids.shape(),
                "BertModel: token_type_ids ", autograd::describe(token_type_ids),
                " must have input_ids' shape ", shape_str(input_ids.shape()));
  const Tensor mask = key_padding_mask(attention_mask, input_ids, "BertModel");
  Tensor x = embeddings.forward_embeddings(input_ids, token_type_ids);
  for (BertLayer* l : layers) x = l->forward_masked(x, mask);
  return {x, pooler(x)};
}

BertForSequenceClassification::BertForSequenceClassification(const BertConfig& cfg, Generator* gen,
                                                             TensorOptions opts)
    : bert(cfg, gen, opts),
      dropout(cfg.classifier_dropout >= 0 ? cfg.classifier_dropout : cfg.hidden_dropout_prob),
      classifier(cfg.hidden_size, cfg.labels.num_labels, cfg.initializer_range, gen, opts, true),
      cfg_(cfg) {
  register_module("bert", bert);
  register_module("dropout", dropout);
  register_module("classifier", classifier);
}

Tensor BertForSequenceClassification::logits(const Tensor& input_ids, const Tensor& attention_mask,
                                             const Tensor& token_type_ids) {
  return classifier(dropout(bert.encode(input_ids, attention_mask, token_type_ids).pooler_output));
}

}  // namespace tessera::nn
