#include "tessera/nn/distilbert.h"

#include "tessera/autograd/functions.h"

namespace tessera::nn {

namespace {
// DistilBERT's LayerNorms all use this epsilon (HF hard-codes it).
constexpr double kLayerNormEps = 1e-12;

const DistilBertConfig& validated(const DistilBertConfig& cfg) {
  cfg.validate();
  return cfg;
}
}  // namespace

void DistilBertConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    TESSERA_CHECK(v > 0, "DistilBertConfig: ", name, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(max_position_embeddings, "max_position_embeddings");
  positive(n_layers, "n_layers");
  positive(n_heads, "n_heads");
  positive(dim, "dim");
  positive(hidden_dim, "hidden_dim");
  TESSERA_CHECK(dim % n_heads == 0, "DistilBertConfig: dim (", dim,
                ") must be a multiple of n_heads (", n_heads, ")");
  for (const auto& [p, name] : {std::pair{dropout, "dropout"},
                                {attention_dropout, "attention_dropout"},
                                {seq_classif_dropout, "seq_classif_dropout"}})
    TESSERA_CHECK(p >= 0 && p < 1, "DistilBertConfig: ", name, " must lie in [0, 1), got ", p);
  TESSERA_CHECK(pad_token_id < vocab_size, "DistilBertConfig: pad_token_id (", pad_token_id,
                ") must be below vocab_size (", vocab_size, ")");
  labels.validate();
}

DistilBertEmbeddings::DistilBertEmbeddings(const DistilBertConfig& cfg, Generator* gen,
                                           TensorOptions opts)
    : word_embeddings(cfg.vocab_size, cfg.dim, cfg.initializer_range, gen, opts),
      position_embeddings(cfg.max_position_embeddings, cfg.dim, cfg.initializer_range, gen, opts),
      layer_norm(cfg.dim, kLayerNormEps, true, opts),
      dropout(cfg.dropout) {
  word_embeddings.set_padding_idx(cfg.pad_token_id);
  register_module("word_embeddings", word_embeddings);
  register_module("position_embeddings", position_embeddings);
  register_module("LayerNorm", layer_norm);
  register_module("dropout", dropout);
}

Tensor DistilBertEmbeddings::forward(const Tensor& input_ids) {
  const int64_t T = input_ids.size(1);
  TESSERA_CHECK(T <= position_embeddings.weight.size(0), "DistilBertModel: sequence of ", T,
                " tokens exceeds max_position_embeddings ", position_embeddings.weight.size(0));
  const Tensor positions = arange(0.0, double(T), 1.0, {.dtype = DType::i64, .device = input_ids.device()});
  return dropout(layer_norm(word_embeddings(input_ids) + position_embeddings(positions)));
}

DistilBertAttention::DistilBertAttention(const DistilBertConfig& cfg, Generator* gen,
                                         TensorOptions opts)
    : q_lin(cfg.dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      k_lin(cfg.dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      v_lin(cfg.dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      out_lin(cfg.dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      dropout(cfg.attention_dropout),
      n_heads(cfg.n_heads) {
  register_module("dropout", dropout);
  register_module("q_lin", q_lin);
  register_module("k_lin", k_lin);
  register_module("v_lin", v_lin);
  register_module("out_lin", out_lin);
}

Tensor DistilBertAttention::forward_masked(const Tensor& x, const Tensor& attn_mask) {
  const double p = dropout.is_training() ? dropout.p : 0.0;
  return out_lin(multi_head_attention(q_lin(x), k_lin(x), v_lin(x), n_heads, attn_mask, p));
}

DistilBertFFN::DistilBertFFN(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts)
    : lin1(cfg.dim, cfg.hidden_dim, cfg.initializer_range, gen, opts, true),
      lin2(cfg.hidden_dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      dropout(cfg.dropout),
      activation(cfg.activation) {
  register_module("dropout", dropout);
  register_module("lin1", lin1);
  register_module("lin2", lin2);
}

Tensor DistilBertFFN::forward(const Tensor& x) { return dropout(lin2(activate(activation, lin1(x)))); }

DistilBertBlock::DistilBertBlock(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts)
    : attention(cfg, gen, opts),
      sa_layer_norm(cfg.dim, kLayerNormEps, true, opts),
      ffn(cfg, gen, opts),
      output_layer_norm(cfg.dim, kLayerNormEps, true, opts) {
  register_module("attention", attention);
  register_module("sa_layer_norm", sa_layer_norm);
  register_module("ffn", ffn);
  register_module("output_layer_norm", output_layer_norm);
}

// Between this block's forward hooks, as operator() would run it (ZeRO-3 gathers its
// parameters in them).
Tensor DistilBertBlock::forward_masked(const Tensor& x, const Tensor& attn_mask) {
  return call_with_hooks(x, [&] {
    const Tensor attended = sa_layer_norm(attention.forward_masked(x, attn_mask) + x);
    return output_layer_norm(ffn(attended) + attended);
  });
}

DistilBertModel::DistilBertModel(const DistilBertConfig& cfg, Generator* gen, TensorOptions opts)
    : embeddings(validated(cfg), gen, opts), cfg_(cfg) {
  register_module("embeddings", embeddings);
  register_module("transformer", transformer);
  transformer.register_module("layer", layer);
  for (int64_t i = 0; i < cfg.n_layers; ++i)
    blocks.push_back(&layer.push_back(std::make_unique<DistilBertBlock>(cfg, gen, opts)));
}

Tensor DistilBertModel::encode(const Tensor& input_ids, const Tensor& attention_mask) {
  check_token_ids(input_ids, "DistilBertModel");
  const Tensor mask = key_padding_mask(attention_mask, input_ids, "DistilBertModel");
  Tensor x = embeddings(input_ids);
  for (DistilBertBlock* block : blocks) x = block->forward_masked(x, mask);
  return x;
}

DistilBertForSequenceClassification::DistilBertForSequenceClassification(
    const DistilBertConfig& cfg, Generator* gen, TensorOptions opts)
    : distilbert(cfg, gen, opts),
      pre_classifier(cfg.dim, cfg.dim, cfg.initializer_range, gen, opts, true),
      classifier(cfg.dim, cfg.labels.num_labels, cfg.initializer_range, gen, opts, true),
      dropout(cfg.seq_classif_dropout),
      cfg_(cfg) {
  register_module("distilbert", distilbert);
  register_module("pre_classifier", pre_classifier);
  register_module("classifier", classifier);
  register_module("dropout", dropout);
}

Tensor DistilBertForSequenceClassification::logits(const Tensor& input_ids,
                                                   const Tensor& attention_mask,
                                                   const Tensor& token_type_ids) {
  TESSERA_CHECK(!token_type_ids.defined(),
                "DistilBertForSequenceClassification: DistilBERT takes no token_type_ids");
  const Tensor first = distilbert.encode(input_ids, attention_mask).select(1, 0);
  return classifier(dropout(relu(pre_classifier(first))));
}

}  // namespace tessera::nn
