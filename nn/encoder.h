// What the sequence-classification models share (nn/bert.h, nn/distilbert.h,
// nn/classification.h): Hugging Face's label settings (num_labels, id2label, problem_type) and
// the loss they select, the SequenceClassifier interface, the activations HF configs name, the
// key-padding mask of an attention_mask and bidirectional multi-head attention over it.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/nn/module.h"

namespace tessera::nn {

// HF's problem_type: which loss sequence_classification_loss computes.
enum class ProblemType {
  Unspecified,               // chosen from num_labels and the labels' dtype, as HF does
  Regression,                // MSE
  SingleLabelClassification, // cross-entropy over num_labels classes
  MultiLabelClassification,  // binary cross-entropy with logits, per label
};
// "regression" | "single_label_classification" | "multi_label_classification" (null/"" =
// Unspecified); anything else raises naming `source`.
ProblemType parse_problem_type(const std::string& name, const std::string& source);
const char* problem_type_name(ProblemType type);  // "" for Unspecified

// The label settings of a PretrainedConfig. id2label names each of the num_labels classes
// (HF's default LABEL_i); label2id is its inverse and is not stored.
struct SequenceClassificationConfig {
  int64_t num_labels = 2;
  std::vector<std::string> id2label;  // empty: LABEL_0 .. LABEL_{num_labels-1}
  ProblemType problem_type = ProblemType::Unspecified;
  // Throws naming the field when num_labels is not positive or id2label has another size.
  void validate() const;
  std::string label_name(int64_t id) const;
};

// The loss HF's *ForSequenceClassification computes for logits [B, num_labels] and labels:
// Regression: mean squared error against float labels of logits' element count ([B] for one
// label, [B, num_labels]); SingleLabelClassification: mean cross-entropy against integer
// labels [B] (-100 ignored); MultiLabelClassification: mean binary cross-entropy with logits
// against float labels [B, num_labels]. Unspecified: regression for one label, single-label
// for integer labels, multi-label otherwise (HF's rule).
Tensor sequence_classification_loss(const Tensor& logits, const Tensor& labels,
                                    const SequenceClassificationConfig& cfg);

// A model that maps token batches to class logits, with HF's names and model directory.
class SequenceClassifier : public Module {
 public:
  // input_ids [B, T] (integer), attention_mask [B, T] (1 = token, 0 = padding; undefined: all
  // tokens), token_type_ids [B, T] (BERT's segments; undefined: zeros; refused by models
  // without segments) -> logits [B, num_labels].
  virtual Tensor logits(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                        const Tensor& token_type_ids = Tensor()) = 0;
  Tensor forward(const Tensor& input_ids) override { return logits(input_ids); }
  // logits() between this module's forward hooks, as operator() runs forward(): the entry for
  // callers that pass a mask (the Trainer), so that hooks on the root module (ZeRO-3's gather
  // of its parameters) run for them too.
  Tensor hooked_logits(const Tensor& input_ids, const Tensor& attention_mask = Tensor(),
                       const Tensor& token_type_ids = Tensor()) {
    return call_with_hooks(input_ids, [&] { return logits(input_ids, attention_mask, token_type_ids); });
  }
  // Whether logits() takes token_type_ids (BERT's segments); the others refuse them.
  virtual bool takes_token_type_ids() const { return false; }
  // The logits of a collated batch, as the Trainer, `tessera eval` and `tessera predict` compute
  // them: like Hugging Face's Trainer, which drops the columns the model's forward does not take
  // (remove_unused_columns), token_type_ids reach only a model that takes them, so a BERT-style
  // tokenizer's batches train a DistilBERT, GPT-2 or Llama head too. (transformers' GPT-2 would
  // add wte(token_type_ids) to its input; here a decoder's batch is read without them.)
  Tensor batch_logits(const Tensor& input_ids, const Tensor& attention_mask, const Tensor& token_type_ids) {
    return hooked_logits(input_ids, attention_mask, takes_token_type_ids() ? token_type_ids : Tensor());
  }
  // sequence_classification_loss with this model's label settings.
  Tensor loss(const Tensor& logits, const Tensor& labels) const {
    return sequence_classification_loss(logits, labels, labels_config());
  }
  virtual const SequenceClassificationConfig& labels_config() const = 0;
  // Model directory: config.json (HF keys) + model.safetensors (HF tensor names).
  void save_pretrained(const std::string& dir) const;
  // Its config.json alone (a checkpoint's: the weights are written by whoever holds them).
  virtual void save_config(const std::string& path) const = 0;
  // The parameters from_pretrained left at their initialisation because the checkpoint had
  // none (a classification head over a pretrained body, as HF's "newly initialized" warning).
  const std::vector<std::string>& newly_initialized_keys() const { return fresh_keys_; }

 protected:
  std::vector<std::string> fresh_keys_;
};

// A model directory as the SequenceClassifier its config.json's model_type names: "bert",
// "distilbert", "gpt2", "llama"; any other type is refused, naming it.
std::unique_ptr<SequenceClassifier> load_sequence_classifier(const std::string& dir,
                                                             TensorOptions opts = {});

// The activations of HF configs' hidden_act / activation.
enum class Activation { GeluErf, GeluTanh, Relu };
// "gelu" (the erf form), "gelu_new" / "gelu_pytorch_tanh" (tanh form), "relu"; anything else
// raises naming `source`.
Activation parse_activation(const std::string& name, const std::string& source);
const char* activation_name(Activation act);
Tensor activate(Activation act, const Tensor& x);

// Raises, naming `model`, unless input_ids is an integer [B, T] tensor.
void check_token_ids(const Tensor& input_ids, const char* model);

// An attention_mask as the attention takes it. `keep`: scaled_dot_product_attention's bool
// key-padding mask [B, 1, 1, T] (undefined: nothing masked). `kv_lengths`: on a GPU, when every
// row is padded on the right and keeps at least one token, each row's token count (int32 [B]
// on the mask's device: key_padded_attention's fused form); undefined otherwise.
struct AttentionPadding {
  Tensor keep, kv_lengths;
};

// attention_mask [B, T] (any integer or bool dtype, 1 = token) as AttentionPadding; undefined
// stays undefined. On a GPU the mask is read to the host once (for the lengths), so a model
// builds this once per forward and hands it to every layer. `model` names the caller in
// errors (a mask of another shape than input_ids' [B, T]).
AttentionPadding padding_of_attention_mask(const Tensor& attention_mask, const Tensor& input_ids,
                                           const char* model);

// Bidirectional attention of q, k, v [B, T, C] split into n_head heads, masked by `padding`,
// dropout on the probabilities with dropout_p -> the heads merged back [B, T, C].
Tensor multi_head_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t n_head,
                            const AttentionPadding& padding, double dropout_p);

// Copies a checkpoint into `model`, which names its parameters as HF does. Tensors whose names
// do not start with base_prefix ("bert.") get it when none does (a bare BertModel's file).
// `ignored` names checkpoint tensors to skip (buffers, pretraining heads); parameters under
// head_prefixes may be missing (left at their initialisation, returned); any other missing or
// unexpected tensor, or a shape mismatch, raises naming the file.
std::vector<std::string> load_classifier_checkpoint(
    Module& model, const std::string& path, const std::string& base_prefix,
    const std::function<bool(const std::string&)>& ignored,
    const std::vector<std::string>& head_prefixes);

}  // namespace tessera::nn
