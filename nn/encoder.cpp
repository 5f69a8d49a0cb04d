#include "tessera/nn/encoder.h"

#include <algorithm>
#include <sstream>

#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/hf_config.h"

namespace tessera::nn {

namespace {
constexpr std::pair<ProblemType, const char*> kProblemTypes[] = {
    {ProblemType::Regression, "regression"},
    {ProblemType::SingleLabelClassification, "single_label_classification"},
    {ProblemType::MultiLabelClassification, "multi_label_classification"},
};

constexpr std::pair<Activation, const char*> kActivations[] = {
    {Activation::GeluErf, "gelu"},
    {Activation::GeluTanh, "gelu_new"},
    {Activation::GeluTanh, "gelu_pytorch_tanh"},
    {Activation::Relu, "relu"},
};

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

bool starts_with_any(const std::string& s, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return starts_with(s, p); });
}

std::string joined(const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : "") << names[i];
  return out.str();
}

// HF's rule for a config without problem_type.
ProblemType resolved_problem_type(const SequenceClassificationConfig& cfg, const Tensor& labels) {
  if (cfg.problem_type != ProblemType::Unspecified) return cfg.problem_type;
  if (cfg.num_labels == 1) return ProblemType::Regression;
  const bool integer_labels = is_integral(labels.dtype()) && labels.dtype() != DType::boolean;
  return integer_labels ? ProblemType::SingleLabelClassification
                        : ProblemType::MultiLabelClassification;
}

// Labels as float values of the logits' dtype, checked to hold one target per logit.
Tensor float_targets(const Tensor& logits, const Tensor& labels, const char* what) {
  TESSERA_CHECK(labels.numel() == logits.numel(), "sequence_classification_loss: ", what,
                " labels ", shape_str(labels.shape()), " must hold one target per logit of ",
                shape_str(logits.shape()));
  return ops::reshape(ops::to(labels, logits.device(), logits.dtype()), logits.shape());
}
}  // namespace

ProblemType parse_problem_type(const std::string& name, const std::string& source) {
  if (name.empty()) return ProblemType::Unspecified;
  for (const auto& [type, text] : kProblemTypes)
    if (name == text) return type;
  TESSERA_FAIL(source, ": problem_type \"", name,
               "\" is not one of regression, single_label_classification, "
               "multi_label_classification");
}

const char* problem_type_name(ProblemType type) {
  for (const auto& [t, text] : kProblemTypes)
    if (t == type) return text;
  return "";
}

void SequenceClassificationConfig::validate() const {
  TESSERA_CHECK(num_labels > 0, "SequenceClassificationConfig: num_labels must be positive, got ",
                num_labels);
  TESSERA_CHECK(id2label.empty() || static_cast<int64_t>(id2label.size()) == num_labels,
                "SequenceClassificationConfig: id2label names ", id2label.size(),
                " labels but num_labels is ", num_labels);
}

std::string SequenceClassificationConfig::label_name(int64_t id) const {
  TESSERA_CHECK(id >= 0 && id < num_labels, "SequenceClassificationConfig: label id ", id,
                " is outside [0, ", num_labels, ")");
  return id2label.empty() ? "LABEL_" + std::to_string(id) : id2label[id];
}

Tensor sequence_classification_loss(const Tensor& logits, const Tensor& labels,
                                    const SequenceClassificationConfig& cfg) {
  TESSERA_CHECK(logits.dim() == 2 && logits.size(1) == cfg.num_labels,
                "sequence_classification_loss: logits must be [B, num_labels = ", cfg.num_labels,
                "], got ", shape_str(logits.shape()));
  TESSERA_CHECK(labels.defined(), "sequence_classification_loss: labels are undefined");
  switch (resolved_problem_type(cfg, labels)) {
    case ProblemType::Regression:
      return mean(square(logits - float_targets(logits, labels, "regression")));
    case ProblemType::MultiLabelClassification: {
      // log(1 + exp(-|x|)) + max(x, 0) - x y: BCEWithLogitsLoss's stable form.
      const Tensor y = float_targets(logits, labels, "multi-label");
      return mean(relu(logits) - logits * y + log1p(exp(-abs(logits))));
    }
    default:
      TESSERA_CHECK(is_integral(labels.dtype()) && labels.dtype() != DType::boolean &&
                        labels.dim() <= 1 && labels.numel() == logits.size(0),
                    "sequence_classification_loss: single-label classification needs integer "
                    "labels [B = ",
                    logits.size(0), "], got ", autograd::describe(labels));
      return cross_entropy(logits, ops::reshape(labels, {logits.size(0)}));
  }
}

Activation parse_activation(const std::string& name, const std::string& source) {
  for (const auto& [act, text] : kActivations)
    if (name == text) return act;
  TESSERA_FAIL(source, ": activation \"", name,
               "\" is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)");
}

const char* activation_name(Activation act) {
  for (const auto& [a, text] : kActivations)
    if (a == act) return text;
  return "";
}

Tensor activate(Activation act, const Tensor& x) {
  switch (act) {
    case Activation::GeluErf:
      return gelu_erf(x);
    case Activation::GeluTanh:
      return gelu(x);
    default:
      return relu(x);
  }
}

void check_token_ids(const Tensor& input_ids, const char* model) {
  TESSERA_CHECK(
      input_ids.dim() == 2 && is_integral(input_ids.dtype()) && input_ids.dtype() != DType::boolean,
      model, ": input_ids must be integer [B, T], got ", autograd::describe(input_ids));
}

void SequenceClassifier::save_pretrained(const std::string& dir) const {
  hf::save_model_directory(dir, *this, [&](const std::string& path) { save_config(path); });
}

namespace {

// Each row's token count when every row of keep [B, T] is padded on the right and keeps a
// token, as int32 [B] on keep's device; undefined otherwise.
Tensor right_padded_lengths(const Tensor& keep) {
  const int64_t B = keep.size(0), T = keep.size(1);
  const std::vector<uint8_t> host = ops::to(keep, Device::cpu(), DType::u8).to_vector<uint8_t>();
  std::vector<int32_t> lengths(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* row = host.data() + b * T;
    const int64_t length = std::find(row, row + T, uint8_t{0}) - row;
    if (length == 0 || std::find(row + length, row + T, uint8_t{1}) != row + T) return Tensor();
    lengths[static_cast<size_t>(b)] = static_cast<int32_t>(length);
  }
  return ops::to(from_vector(lengths, {B}, {.dtype = DType::i32}), keep.device(), DType::i32);
}

}  // namespace

AttentionPadding padding_of_attention_mask(const Tensor& attention_mask, const Tensor& input_ids,
                                           const char* model) {
  if (!attention_mask.defined()) return {};
  TESSERA_CHECK(
      attention_mask.shape() == input_ids.shape() &&
          (is_integral(attention_mask.dtype()) || attention_mask.dtype() == DType::boolean),
      model, ": attention_mask must be an integer or bool tensor of input_ids' shape ",
      shape_str(input_ids.shape()), ", got ", autograd::describe(attention_mask));
  const Tensor keep = ops::binary(BinaryOp::Ne, attention_mask, 0.0);
  AttentionPadding padding{ops::reshape(keep, {keep.size(0), 1, 1, keep.size(1)}), Tensor()};
  // Only a GPU has a fused padded attention to hand the lengths to; the CPU never reads back.
  if (keep.device().is_cuda()) padding.kv_lengths = right_padded_lengths(keep);
  return padding;
}

Tensor multi_head_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t n_head,
                            const AttentionPadding& padding, double dropout_p) {
  const int64_t B = q.size(0), T = q.size(1), C = q.size(2);
  auto heads = [&](const Tensor& x) {
    return x.reshape({B, T, n_head, C / n_head}).transpose(1, 2);
  };
  const Tensor y = key_padded_attention(heads(q), heads(k), heads(v), padding.keep,
                                        padding.kv_lengths, /*causal=*/false, dropout_p);
  return y.transpose(1, 2).reshape({B, T, C});
}

std::vector<std::string> load_classifier_checkpoint(
    Module& model, const std::string& path, const std::string& base_prefix,
    const std::function<bool(const std::string&)>& ignored,
    const std::vector<std::string>& head_prefixes) {
  const SafetensorsContents file = load_safetensors(path);
  const bool has_prefix = std::any_of(file.tensors.begin(), file.tensors.end(), [&](const auto& e) {
    return starts_with(e.first, base_prefix);
  });
  std::map<std::string, Tensor> state;
  for (const auto& [name, t] : file.tensors) {
    state[has_prefix || starts_with_any(name, head_prefixes) ? name : base_prefix + name] = t;
  }
  LoadStateDictOptions opts{.strict = false, .ignore = ignored};
  LoadStateDictResult result;
  try {
    result = model.load_state_dict(state, opts);
  } catch (const Error& e) {
    TESSERA_FAIL(model.type_name(), ": loading '", path, "': ", e.what());
  }
  std::vector<std::string> fresh, missing;
  for (const std::string& name : result.missing_keys)
    (starts_with_any(name, head_prefixes) ? fresh : missing).push_back(name);
  TESSERA_CHECK(
      missing.empty() && result.unexpected_keys.empty(), model.type_name(), ": loading '", path,
      "': the checkpoint does not match the model",
      missing.empty() ? "" : "; missing: ", joined(missing),
      result.unexpected_keys.empty() ? "" : "; unexpected: ", joined(result.unexpected_keys));
  return fresh;
}

}  // namespace tessera::nn
