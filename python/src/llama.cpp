// tessera.nn.Llama and LlamaConfig: transformers' LlamaForCausalLM and LlamaConfig names over
// nn::Llama (the same Hugging Face model directories); its methods are GPT's
// (causal_lm_bindings.h).
#include "causal_lm_bindings.h"
#include "tessera/nn/llama.h"

namespace tessera::python {
namespace {

void bind_llama_config(py::module_& nn_module) {
  using nn::LlamaConfig;
  py::class_<LlamaConfig>(nn_module, "LlamaConfig")
      .def(py::init([](int64_t vocab_size, int64_t hidden_size, int64_t intermediate_size,
                       int64_t num_hidden_layers, int64_t num_attention_heads,
                       std::optional<int64_t> num_key_value_heads, std::optional<int64_t> head_dim,
                       int64_t max_position_embeddings, double rms_norm_eps, double rope_theta,
                       bool tie_word_embeddings, double initializer_range) {
             LlamaConfig c{.vocab_size = vocab_size,
                           .hidden_size = hidden_size,
                           .intermediate_size = intermediate_size,
                           .num_hidden_layers = num_hidden_layers,
                           .num_attention_heads = num_attention_heads,
                           // transformers: None means as many as the attention heads.
                           .num_key_value_heads = num_key_value_heads.value_or(num_attention_heads),
                           .head_dim = head_dim.value_or(0),
                           .max_position_embeddings = max_position_embeddings,
                           .rms_norm_eps = rms_norm_eps,
                           .rope_theta = rope_theta,
                           .tie_word_embeddings = tie_word_embeddings,
                           .initializer_range = initializer_range};
             c.validate();
             return c;
           }),
           py::kw_only(), py::arg("vocab_size") = 32000, py::arg("hidden_size") = 4096,
           py::arg("intermediate_size") = 11008, py::arg("num_hidden_layers") = 32,
           py::arg("num_attention_heads") = 32, py::arg("num_key_value_heads") = py::none(),
           py::arg("head_dim") = py::none(), py::arg("max_position_embeddings") = 2048,
           py::arg("rms_norm_eps") = 1e-6, py::arg("rope_theta") = 10000.0,
           py::arg("tie_word_embeddings") = false, py::arg("initializer_range") = 0.02)
      .def_readonly("vocab_size", &LlamaConfig::vocab_size)
      .def_readonly("hidden_size", &LlamaConfig::hidden_size)
      .def_readonly("intermediate_size", &LlamaConfig::intermediate_size)
      .def_readonly("num_hidden_layers", &LlamaConfig::num_hidden_layers)
      .def_readonly("num_attention_heads", &LlamaConfig::num_attention_heads)
      .def_readonly("num_key_value_heads", &LlamaConfig::num_key_value_heads)
      .def_property_readonly("head_dim", &LlamaConfig::attention_head_dim)
      .def_readonly("max_position_embeddings", &LlamaConfig::max_position_embeddings)
      .def_readonly("rms_norm_eps", &LlamaConfig::rms_norm_eps)
      .def_readonly("rope_theta", &LlamaConfig::rope_theta)
      .def_readonly("tie_word_embeddings", &LlamaConfig::tie_word_embeddings)
      .def("__repr__", [](const LlamaConfig& c) {
        return detail::concat("LlamaConfig(vocab_size=", c.vocab_size,
                              ", hidden_size=", c.hidden_size,
                              ", num_hidden_layers=", c.num_hidden_layers,
                              ", num_attention_heads=", c.num_attention_heads,
                              ", num_key_value_heads=", c.num_key_value_heads, ")");
      });
}

}  // namespace

void bind_llama(py::module_& nn_module) {
  using nn::Llama;
  bind_llama_config(nn_module);
  bind_causal_lm<Llama, nn::LlamaConfig>(nn_module, "Llama");
}

}  // namespace tessera::python
