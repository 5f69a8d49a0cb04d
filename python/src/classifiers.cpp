// tessera.nn's sequence classifiers with transformers' names: SequenceClassifier (the base:
// logits, loss, save_pretrained), BertConfig and BertForSequenceClassification, and
// AutoModelForSequenceClassification.from_pretrained (a directory's config.json picks BERT,
// DistilBERT, GPT-2 or Llama). Calling a classifier returns transformers' output object
// (python/tessera/nn.py). from_pretrained returns the model in eval mode, as transformers does.
#include "causal_lm_bindings.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/encoder.h"

namespace tessera::python {
namespace {

Tensor tensor_or_undefined(py::handle value) {
  return value.is_none() ? Tensor() : value.cast<Tensor>();
}

nn::SequenceClassificationConfig labels_config(int64_t num_labels, py::handle id2label,
                                               py::handle problem_type) {
  nn::SequenceClassificationConfig labels{.num_labels = num_labels};
  if (!id2label.is_none()) {
    // transformers' {0: "NEG", 1: "POS"} (keys may be strings, as in a config.json).
    auto names = py::reinterpret_borrow<py::dict>(id2label);
    labels.id2label.resize(names.size());
    for (auto [key, name] : names) {
      const int64_t id = py::module_::import("builtins").attr("int")(key).cast<int64_t>();
      TESSERA_CHECK(id >= 0 && id < int64_t(names.size()), "BertConfig: id2label key ", id,
                    " is outside [0, ", names.size(), ")");
      labels.id2label[id] = name.cast<std::string>();
    }
    if (num_labels == 2 && names.size() != 2) labels.num_labels = int64_t(names.size());
  }
  if (!problem_type.is_none())
    labels.problem_type = nn::parse_problem_type(problem_type.cast<std::string>(), "BertConfig");
  labels.validate();
  return labels;
}

void bind_bert_config(py::module_& nn_module) {
  using nn::BertConfig;
  py::class_<BertConfig>(nn_module, "BertConfig")
      .def(py::init([](int64_t vocab_size, int64_t hidden_size, int64_t num_hidden_layers,
                       int64_t num_attention_heads, int64_t intermediate_size,
                       const std::string& hidden_act, double hidden_dropout_prob,
                       double attention_probs_dropout_prob, std::optional<double> classifier_dropout,
                       int64_t max_position_embeddings, int64_t type_vocab_size,
                       double initializer_range, double layer_norm_eps, int64_t pad_token_id,
                       int64_t num_labels, py::object id2label, py::object problem_type) {
             BertConfig c{.vocab_size = vocab_size,
                          .hidden_size = hidden_size,
                          .num_hidden_layers = num_hidden_layers,
                          .num_attention_heads = num_attention_heads,
                          .intermediate_size = intermediate_size,
                          .hidden_act = nn::parse_activation(hidden_act, "BertConfig hidden_act"),
                          .hidden_dropout_prob = hidden_dropout_prob,
                          .attention_probs_dropout_prob = attention_probs_dropout_prob,
                          .classifier_dropout = classifier_dropout.value_or(-1),
                          .max_position_embeddings = max_position_embeddings,
                          .type_vocab_size = type_vocab_size,
                          .initializer_range = initializer_range,
                          .layer_norm_eps = layer_norm_eps,
                          .pad_token_id = pad_token_id,
                          .labels = labels_config(num_labels, id2label, problem_type)};
             c.validate();
             return c;
           }),
           py::kw_only(), py::arg("vocab_size") = 30522, py::arg("hidden_size") = 768,
           py::arg("num_hidden_layers") = 12, py::arg("num_attention_heads") = 12,
           py::arg("intermediate_size") = 3072, py::arg("hidden_act") = "gelu",
           py::arg("hidden_dropout_prob") = 0.1, py::arg("attention_probs_dropout_prob") = 0.1,
           py::arg("classifier_dropout") = py::none(), py::arg("max_position_embeddings") = 512,
           py::arg("type_vocab_size") = 2, py::arg("initializer_range") = 0.02,
           py::arg("layer_norm_eps") = 1e-12, py::arg("pad_token_id") = 0,
           py::arg("num_labels") = 2, py::arg("id2label") = py::none(),
           py::arg("problem_type") = py::none())
      .def_readonly("vocab_size", &BertConfig::vocab_size)
      .def_readonly("hidden_size", &BertConfig::hidden_size)
      .def_readonly("num_hidden_layers", &BertConfig::num_hidden_layers)
      .def_readonly("num_attention_heads", &BertConfig::num_attention_heads)
      .def_readonly("max_position_embeddings", &BertConfig::max_position_embeddings)
      .def_readonly("pad_token_id", &BertConfig::pad_token_id)
      .def_property_readonly("num_labels", [](const BertConfig& c) { return c.labels.num_labels; });
}

}  // namespace

void bind_classifiers(py::module_& nn_module) {
  using nn::SequenceClassifier;
  py::class_<SequenceClassifier, nn::Module> classifier(nn_module, "SequenceClassifier");
  classifier.def(
          "logits",
          [](SequenceClassifier& m, const Tensor& input_ids, py::object attention_mask,
             py::object token_type_ids) {
            const Tensor mask = tensor_or_undefined(attention_mask);
            const Tensor segments = tensor_or_undefined(token_type_ids);
            py::gil_scoped_release release;
            return m.logits(input_ids, mask, segments);
          },
          py::arg("input_ids"), py::arg("attention_mask") = py::none(),
          py::arg("token_type_ids") = py::none(), "logits [B, num_labels]")
      .def(
          "loss",
          [](const SequenceClassifier& m, const Tensor& logits, const Tensor& labels) {
            py::gil_scoped_release release;
            return m.loss(logits, labels);
          },
          py::arg("logits"), py::arg("labels"),
          "transformers' loss for the config's problem_type (cross-entropy, MSE or BCE)")
      .def_property_readonly("num_labels",
                             [](const SequenceClassifier& m) { return m.labels_config().num_labels; })
      .def_property_readonly("newly_initialized_keys", &SequenceClassifier::newly_initialized_keys);
  def_save_pretrained(classifier);
  bind_bert_config(nn_module);
  py::class_<nn::BertForSequenceClassification, SequenceClassifier>(nn_module,
                                                                   "BertForSequenceClassification")
      .def(py::init([](const nn::BertConfig& cfg, Generator* gen, py::object device,
                       py::object dtype) {
             return std::make_unique<nn::BertForSequenceClassification>(
                 cfg, gen, layer_options(device, dtype));
           }),
           py::arg("config"), py::arg("generator") = nullptr, py::arg("device") = py::none(),
           py::arg("dtype") = py::none(), py::keep_alive<1, 3>())
      .def_property_readonly("config", &nn::BertForSequenceClassification::config)
      .def_static(
          "from_pretrained",
          [](const std::string& dir, py::object device, py::object dtype) {
            return load_in_eval_mode(dir, device, dtype,
                                     &nn::BertForSequenceClassification::from_pretrained);
          },
          py::arg("model_dir"), py::arg("device") = py::none(), py::arg("dtype") = py::none());
  nn_module.def(
      "_load_sequence_classifier",
      [](const std::string& dir, py::object device, py::object dtype) {
        return load_in_eval_mode(dir, device, dtype, &nn::load_sequence_classifier);
      },
      py::arg("model_dir"), py::arg("device") = py::none(), py::arg("dtype") = py::none());
}

}  // namespace tessera::python
