// tessera.nn: Module (subclassable from Python), the layers and GPT with its Hugging Face
// model directories. Forward and loss run with the GIL released.
#include "causal_lm_bindings.h"

namespace tessera::python {

void bind_llama(py::module_& nn_module);        // llama.cpp
void bind_classifiers(py::module_& nn_module);  // classifiers.cpp

TensorOptions layer_options(py::handle device, py::handle dtype) {
  return {.dtype = to_dtype(dtype, DType::f32), .device = to_device(device, Device::cpu())};
}

namespace {

// Lets a Python subclass of tessera.nn.Module define forward(); the GIL is taken back
// because module calls run with it released.
class PythonModule : public nn::Module {
 public:
  Tensor forward(const Tensor& x) override { PYBIND11_OVERRIDE(Tensor, nn::Module, forward, x); }
  std::string type_name() const override {
    py::gil_scoped_acquire gil;
    py::object self = py::cast(this, py::return_value_policy::reference);
    return py::str(py::type::of(self).attr("__name__"));
  }
};

// The C++ Module of `self`, a Python subclass instance. Until Module.__init__ has run there is
// none (pybind11 would hand out uninitialised memory and the call would crash), so assigning
// `what` then raises AttributeError, as PyTorch does.
nn::Module& constructed_module(py::handle self, const char* what) {
  auto* instance = reinterpret_cast<py::detail::instance*>(self.ptr());
  // The first (for these single-inheritance classes, the only) C++ object of the instance.
  const py::detail::value_and_holder holder = instance->get_value_and_holder(nullptr, false);
  if (!holder || !holder.holder_constructed())
    throw py::attribute_error(std::string("cannot assign ") + what +
                              " before Module.__init__() call");
  return self.cast<nn::Module&>();
}


py::dict named_tensors_dict(const nn::NamedTensors& named) {
  py::dict out;
  for (const auto& [name, t] : named) out[py::str(name)] = t;
  return out;
}

py::list named_tensors_list(const nn::NamedTensors& named) {
  py::list out;
  for (const auto& [name, t] : named) out.append(py::make_tuple(name, t));
  return out;
}

void bind_module(py::module_& nn_module) {
  using nn::Module;
  py::class_<Module, PythonModule>(nn_module, "Module")
      .def(py::init<>())
      .def(
          "__call__",
          [](Module& m, const Tensor& x) {
            py::gil_scoped_release release;
            return m(x);
          },
          py::arg("input"))
      .def(
          "forward", [](Module& m, const Tensor& x) { return m.forward(x); }, py::arg("input"))
      .def("type_name", &Module::type_name)
      .def(
          "register_parameter",
          [](py::handle self, const std::string& name, const Tensor& t, bool requires_grad) {
            return constructed_module(self, "parameter").register_parameter(name, t, requires_grad);
          },
          py::arg("name"), py::arg("tensor"), py::arg("requires_grad") = true)
      .def(
          "register_buffer",
          [](py::handle self, const std::string& name, const Tensor& t, bool persistent) {
            return constructed_module(self, "buffer").register_buffer(name, t, persistent);
          },
          py::arg("name"), py::arg("tensor"), py::arg("persistent") = true)
      .def(
          "register_module",
          [](py::handle self, const std::string& name, Module& child) -> Module& {
            return constructed_module(self, "module").register_module(name, child);
          },
          py::arg("name"), py::arg("module"), py::keep_alive<1, 3>(),
          py::return_value_policy::reference)
      // Assigning a module to an attribute of a Python subclass registers it, as in PyTorch.
      .def("__setattr__",
           [](py::object self, py::str name, py::object value) {
             if (py::isinstance<Module>(value) && !std::string(name).starts_with("_")) {
               Module& m = constructed_module(self, "module");  // before hasattr reads it
               if (!py::hasattr(self, name)) m.register_module(name, value.cast<Module&>());
             }
             py::module_::import("builtins").attr("object").attr("__setattr__")(self, name, value);
           })
      .def(
          "parameters", [](const Module& m, bool recurse) { return m.parameters(recurse); },
          py::arg("recurse") = true)
      .def(
          "named_parameters",
          [](const Module& m, bool r) { return named_tensors_list(m.named_parameters(r)); },
          py::arg("recurse") = true)
      .def(
          "named_buffers",
          [](const Module& m, bool r) { return named_tensors_list(m.named_buffers(r)); },
          py::arg("recurse") = true)
      .def("named_children", &Module::named_children, py::return_value_policy::reference_internal)
      .def("named_modules", &Module::named_modules, py::return_value_policy::reference_internal)
      .def("parameter", &Module::parameter, py::arg("name"))
      .def("num_parameters", &Module::num_parameters, py::arg("only_trainable") = false)
      .def("state_dict", [](const Module& m) { return named_tensors_dict(m.state_dict()); })
      .def(
          "load_state_dict",
          [](Module& m, const std::map<std::string, Tensor>& state, bool strict) {
            auto r = m.load_state_dict(state, {.strict = strict});
            return py::make_tuple(r.missing_keys, r.unexpected_keys);
          },
          py::arg("state_dict"), py::arg("strict") = true)
      .def(
          "train",
          [](Module& m, bool on) -> Module& {
            m.train(on);
            return m;
          },
          py::arg("mode") = true, py::return_value_policy::reference_internal)
      .def(
          "eval",
          [](Module& m) -> Module& {
            m.eval();
            return m;
          },
          py::return_value_policy::reference_internal)
      .def_property_readonly("training", &Module::is_training)
      .def(
          "to",
          [](Module& m, py::object target, py::object device, py::object dtype) -> Module& {
            Device d = to_device(device, Device::cpu());
            bool move = !device.is_none(), cast = !dtype.is_none();
            DType ty = to_dtype(dtype, DType::f32);
            if (!target.is_none()) {
              if (py::isinstance<DType>(target)) {
                ty = target.cast<DType>();
                cast = true;
              } else {
                d = to_device(target, d);
                move = true;
              }
            }
            py::gil_scoped_release release;
            if (move && cast)
              m.to(d, ty);
            else if (move)
              m.to(d);
            else if (cast)
              m.to(ty);
            return m;
          },
          py::arg("target") = py::none(), py::kw_only(), py::arg("device") = py::none(),
          py::arg("dtype") = py::none(), py::return_value_policy::reference_internal)
      .def("zero_grad", &Module::zero_grad, py::arg("set_to_none") = true)
      .def("__repr__", [](const Module& m) {
        return m.type_name() + "(" + std::to_string(m.num_parameters()) + " parameters)";
      });
}

void bind_layers(py::module_& nn_module) {
  using namespace nn;
  py::class_<Linear, Module>(nn_module, "Linear")
      .def(py::init([](int64_t in, int64_t out, bool bias, double init_std, Generator* gen,
                       py::object device, py::object dtype) {
             return std::make_unique<Linear>(in, out, bias, init_std, gen,
                                             layer_options(device, dtype));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true,
           py::arg("init_std") = 0.02, py::arg("generator") = nullptr,
           py::arg("device") = py::none(), py::arg("dtype") = py::none())
      .def_property_readonly("weight", [](const Linear& l) { return l.weight; })
      .def_property_readonly("bias", [](const Linear& l) -> py::object {
        return l.bias.defined() ? py::cast(l.bias) : py::none();
      });
  py::class_<Embedding, Module>(nn_module, "Embedding")
      .def(py::init([](int64_t n, int64_t dim, double init_std, Generator* gen, py::object device,
                       py::object dtype) {
             return std::make_unique<Embedding>(n, dim, init_std, gen,
                                                layer_options(device, dtype));
           }),
           py::arg("num_embeddings"), py::arg("embedding_dim"), py::arg("init_std") = 0.02,
           py::arg("generator") = nullptr, py::arg("device") = py::none(),
           py::arg("dtype") = py::none())
      .def_property_readonly("weight", [](const Embedding& e) { return e.weight; });
  py::class_<LayerNorm, Module>(nn_module, "LayerNorm")
      .def(py::init([](int64_t dim, double eps, bool bias, py::object device, py::object dtype) {
             return std::make_unique<LayerNorm>(dim, eps, bias, layer_options(device, dtype));
           }),
           py::arg("normalized_shape"), py::arg("eps") = 1e-5, py::arg("bias") = true,
           py::arg("device") = py::none(), py::arg("dtype") = py::none())
      .def_property_readonly("weight", [](const LayerNorm& l) { return l.weight; })
      .def_property_readonly("bias",
                             [](const LayerNorm& l) -> py::object {
                               return l.bias.defined() ? py::cast(l.bias) : py::none();
                             })
      .def_readonly("eps", &LayerNorm::eps);
  py::class_<GELU, Module>(nn_module, "GELU").def(py::init<>());
  py::class_<Dropout, Module>(nn_module, "Dropout")
      .def(py::init([](double p, Generator* gen) { return std::make_unique<Dropout>(p, gen); }),
           py::arg("p") = 0.5, py::arg("generator") = nullptr, py::keep_alive<1, 3>())
      .def_readwrite("p", &Dropout::p);
}

void bind_gpt(py::module_& nn_module) {
  using namespace nn;
  py::class_<GPTConfig>(nn_module, "GPTConfig")
      .def(py::init([](int64_t vocab_size, int64_t block_size, int64_t n_layer, int64_t n_head,
                       int64_t n_embd, double layer_norm_epsilon, bool tie_word_embeddings,
                       bool bias, double dropout) {
             GPTConfig c{.vocab_size = vocab_size,
                         .block_size = block_size,
                         .n_layer = n_layer,
                         .n_head = n_head,
                         .n_embd = n_embd,
                         .layer_norm_epsilon = layer_norm_epsilon,
                         .tie_word_embeddings = tie_word_embeddings,
                         .bias = bias,
                         .dropout = dropout};
             c.validate();
             return c;
           }),
           py::kw_only(), py::arg("vocab_size") = 50257, py::arg("block_size") = 1024,
           py::arg("n_layer") = 12, py::arg("n_head") = 12, py::arg("n_embd") = 768,
           py::arg("layer_norm_epsilon") = 1e-5, py::arg("tie_word_embeddings") = true,
           py::arg("bias") = true, py::arg("dropout") = 0.0)
      .def_readonly("vocab_size", &GPTConfig::vocab_size)
      .def_readonly("block_size", &GPTConfig::block_size)
      .def_readonly("n_layer", &GPTConfig::n_layer)
      .def_readonly("n_head", &GPTConfig::n_head)
      .def_readonly("n_embd", &GPTConfig::n_embd)
      .def_readonly("layer_norm_epsilon", &GPTConfig::layer_norm_epsilon)
      .def_readonly("tie_word_embeddings", &GPTConfig::tie_word_embeddings)
      .def_readonly("dropout", &GPTConfig::dropout)
      .def("__repr__", [](const GPTConfig& c) {
        return detail::concat("GPTConfig(vocab_size=", c.vocab_size, ", block_size=", c.block_size,
                              ", n_layer=", c.n_layer, ", n_head=", c.n_head, ", n_embd=", c.n_embd,
                              ")");
      });
  bind_causal_lm<GPT, GPTConfig>(nn_module, "GPT")
      .def("set_dropout", &GPT::set_dropout, py::arg("p"))
      .def("output_weight", &GPT::output_weight)
      .def_property_readonly(
          "transformer", [](GPT& m) -> Module& { return m.transformer; },
          py::return_value_policy::reference_internal);
  py::class_<GPTTransformer, Module>(nn_module, "GPTTransformer")
      .def_property_readonly(
          "wte", [](GPTTransformer& t) -> Module& { return t.wte; },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "wpe", [](GPTTransformer& t) -> Module& { return t.wpe; },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "ln_f", [](GPTTransformer& t) -> Module& { return t.ln_f; },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "h",
          [](GPTTransformer& t) { return std::vector<Module*>(t.blocks.begin(), t.blocks.end()); },
          py::return_value_policy::reference_internal);
  nn_module.def("language_model_loss", &language_model_loss, py::arg("logits"), py::arg("targets"));
}

}  // namespace

void bind_nn(py::module_& m) {
  py::module_ nn_module = m.def_submodule("nn", "Modules: Linear, Embedding, LayerNorm, GPT, ...");
  bind_module(nn_module);
  bind_layers(nn_module);
  bind_gpt(nn_module);
  bind_llama(nn_module);
  bind_classifiers(nn_module);
}

}  // namespace tessera::python
