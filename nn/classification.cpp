#include "tessera/nn/classification.h"

#include "tessera/autograd/functions.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/distilbert.h"
#include "tessera/nn/hf_config.h"

namespace tessera::nn {

namespace {
GPTConfig without_output_head(GPTConfig cfg) {
  cfg.tie_word_embeddings = true;
  return cfg;
}
LlamaConfig without_output_head(LlamaConfig cfg) {
  cfg.tie_word_embeddings = true;
  return cfg;
}

// hidden [B, T, C] at one position per row -> [B, C].
Tensor rows_at(const Tensor& hidden, const std::vector<int64_t>& positions) {
  const int64_t B = hidden.size(0), T = hidden.size(1);
  std::vector<int64_t> flat(positions.size());
  for (int64_t b = 0; b < B; ++b) flat[b] = b * T + positions[b];
  const Tensor index = from_vector(flat, {B}, {.dtype = DType::i64, .device = hidden.device()});
  return index_select(hidden.reshape({B * T, hidden.size(2)}), 0, index);
}

bool ends_with(const std::string& s, const char* suffix) {
  const std::string tail(suffix);
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
}  // namespace

std::vector<int64_t> last_token_positions(const Tensor& input_ids, const Tensor& attention_mask,
                                          int64_t pad_token_id, const char* model) {
  check_token_ids(input_ids, model);
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  TESSERA_CHECK(T > 0, model, ": input_ids must hold at least one token per row");
  TESSERA_CHECK(pad_token_id >= 0 || B == 1, model,
                ": a batch of more than one row needs pad_token_id in the config (to find each "
                "row's last token)");
  const std::vector<int64_t> ids =
      ops::to(input_ids, Device::cpu(), DType::i64).contiguous().to_vector<int64_t>();
  if (attention_mask.defined()) {
    TESSERA_CHECK(attention_mask.shape() == input_ids.shape(), model, ": attention_mask ",
                  autograd::describe(attention_mask), " must have input_ids' shape ",
                  shape_str(input_ids.shape()));
    const std::vector<int64_t> keep =
        ops::to(attention_mask, Device::cpu(), DType::i64).contiguous().to_vector<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 1; t < T; ++t)
        TESSERA_CHECK(!(keep[b * T + t] != 0 && keep[b * T + t - 1] == 0), model,
                      ": attention_mask row ", b, " has a token after padding (position ", t,
                      "); pad on the right: the causal body takes no attention mask");
  }
  std::vector<int64_t> positions(B, T - 1);
  if (pad_token_id < 0) return positions;
  for (int64_t b = 0; b < B; ++b) {
    int64_t first_pad = 0;  // argmax of an all-false row is 0, as in HF
    for (int64_t t = 0; t < T; ++t)
      if (ids[b * T + t] == pad_token_id) {
        first_pad = t;
        break;
      }
    positions[b] = ((first_pad - 1) % T + T) % T;
  }
  return positions;
}

DecoderForSequenceClassification::DecoderForSequenceClassification(
    int64_t hidden_size, double init_std, const SequenceClassificationConfig& labels,
    int64_t pad_token_id, bool tie_word_embeddings, Generator* gen, TensorOptions opts)
    : score(hidden_size, labels.num_labels, init_std, gen, opts),
      labels_(labels),
      pad_token_id_(pad_token_id),
      tie_word_embeddings_(tie_word_embeddings) {
  labels_.validate();
}

Tensor DecoderForSequenceClassification::logits(const Tensor& input_ids,
                                                const Tensor& attention_mask,
                                                const Tensor& token_type_ids) {
  const std::string model = type_name();
  TESSERA_CHECK(!token_type_ids.defined(), model, ": the model takes no token_type_ids");
  const std::vector<int64_t> last =
      last_token_positions(input_ids, attention_mask, pad_token_id_, model.c_str());
  return score(rows_at(body_hidden_states(input_ids), last));
}

void DecoderForSequenceClassification::save_config(const std::string& path) const {
  save_body_config(path);
  nlohmann::ordered_json keys;
  keys["architectures"] = {type_name()};
  keys["pad_token_id"] = hf::nullable_id(pad_token_id_);
  keys["tie_word_embeddings"] = tie_word_embeddings_;
  hf::write_labels(keys, labels_);
  hf::merge_into_config(path, keys);
}

void DecoderForSequenceClassification::load_weights(
    const std::string& dir, const std::string& base_prefix,
    const std::function<bool(const std::string&)>& ignored) {
  fresh_keys_ =
      load_classifier_checkpoint(*this, hf::weights_path(dir), base_prefix, ignored, {"score."});
}

GPT2ForSequenceClassification::GPT2ForSequenceClassification(
    const GPTConfig& cfg, const SequenceClassificationConfig& labels, int64_t pad_token_id,
    Generator* gen, TensorOptions opts)
    : DecoderForSequenceClassification(cfg.n_embd, 0.02, labels, pad_token_id,
                                       cfg.tie_word_embeddings, gen, opts),
      body_(std::make_unique<GPT>(without_output_head(cfg), gen, opts)) {
  TESSERA_CHECK(pad_token_id < cfg.vocab_size, "GPT2ForSequenceClassification: pad_token_id (",
                pad_token_id, ") must be below vocab_size (", cfg.vocab_size, ")");
  register_module("transformer", body_->transformer);
  register_module("score", score);
}

void GPT2ForSequenceClassification::save_body_config(const std::string& path) const {
  save_gpt_config(body_->config(), path);
}

std::unique_ptr<GPT2ForSequenceClassification> GPT2ForSequenceClassification::from_pretrained(
    const std::string& dir, TensorOptions opts) {
  const std::string path = hf::config_path(dir);
  const hf::ConfigFile file(path, "GPT-2");
  auto model = std::make_unique<GPT2ForSequenceClassification>(
      gpt_config_from_json_file(path), file.labels(), file.optional_id("pad_token_id", -1), nullptr,
      opts);
  model->load_weights(dir, "transformer.", [](const std::string& name) {
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
           name == "lm_head.weight";
  });
  return model;
}

LlamaForSequenceClassification::LlamaForSequenceClassification(
    const LlamaConfig& cfg, const SequenceClassificationConfig& labels, int64_t pad_token_id,
    Generator* gen, TensorOptions opts)
    : DecoderForSequenceClassification(cfg.hidden_size, cfg.initializer_range, labels, pad_token_id,
                                       cfg.tie_word_embeddings, gen, opts),
      body_(std::make_unique<Llama>(without_output_head(cfg), gen, opts)) {
  body_->model.embed_tokens.set_padding_idx(pad_token_id);
  register_module("model", body_->model);
  register_module("score", score);
}

void LlamaForSequenceClassification::save_body_config(const std::string& path) const {
  save_llama_config(body_->config(), path);
}

std::unique_ptr<LlamaForSequenceClassification> LlamaForSequenceClassification::from_pretrained(
    const std::string& dir, TensorOptions opts) {
  const std::string path = hf::config_path(dir);
  const hf::ConfigFile file(path, "Llama");
  auto model = std::make_unique<LlamaForSequenceClassification>(
      llama_config_from_json_file(path), file.labels(), file.optional_id("pad_token_id", -1),
      nullptr, opts);
  model->load_weights(dir, "model.", [](const std::string& name) {
    return ends_with(name, ".rotary_emb.inv_freq") || name == "lm_head.weight";
  });
  return model;
}

std::unique_ptr<SequenceClassifier> load_sequence_classifier(const std::string& dir,
                                                             TensorOptions opts) {
  const std::string type = model_type_of(hf::config_path(dir));
  if (type == "bert") return BertForSequenceClassification::from_pretrained(dir, opts);
  if (type == "distilbert") return DistilBertForSequenceClassification::from_pretrained(dir, opts);
  if (type == "gpt2") return GPT2ForSequenceClassification::from_pretrained(dir, opts);
  if (type == "llama") return LlamaForSequenceClassification::from_pretrained(dir, opts);
  TESSERA_FAIL("load_sequence_classifier: '", hf::config_path(dir), "' has model_type \"", type,
               "\"; sequence classification supports bert, distilbert, gpt2 and llama");
}

}  // namespace tessera::nn
