// The maths of tessera.Tensor: operators, element-wise functions, reductions, linear
// algebra, selection, and the same functions at module level (tessera.exp(x), ...).
#include <optional>

#include "bindings.h"

namespace tessera::python {
namespace {

using Unary = Tensor (*)(const Tensor&);
using Binary = Tensor (*)(const Tensor&, const Tensor&);
using ReduceFn = Tensor (*)(const Tensor&, const std::vector<int64_t>&, bool);

// A Python operand of a binary operator: a tensor, or a number taken as a 0-d tensor of
// the other operand's dtype (integers stay integral only for integer tensors).
Tensor operand_like(py::handle value, const Tensor& like) {
  if (py::isinstance<Tensor>(value)) return value.cast<Tensor>();
  DType dtype = like.dtype();
  if (py::isinstance<py::float_>(value) && !is_floating(dtype)) dtype = DType::f32;
  return full({}, value.cast<double>(), {.dtype = dtype, .device = like.device()});
}

// Arithmetic with numbers goes through the (tensor, double) overloads so that a scalar
// takes the tensor's dtype (PyTorch's rule for a Python scalar).
template <class TensorTensor, class TensorScalar>
void def_binary(py::class_<Tensor>& cls, const char* name, const char* reflected, TensorTensor tt,
                TensorScalar ts, bool commutative) {
  cls.def(name, [tt](const Tensor& a, const Tensor& b) { return tt(a, b); });
  cls.def(name, [ts](const Tensor& a, double b) { return ts(a, b); });
  if (commutative) {
    cls.def(reflected, [ts](const Tensor& a, double b) { return ts(a, b); });
  } else {
    cls.def(reflected, [tt](const Tensor& a, py::handle b) { return tt(operand_like(b, a), a); });
  }
}

void bind_operators(py::class_<Tensor>& cls) {
  def_binary(
      cls, "__add__", "__radd__", [](const Tensor& a, const Tensor& b) { return a + b; },
      [](const Tensor& a, double b) { return a + b; }, true);
  def_binary(
      cls, "__mul__", "__rmul__", [](const Tensor& a, const Tensor& b) { return a * b; },
      [](const Tensor& a, double b) { return a * b; }, true);
  def_binary(
      cls, "__sub__", "__rsub__", [](const Tensor& a, const Tensor& b) { return a - b; },
      [](const Tensor& a, double b) { return a - b; }, false);
  def_binary(
      cls, "__truediv__", "__rtruediv__", [](const Tensor& a, const Tensor& b) { return a / b; },
      [](const Tensor& a, double b) { return a / b; }, false);
  def_binary(
      cls, "__pow__", "__rpow__",
      [](const Tensor& a, const Tensor& b) { return tessera::pow(a, b); },
      [](const Tensor& a, double b) { return tessera::pow(a, b); }, false);
  cls.def("__neg__", [](const Tensor& a) { return -a; });
  cls.def("__pos__", [](const Tensor& a) { return a; });
  cls.def("__abs__", [](const Tensor& a) { return tessera::abs(a); });
  cls.def("__matmul__", [](const Tensor& a, const Tensor& b) {
    py::gil_scoped_release release;
    return matmul(a, b);
  });
  cls.def("__rmatmul__", [](const Tensor& a, const Tensor& b) { return matmul(b, a); });
  // In place: x += y (recorded on the tape when needed, see functions.h).
#define TESSERA_INPLACE(pyname, fn)                                           \
  cls.def(                                                                    \
      pyname, [](Tensor& a, const Tensor& b) -> Tensor& { return fn(a, b); }, \
      py::return_value_policy::reference_internal);                           \
  cls.def(                                                                    \
      pyname, [](Tensor& a, double b) -> Tensor& { return fn(a, b); },        \
      py::return_value_policy::reference_internal)
  TESSERA_INPLACE("__iadd__", add_);
  TESSERA_INPLACE("__isub__", sub_);
  TESSERA_INPLACE("__imul__", mul_);
  TESSERA_INPLACE("__itruediv__", div_);
  TESSERA_INPLACE("add_", add_);
  TESSERA_INPLACE("sub_", sub_);
  TESSERA_INPLACE("mul_", mul_);
  TESSERA_INPLACE("div_", div_);
#undef TESSERA_INPLACE
  // Comparisons give bool tensors.
  const std::pair<const char*, std::pair<Binary, Tensor (*)(const Tensor&, double)>> comparisons[] =
      {{"__eq__", {&eq, &eq}}, {"__ne__", {&ne, &ne}}, {"__lt__", {&lt, &lt}},
       {"__le__", {&le, &le}}, {"__gt__", {&gt, &gt}}, {"__ge__", {&ge, &ge}}};
  for (const auto& [name, fns] : comparisons) {
    cls.def(name, fns.first);
    cls.def(name, fns.second);
  }
  // == compares elements, so hashing is by identity (as PyTorch): tensors can be dict keys.
  cls.def("__hash__", [](py::handle self) { return reinterpret_cast<intptr_t>(self.ptr()); });
}

void bind_elementwise(py::module_& m, py::class_<Tensor>& cls) {
  const std::pair<const char*, Unary> unary[] = {
      {"exp", &exp},       {"log", &log},     {"sqrt", &sqrt},
      {"rsqrt", &rsqrt},   {"tanh", &tanh},   {"sigmoid", &sigmoid},
      {"relu", &relu},     {"gelu", &gelu},   {"abs", &abs},
      {"square", &square}, {"sin", &sin},     {"cos", &cos},
      {"log1p", &log1p},   {"expm1", &expm1}, {"reciprocal", &reciprocal},
      {"silu", &silu},     {"neg", &neg}};
  for (const auto& [name, fn] : unary) {
    m.def(name, fn, py::arg("input"));
    cls.def(name, fn);
  }
  const std::pair<const char*, Binary> binary[] = {
      {"maximum", &maximum}, {"minimum", &minimum}, {"eq", &eq}, {"ne", &ne},        {"lt", &lt},
      {"le", &le},           {"gt", &gt},           {"ge", &ge}, {"swiglu", &swiglu}};
  for (const auto& [name, fn] : binary) {
    m.def(name, fn, py::arg("input"), py::arg("other"));
    cls.def(name, fn, py::arg("other"));
  }
  auto clamp_fn = [](const Tensor& x, std::optional<double> lo, std::optional<double> hi) {
    return clamp(x, lo, hi);
  };
  m.def("clamp", clamp_fn, py::arg("input"), py::arg("min") = py::none(),
        py::arg("max") = py::none());
  cls.def("clamp", clamp_fn, py::arg("min") = py::none(), py::arg("max") = py::none());
  auto pow_fn = [](const Tensor& x, py::handle e) {
    return py::isinstance<Tensor>(e) ? tessera::pow(x, e.cast<Tensor>())
                                     : tessera::pow(x, e.cast<double>());
  };
  m.def("pow", pow_fn, py::arg("input"), py::arg("exponent"));
  cls.def("pow", pow_fn, py::arg("exponent"));
  m.def(
      "where",
      [](const Tensor& cond, py::handle a, py::handle b) {
        if (py::isinstance<Tensor>(a) && py::isinstance<Tensor>(b))
          return where(cond, a.cast<Tensor>(), b.cast<Tensor>());
        if (py::isinstance<Tensor>(a)) return where(cond, a.cast<Tensor>(), b.cast<double>());
        return where(cond, a.cast<double>(), b.cast<Tensor>());
      },
      py::arg("condition"), py::arg("input"), py::arg("other"));
  auto masked_fill_fn = [](const Tensor& x, const Tensor& mask, double v) {
    return masked_fill(x, mask, v);
  };
  m.def("masked_fill", masked_fill_fn, py::arg("input"), py::arg("mask"), py::arg("value"));
  cls.def("masked_fill", masked_fill_fn, py::arg("mask"), py::arg("value"));
}

void bind_reductions(py::module_& m, py::class_<Tensor>& cls) {
  const std::pair<const char*, ReduceFn> reductions[] = {
      {"sum", &sum},   {"mean", &mean},           {"amax", &amax},
      {"amin", &amin}, {"logsumexp", &logsumexp}, {"prod", &prod}};
  for (const auto& [name, fn] : reductions) {
    auto f = [fn = fn](const Tensor& x, py::handle dim, bool keepdim) {
      return fn(x, dims_from(dim), keepdim);
    };
    m.def(name, f, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
    cls.def(name, f, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  }
  auto var_fn = [](const Tensor& x, py::handle dim, double correction, bool keepdim) {
    return var(x, dims_from(dim), correction, keepdim);
  };
  auto std_fn = [](const Tensor& x, py::handle dim, double correction, bool keepdim) {
    return std_dev(x, dims_from(dim), correction, keepdim);
  };
  for (auto [name, fn] : {std::pair{"var", +var_fn}, std::pair{"std", +std_fn}}) {
    m.def(name, fn, py::arg("input"), py::arg("dim") = py::none(), py::arg("correction") = 1.0,
          py::arg("keepdim") = false);
    cls.def(name, fn, py::arg("dim") = py::none(), py::arg("correction") = 1.0,
            py::arg("keepdim") = false);
  }
  // max/min: over everything a 0-d tensor, along a dim (values, indices) as PyTorch.
  auto extreme = [](bool is_max) {
    return [is_max](const Tensor& x, py::object dim, bool keepdim) -> py::object {
      if (dim.is_none()) return py::cast(is_max ? amax(x) : amin(x));
      ValuesIndices r =
          is_max ? max(x, dim.cast<int64_t>(), keepdim) : min(x, dim.cast<int64_t>(), keepdim);
      return py::make_tuple(r.values, r.indices);
    };
  };
  for (bool is_max : {true, false}) {
    const char* name = is_max ? "max" : "min";
    m.def(name, extreme(is_max), py::arg("input"), py::arg("dim") = py::none(),
          py::arg("keepdim") = false);
    cls.def(name, extreme(is_max), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  }
  auto argmax_fn = [](const Tensor& x, py::object dim, bool keepdim) {
    if (dim.is_none()) return ops::argmax(x.reshape({-1}), 0, false);
    return ops::argmax(x, dim.cast<int64_t>(), keepdim);
  };
  m.def("argmax", argmax_fn, py::arg("input"), py::arg("dim") = py::none(),
        py::arg("keepdim") = false);
  cls.def("argmax", argmax_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  auto topk_fn = [](const Tensor& x, int64_t k, int64_t dim, bool largest) {
    ValuesIndices r = topk(x, k, dim, largest);
    return py::make_tuple(r.values, r.indices);
  };
  m.def("topk", topk_fn, py::arg("input"), py::arg("k"), py::arg("dim") = -1,
        py::arg("largest") = true);
  cls.def("topk", topk_fn, py::arg("k"), py::arg("dim") = -1, py::arg("largest") = true);
  m.def("cumsum", &cumsum, py::arg("input"), py::arg("dim"));
  cls.def("cumsum", &cumsum, py::arg("dim"));
}

void bind_nn_functions(py::module_& m, py::class_<Tensor>& cls) {
  m.def("softmax", &softmax, py::arg("input"), py::arg("dim"));
  cls.def("softmax", &softmax, py::arg("dim"));
  m.def("log_softmax", &log_softmax, py::arg("input"), py::arg("dim"));
  cls.def("log_softmax", &log_softmax, py::arg("dim"));
  m.def(
      "matmul",
      [](const Tensor& a, const Tensor& b) {
        py::gil_scoped_release release;
        return matmul(a, b);
      },
      py::arg("input"), py::arg("other"));
  cls.def("matmul", [](const Tensor& a, const Tensor& b) { return matmul(a, b); });
  m.def(
      "linear",
      [](const Tensor& x, const Tensor& w, std::optional<Tensor> b) {
        py::gil_scoped_release release;
        return linear(x, w, b.value_or(Tensor()));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none());
  m.def(
      "layer_norm",
      [](const Tensor& x, std::optional<Tensor> w, std::optional<Tensor> b, double eps) {
        return layer_norm(x, w.value_or(Tensor()), b.value_or(Tensor()), eps);
      },
      py::arg("input"), py::arg("weight") = py::none(), py::arg("bias") = py::none(),
      py::arg("eps") = 1e-5);
  m.def(
      "rms_norm",
      [](const Tensor& x, std::optional<Tensor> w, double eps) {
        return rms_norm(x, w.value_or(Tensor()), eps);
      },
      py::arg("input"), py::arg("weight") = py::none(), py::arg("eps") = 1e-6);
  m.def(
      "embedding",
      [](const Tensor& weight, const Tensor& indices) { return embedding(weight, indices); },
      py::arg("weight"), py::arg("indices"));
  m.def(
      "dropout",
      [](const Tensor& x, double p, bool training, Generator* gen) {
        return dropout(x, p, training, gen);
      },
      py::arg("input"), py::arg("p") = 0.5, py::arg("training") = true,
      py::arg("generator") = nullptr);
  m.def(
      "cross_entropy",
      [](const Tensor& logits, const Tensor& targets, int64_t ignore_index,
         const std::string& reduction) {
        TESSERA_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none",
                      "cross_entropy: reduction must be 'mean', 'sum' or 'none', got '", reduction,
                      "'");
        const Reduction r = reduction == "mean"  ? Reduction::Mean
                            : reduction == "sum" ? Reduction::Sum
                                                 : Reduction::None;
        return cross_entropy(logits, targets, ignore_index, r);
      },
      py::arg("input"), py::arg("target"), py::arg("ignore_index") = -100,
      py::arg("reduction") = "mean");
  m.def(
      "scaled_dot_product_attention",
      [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double dropout_p,
         Generator* gen, std::optional<Tensor> attn_mask) {
        py::gil_scoped_release release;
        return scaled_dot_product_attention(q, k, v, attn_mask.value_or(Tensor()), causal,
                                            dropout_p, gen);
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("is_causal") = false,
      py::arg("dropout_p") = 0.0, py::arg("generator") = nullptr,
      py::arg("attn_mask") = py::none());
  m.def("cat", &cat, py::arg("tensors"), py::arg("dim") = 0);
  m.def("stack", &stack, py::arg("tensors"), py::arg("dim") = 0);
  auto split_fn = [](const Tensor& x, py::handle size, int64_t dim) {
    return py::isinstance<py::int_>(size) ? split(x, size.cast<int64_t>(), dim)
                                          : split(x, size.cast<std::vector<int64_t>>(), dim);
  };
  m.def("split", split_fn, py::arg("tensor"), py::arg("split_size_or_sections"),
        py::arg("dim") = 0);
  cls.def("split", split_fn, py::arg("split_size_or_sections"), py::arg("dim") = 0);
  m.def("chunk", &chunk, py::arg("input"), py::arg("chunks"), py::arg("dim") = 0);
  cls.def("chunk", &chunk, py::arg("chunks"), py::arg("dim") = 0);
  auto gather_fn = [](const Tensor& x, int64_t dim, const Tensor& index) {
    return gather(x, dim, index);
  };
  m.def("gather", gather_fn, py::arg("input"), py::arg("dim"), py::arg("index"));
  cls.def("gather", gather_fn, py::arg("dim"), py::arg("index"));
  m.def("index_select", &index_select, py::arg("input"), py::arg("dim"), py::arg("index"));
  cls.def("index_select", &index_select, py::arg("dim"), py::arg("index"));
  m.def(
      "multinomial",
      [](const Tensor& p, int64_t n, Generator* gen) { return ops::multinomial(p, n, gen); },
      py::arg("input"), py::arg("num_samples"), py::arg("generator") = nullptr);
}

}  // namespace

void bind_ops(py::module_& m, py::class_<Tensor>& cls) {
  bind_operators(cls);
  bind_elementwise(m, cls);
  bind_reductions(m, cls);
  bind_nn_functions(m, cls);
}

}  // namespace tessera::python
