// Sequence classification on the decoder bodies, as Hugging Face's
// GPT2ForSequenceClassification / LlamaForSequenceClassification: the body's final hidden
// states, a bias-free `score` projection [num_labels, C], read at each row's last token that
// is not padding. That token is found from pad_token_id as HF finds it: the position before
// the first pad token (the last position when the row has none); without a pad_token_id only
// one row per batch is accepted. The bodies are nn::GPT's transformer and nn::Llama's model,
// under HF's names ("transformer.*", "model.*", "score.weight").
//
// Padding must be on the right: the causal bodies then never let a real token see a pad, so
// an attention_mask adds nothing and is only checked to be right-padded (a left-padded mask
// is refused: the bodies take no mask).
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "tessera/nn/encoder.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

namespace tessera::nn {

// The position each row of input_ids [B, T] is read at: HF's
// (argmax(input_ids == pad_token_id) - 1) mod T, or T - 1 for pad_token_id < 0 (then B must
// be 1). attention_mask (undefined, or [B, T] of 1s then 0s) is checked against right padding.
std::vector<int64_t> last_token_positions(const Tensor& input_ids, const Tensor& attention_mask,
                                          int64_t pad_token_id, const char* model);

// What both share: the bias-free score head [num_labels, hidden] read at each row's last
// token, the label keys and pad_token_id, and the directory format (the body's config.json
// with the classification keys written over it).
class DecoderForSequenceClassification : public SequenceClassifier {
 public:
  // token_type_ids must be undefined.
  Tensor logits(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                const Tensor& token_type_ids = Tensor()) override;
  const SequenceClassificationConfig& labels_config() const override { return labels_; }
  int64_t pad_token_id() const { return pad_token_id_; }
  void save_config(const std::string& path) const override;

  TorchLinear score;

 protected:
  DecoderForSequenceClassification(int64_t hidden_size, double init_std,
                                   const SequenceClassificationConfig& labels, int64_t pad_token_id,
                                   bool tie_word_embeddings, Generator* gen, TensorOptions opts);
  // The body's final hidden states [B, T, hidden_size] for input_ids.
  virtual Tensor body_hidden_states(const Tensor& input_ids) = 0;
  virtual void save_body_config(const std::string& path) const = 0;
  // Loads dir's weights, the body under base_prefix; score may be missing (left fresh).
  void load_weights(const std::string& dir, const std::string& base_prefix,
                    const std::function<bool(const std::string&)>& ignored);

 private:
  SequenceClassificationConfig labels_;
  int64_t pad_token_id_;
  bool tie_word_embeddings_;  // the config's, written back (the body is built without a head)
};

class GPT2ForSequenceClassification : public DecoderForSequenceClassification {
 public:
  GPT2ForSequenceClassification(const GPTConfig& cfg, const SequenceClassificationConfig& labels,
                                int64_t pad_token_id, Generator* gen = nullptr,
                                TensorOptions opts = {});
  std::string type_name() const override { return "GPT2ForSequenceClassification"; }
  // The body's config (tie_word_embeddings as built: true).
  const GPTConfig& config() const { return body_->config(); }
  // A transformers directory: this class's, or a GPT-2 language model's (the score head then
  // keeps its initialisation, listed by newly_initialized_keys()).
  static std::unique_ptr<GPT2ForSequenceClassification> from_pretrained(const std::string& dir,
                                                                        TensorOptions opts = {});

 protected:
  Tensor body_hidden_states(const Tensor& input_ids) override { return body_->hidden_states(input_ids); }
  void save_body_config(const std::string& path) const override;

 private:
  std::unique_ptr<GPT> body_;  // its transformer is this module's "transformer"
};

class LlamaForSequenceClassification : public DecoderForSequenceClassification {
 public:
  // The body's embed_tokens takes pad_token_id as its padding_idx, as HF's LlamaModel does.
  LlamaForSequenceClassification(const LlamaConfig& cfg, const SequenceClassificationConfig& labels,
                                 int64_t pad_token_id, Generator* gen = nullptr,
                                 TensorOptions opts = {});
  std::string type_name() const override { return "LlamaForSequenceClassification"; }
  const LlamaConfig& config() const { return body_->config(); }
  static std::unique_ptr<LlamaForSequenceClassification> from_pretrained(const std::string& dir,
                                                                         TensorOptions opts = {});

 protected:
  Tensor body_hidden_states(const Tensor& input_ids) override { return body_->hidden_states(input_ids); }
  void save_body_config(const std::string& path) const override;

 private:
  std::unique_ptr<Llama> body_;  // its model is this module's "model"
};

}  // namespace tessera::nn
