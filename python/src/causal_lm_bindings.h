// The methods every causal language model class shares in Python (tessera.nn.GPT, Llama):
// construction from its config, loss, generate, gradient checkpointing and its Hugging Face
// model directory (from_pretrained returns the model in eval mode, as transformers does).
#pragma once
#include "bindings.h"

namespace tessera::python {

TensorOptions layer_options(py::handle device, py::handle dtype);  // nn.cpp

// load(dir, options) with the GIL released, the model returned in eval mode (dropout off until
// model.train()), as transformers' from_pretrained returns it.
template <class Load>
auto load_in_eval_mode(const std::string& dir, py::handle device, py::handle dtype, Load load) {
  TensorOptions opts = layer_options(device, dtype);
  py::gil_scoped_release release;
  return runtime_call([&] {
    auto model = load(dir, opts);
    model->eval();
    return model;
  });
}

// save_pretrained(save_directory) of any model with a Hugging Face directory.
template <class Model>
void def_save_pretrained(py::class_<Model, nn::Module>& cls) {
  cls.def(
      "save_pretrained",
      [](const Model& m, const std::string& dir) {
        py::gil_scoped_release release;
        runtime_call([&] { m.save_pretrained(dir); });
      },
      py::arg("save_directory"));
}

template <class Model, class Config>
py::class_<Model, nn::Module> bind_causal_lm(py::module_& nn_module, const char* name) {
  py::class_<Model, nn::Module> cls(nn_module, name);
  cls.def(py::init([](const Config& cfg, Generator* gen, py::object device, py::object dtype) {
            return std::make_unique<Model>(cfg, gen, layer_options(device, dtype));
          }),
          py::arg("config"), py::arg("generator") = nullptr, py::arg("device") = py::none(),
          py::arg("dtype") = py::none(), py::keep_alive<1, 3>())
      .def(
          "loss",
          [](Model& m, const Tensor& idx, const Tensor& targets) {
            py::gil_scoped_release release;
            return m.loss(idx, targets);
          },
          py::arg("idx"), py::arg("targets"),
          "Mean cross-entropy of the logits of idx [B, T] against targets [B, T]")
      .def(
          "generate",
          [](Model& m, const Tensor& idx, int64_t n, double temperature, int64_t top_k,
             Generator* gen) {
            if (n < 0)
              throw py::value_error("generate: max_new_tokens must be >= 0, got " +
                                    std::to_string(n));
            py::gil_scoped_release release;
            return m.generate(idx, n, {.temperature = temperature, .top_k = top_k, .gen = gen});
          },
          py::arg("idx"), py::arg("max_new_tokens"), py::arg("temperature") = 1.0,
          py::arg("top_k") = 0, py::arg("generator") = nullptr)
      .def_property_readonly("config", &Model::config)
      .def(
          "gradient_checkpointing_enable",
          [](Model& m, py::object kwargs) {
            // transformers' signature; the dict is read by CheckpointPolicy::from_kwargs
            // ({"policy": "every_k:2"}; torch's "use_reentrant" is accepted and ignored).
            nlohmann::json j = nlohmann::json::object();
            if (!kwargs.is_none())
              j = nlohmann::json::parse(
                  py::module_::import("json").attr("dumps")(kwargs).cast<std::string>());
            m.gradient_checkpointing_enable(j);
          },
          py::arg("gradient_checkpointing_kwargs") = py::none(),
          "Recompute activations in backward while training, by the policy in "
          "gradient_checkpointing_kwargs[\"policy\"]: full (default), every_k:K, attention, mlp, "
          "none")
      .def("gradient_checkpointing_disable", [](Model& m) { m.gradient_checkpointing_disable(); })
      .def_property_readonly("is_gradient_checkpointing",
                             [](const Model& m) { return m.is_gradient_checkpointing(); })
      .def_property_readonly(
          "gradient_checkpointing_policy",
          [](const Model& m) { return m.gradient_checkpointing_policy().name(); },
          "The policy's name (\"none\" when off)")
      .def_static(
          "from_pretrained",
          [](const std::string& dir, py::object device, py::object dtype) {
            return load_in_eval_mode(dir, device, dtype, &Model::from_pretrained);
          },
          py::arg("model_dir"), py::arg("device") = py::none(), py::arg("dtype") = py::none());
  def_save_pretrained(cls);
  return cls;
}

}  // namespace tessera::python
