// tessera.nn.Llama and LlamaConfig: transformers' LlamaForCausalLM and LlamaConfig names over
// nn::Llama (the same Hugging Face model directories). Forward, loss and sampling run with the
// GIL released.
#include "bindings.h"

namespace tessera::python {
namespace {

TensorOptions llama_options(py::handle device, py::handle dtype) {
  return {.dtype = to_dtype(dtype, DType::f32), .device = to_device(device, Device::cpu())};
}

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
  py::class_<Llama, nn::Module>(nn_module, "Llama")
      .def(py::init([](const nn::LlamaConfig& cfg, Generator* gen, py::object device,
                       py::object dtype) {
             return std::make_unique<Llama>(cfg, gen, llama_options(device, dtype));
           }),
           py::arg("config"), py::arg("generator") = nullptr, py::arg("device") = py::none(),
           py::arg("dtype") = py::none(), py::keep_alive<1, 3>())
      .def(
          "loss",
          [](Llama& m, const Tensor& idx, const Tensor& targets) {
            py::gil_scoped_release release;
            return m.loss(idx, targets);
          },
          py::arg("idx"), py::arg("targets"),
          "Mean cross-entropy of the logits of idx [B, T] against targets [B, T]")
      .def(
          "generate",
          [](Llama& m, const Tensor& idx, int64_t n, double temperature, int64_t top_k,
             Generator* gen) {
            if (n < 0)
              throw py::value_error("generate: max_new_tokens must be >= 0, got " +
                                    std::to_string(n));
            py::gil_scoped_release release;
            return m.generate(idx, n, {.temperature = temperature, .top_k = top_k, .gen = gen});
          },
          py::arg("idx"), py::arg("max_new_tokens"), py::arg("temperature") = 1.0,
          py::arg("top_k") = 0, py::arg("generator") = nullptr)
      .def_property_readonly("config", &Llama::config)
      .def("gradient_checkpointing_enable", &Llama::gradient_checkpointing_enable,
           py::arg("enable") = true)
      .def(
          "save_pretrained",
          [](const Llama& m, const std::string& dir) {
            py::gil_scoped_release release;
            runtime_call([&] { m.save_pretrained(dir); });
          },
          py::arg("save_directory"))
      .def_static(
          "from_pretrained",
          [](const std::string& dir, py::object device, py::object dtype) {
            TensorOptions opts = llama_options(device, dtype);
            py::gil_scoped_release release;
            return runtime_call([&] {
              std::unique_ptr<Llama> model = Llama::from_pretrained(dir, opts);
              model->eval();  // as transformers returns it
              return model;
            });
          },
          py::arg("model_dir"), py::arg("device") = py::none(), py::arg("dtype") = py::none());
}

}  // namespace tessera::python
