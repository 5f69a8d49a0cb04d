// tessera.Tensor: properties, views, indexing, autograd and the factories; dtype, device
// and Generator. The maths is in ops.cpp, NumPy and DLPack exchange in interop.cpp.
#include <sstream>

#include "bindings.h"

namespace tessera::python {
namespace {

// x[index] along dim for a 1-D integer tensor: negative entries count from the end and one
// outside [-size, size) is an IndexError naming it and the size, as PyTorch's.
Tensor select_by_tensor(const Tensor& x, int64_t dim, const Tensor& index) {
  const int64_t n = x.size(dim);
  if (index.numel() > 0 && is_integral(index.dtype()) && index.dtype() != DType::boolean) {
    const int64_t low = static_cast<int64_t>(ops::amin(index).item());
    const int64_t high = static_cast<int64_t>(ops::amax(index).item());
    for (int64_t bad : {low, high})
      if (bad < -n || bad >= n)
        throw py::index_error("index " + std::to_string(bad) + " is out of bounds for dimension " +
                              std::to_string(dim) + " with size " + std::to_string(n));
    if (low < 0)
      return index_select(
          x, dim,
          ops::where(ops::binary(BinaryOp::Lt, index, 0.0), ops::add(index, double(n)), index));
  }
  return index_select(x, dim, index);
}

// x[key] for key an int, a slice (positive step), None, Ellipsis, a 1-D integer tensor or a
// tuple of these, as NumPy and PyTorch read it.
Tensor index_tensor(const Tensor& t, py::handle key) {
  py::tuple items =
      py::isinstance<py::tuple>(key) ? py::reinterpret_borrow<py::tuple>(key) : py::make_tuple(key);
  int64_t consumed = 0;
  bool seen_ellipsis = false;
  for (py::handle item : items) {
    if (item.is_none()) continue;
    if (item.ptr() == Py_Ellipsis) {
      if (seen_ellipsis) throw py::index_error("an index can only have a single ellipsis ('...')");
      seen_ellipsis = true;
      continue;
    }
    ++consumed;
  }
  if (consumed > t.dim())
    throw py::index_error("too many indices for a tensor of dimension " + std::to_string(t.dim()) +
                          " (got " + std::to_string(consumed) + ")");
  Tensor out = t;
  int64_t dim = 0;
  for (py::handle item : items) {
    if (item.is_none()) {
      out = out.unsqueeze(dim++);
    } else if (item.ptr() == Py_Ellipsis) {
      dim += t.dim() - consumed;
    } else if (py::isinstance<py::slice>(item)) {
      size_t start, stop, step, length;
      if (!py::reinterpret_borrow<py::slice>(item).compute(out.size(dim), &start, &stop, &step,
                                                           &length))
        throw py::error_already_set();
      if (static_cast<py::ssize_t>(step) <= 0)
        throw py::value_error("tensor slicing needs a positive step, got " +
                              std::to_string(static_cast<py::ssize_t>(step)));
      const int64_t first = static_cast<int64_t>(start);
      const int64_t end =
          length == 0 ? first : first + (static_cast<int64_t>(length) - 1) * step + 1;
      out = out.slice(dim++, first, end, static_cast<int64_t>(step));
    } else if (py::isinstance<Tensor>(item)) {
      out = select_by_tensor(out, dim++, item.cast<Tensor>());
    } else if (py::isinstance<py::int_>(item) || py::hasattr(item, "__index__")) {
      int64_t i = py::reinterpret_borrow<py::object>(item).attr("__index__")().cast<int64_t>();
      const int64_t n = out.size(dim);
      if (i < -n || i >= n)
        throw py::index_error("index " + std::to_string(i) + " is out of bounds for dimension " +
                              std::to_string(dim) + " with size " + std::to_string(n));
      out = out.select(dim, i < 0 ? i + n : i);
    } else {
      throw py::type_error(
          "tensor indices must be integers, slices, None, ..., or integer tensors, got " +
          std::string(py::str(py::type::of(item))));
    }
  }
  return out;
}

py::object grad_or_none(const Tensor& t) {
  Tensor g = t.grad();
  return g.defined() ? py::cast(g) : py::none();
}

void bind_dtype_device_generator(py::module_& m) {
  py::enum_<DType>(m, "dtype")
      .value("float32", DType::f32)
      .value("float16", DType::f16)
      .value("bfloat16", DType::bf16)
      .value("float64", DType::f64)
      .value("int32", DType::i32)
      .value("int64", DType::i64)
      .value("uint8", DType::u8)
      .value("bool", DType::boolean)
      .def_property_readonly("itemsize", [](DType d) { return dtype_size(d); })
      .def_property_readonly("is_floating_point", [](DType d) { return is_floating(d); })
      .def("__str__", [](DType d) { return "tessera." + std::string(dtype_name(d)); })
      .def("__repr__", [](DType d) { return "tessera." + std::string(dtype_name(d)); });

  py::class_<Device>(m, "device")
      .def(py::init([](const std::string& s) { return Device::parse(s); }), py::arg("spec"))
      .def(py::init([](const std::string& type, int index) {
             return Device::parse(type + ":" + std::to_string(index));
           }),
           py::arg("type"), py::arg("index"))
      .def_property_readonly("type", [](const Device& d) { return d.is_cuda() ? "cuda" : "cpu"; })
      .def_property_readonly("index", [](const Device& d) { return d.index; })
      .def("__str__", &Device::str)
      .def("__repr__", [](const Device& d) { return "device('" + d.str() + "')"; })
      .def("__eq__",
           [](const Device& a, py::handle b) {
             try {
               return a == to_device(b, Device::cpu()) && !b.is_none();
             } catch (const std::exception&) {
               return false;
             }
           })
      .def("__hash__", [](const Device& d) { return static_cast<int>(d.type) * 1024 + d.index; });

  py::class_<Generator>(m, "Generator")
      .def(py::init<uint64_t>(), py::arg("seed") = 0)
      .def(
          "manual_seed",
          [](Generator& g, uint64_t seed) -> Generator& {
            g.manual_seed(seed);
            return g;
          },
          py::return_value_policy::reference_internal)
      .def("initial_seed", &Generator::seed)
      .def_property_readonly("offset", &Generator::offset)
      .def("get_state", [](const Generator& g) { return py::make_tuple(g.seed(), g.offset()); })
      .def("set_state",
           [](Generator& g, std::pair<uint64_t, uint64_t> s) { g.set_state(s.first, s.second); });
  m.def("manual_seed", &manual_seed, py::arg("seed"));
  m.def("default_generator", &default_generator, py::return_value_policy::reference);
  m.def("cuda_is_available", &cuda_is_available);
  m.def("cuda_device_count", &cuda_device_count);
}

void bind_factories(py::module_& m) {
  auto options = [](py::handle dtype, py::handle device, bool requires_grad, DType fallback) {
    return TensorOptions{.dtype = to_dtype(dtype, fallback),
                         .device = to_device(device, Device::cpu()),
                         .requires_grad = requires_grad};
  };
#define TESSERA_FACTORY(name, call)                                                          \
  m.def(                                                                                     \
      "_" name,                                                                              \
      [options](const Shape& shape, py::handle dtype, py::handle device, bool requires_grad, \
                Generator* gen) {                                                            \
        const TensorOptions o = options(dtype, device, requires_grad, DType::f32);           \
        (void)gen;                                                                           \
        return call;                                                                         \
      },                                                                                     \
      py::arg("shape"), py::arg("dtype") = py::none(), py::arg("device") = py::none(),       \
      py::arg("requires_grad") = false, py::arg("generator") = nullptr)
  TESSERA_FACTORY("empty", empty(shape, o));
  TESSERA_FACTORY("zeros", zeros(shape, o));
  TESSERA_FACTORY("ones", ones(shape, o));
  TESSERA_FACTORY("rand", rand(shape, o, gen));
  TESSERA_FACTORY("randn", randn(shape, o, gen));
#undef TESSERA_FACTORY
  m.def(
      "_full",
      [options](const Shape& shape, double value, py::handle dtype, py::handle device,
                bool requires_grad) {
        return full(shape, value, options(dtype, device, requires_grad, DType::f32));
      },
      py::arg("shape"), py::arg("value"), py::arg("dtype") = py::none(),
      py::arg("device") = py::none(), py::arg("requires_grad") = false);
  m.def(
      "_randint",
      [options](int64_t low, int64_t high, const Shape& shape, py::handle dtype, py::handle device,
                Generator* gen) {
        return randint(low, high, shape, options(dtype, device, false, DType::i64), gen);
      },
      py::arg("low"), py::arg("high"), py::arg("shape"), py::arg("dtype") = py::none(),
      py::arg("device") = py::none(), py::arg("generator") = nullptr);
  m.def(
      "_arange",
      [options](double start, double end, double step, py::handle dtype, py::handle device,
                bool requires_grad) {
        return arange(start, end, step, options(dtype, device, requires_grad, DType::i64));
      },
      py::arg("start"), py::arg("end"), py::arg("step"), py::arg("dtype") = py::none(),
      py::arg("device") = py::none(), py::arg("requires_grad") = false);
  m.def("zeros_like", [](const Tensor& t) { return zeros_like(t); });
  m.def("ones_like", [](const Tensor& t) { return ones_like(t); });
  m.def("empty_like", [](const Tensor& t) { return empty_like(t); });
}

void bind_views(py::class_<Tensor>& cls) {
  cls.def("view", [](const Tensor& t, py::args a) { return t.view(shape_from_args(a, "view")); })
      .def("reshape",
           [](const Tensor& t, py::args a) { return t.reshape(shape_from_args(a, "reshape")); })
      .def("permute",
           [](const Tensor& t, py::args a) { return t.permute(shape_from_args(a, "permute")); })
      .def("expand",
           [](const Tensor& t, py::args a) { return t.expand(shape_from_args(a, "expand")); })
      .def("flatten", &Tensor::flatten, py::arg("start_dim") = 0, py::arg("end_dim") = -1)
      .def("transpose", &Tensor::transpose, py::arg("dim0"), py::arg("dim1"))
      .def("t", &Tensor::t)
      .def_property_readonly("T",
                             [](const Tensor& t) {
                               std::vector<int64_t> dims(t.dim());
                               for (int64_t i = 0; i < t.dim(); ++i) dims[i] = t.dim() - 1 - i;
                               return t.permute(dims);
                             })
      .def("narrow", &Tensor::narrow, py::arg("dim"), py::arg("start"), py::arg("length"))
      .def("select", &Tensor::select, py::arg("dim"), py::arg("index"))
      .def(
          "squeeze",
          [](const Tensor& t, py::object dim) {
            return dim.is_none() ? t.squeeze() : t.squeeze(dim.cast<int64_t>());
          },
          py::arg("dim") = py::none())
      .def("unsqueeze", &Tensor::unsqueeze, py::arg("dim"))
      .def("contiguous", &Tensor::contiguous)
      .def("clone", &Tensor::clone)
      .def("detach", &Tensor::detach)
      .def(
          "to",
          [](const Tensor& t, py::object first, py::object dtype, py::object device) {
            // t.to("cuda"), t.to(tessera.float16), t.to(device=..., dtype=...)
            Device d = t.device();
            DType ty = t.dtype();
            if (!first.is_none()) {
              // A string names a device when Device::parse accepts it ("cpu", "cuda:1"), else a
              // dtype.
              bool names_device = py::isinstance<Device>(first);
              if (py::isinstance<py::str>(first)) {
                const std::string spec = first.cast<std::string>();
                try {
                  Device::parse(spec);
                  names_device = true;
                } catch (const Error& device_error) {
                  try {
                    dtype_from_name(spec);
                  } catch (const Error&) {  // neither: say what a device would have been
                    throw py::value_error("Tensor.to: '" + spec + "' is not a dtype, and " +
                                          device_error.what());
                  }
                }
              }
              if (names_device)
                d = to_device(first, d);
              else
                ty = to_dtype(first, ty);
            }
            d = to_device(device, d);
            ty = to_dtype(dtype, ty);
            py::gil_scoped_release release;
            return t.to(d, ty);
          },
          py::arg("target") = py::none(), py::kw_only(), py::arg("dtype") = py::none(),
          py::arg("device") = py::none())
      .def("cpu", [](const Tensor& t) { return t.to(Device::cpu()); })
      .def(
          "cuda", [](const Tensor& t, int index) { return t.to(Device::cuda(index)); },
          py::arg("device") = 0)
      .def("float", [](const Tensor& t) { return t.to(DType::f32); })
      .def("double", [](const Tensor& t) { return t.to(DType::f64); })
      .def("half", [](const Tensor& t) { return t.to(DType::f16); })
      .def("bfloat16", [](const Tensor& t) { return t.to(DType::bf16); })
      .def("long", [](const Tensor& t) { return t.to(DType::i64); })
      .def("int", [](const Tensor& t) { return t.to(DType::i32); })
      .def("__getitem__", &index_tensor)
      .def("__setitem__",
           [](const Tensor& t, py::handle key, py::handle value) {
             Tensor target = index_tensor(t, key);
             if (py::isinstance<Tensor>(value))
               target.copy_(value.cast<Tensor>());
             else
               target.fill_(value.cast<double>());
           })
      .def(
          "copy_", [](Tensor& t, const Tensor& src) -> Tensor& { return t.copy_(src); },
          py::return_value_policy::reference_internal)
      .def(
          "fill_", [](Tensor& t, double v) -> Tensor& { return t.fill_(v); },
          py::return_value_policy::reference_internal)
      .def(
          "zero_", [](Tensor& t) -> Tensor& { return t.zero_(); },
          py::return_value_policy::reference_internal);
}

void bind_autograd(py::module_& m, py::class_<Tensor>& cls) {
  cls.def_property("requires_grad", &Tensor::requires_grad,
                   [](Tensor& t, bool on) { t.requires_grad_(on); })
      .def(
          "requires_grad_", [](Tensor& t, bool on) -> Tensor& { return t.requires_grad_(on); },
          py::arg("requires_grad") = true, py::return_value_policy::reference_internal)
      .def_property("grad", &grad_or_none,
                    [](const Tensor& t, py::object g) {
                      t.set_grad(g.is_none() ? Tensor() : g.cast<Tensor>());
                    })
      .def_property_readonly("is_leaf", &Tensor::is_leaf)
      .def_property_readonly("grad_fn",
                             [](const Tensor& t) -> py::object {
                               if (!t.impl().autograd || !t.impl().autograd->grad_fn)
                                 return py::none();
                               return py::str(t.impl().autograd->grad_fn->name);
                             })
      .def(
          "backward",
          [](const Tensor& t, py::object gradient, bool retain_graph) {
            Tensor g = gradient.is_none() ? Tensor() : gradient.cast<Tensor>();
            py::gil_scoped_release release;
            runtime_call([&] { t.backward(g, retain_graph); });
          },
          py::arg("gradient") = py::none(), py::arg("retain_graph") = false);

  py::class_<autograd::HookHandle>(m, "HookHandle").def("remove", &autograd::HookHandle::remove);
  m.def("is_grad_enabled", &autograd::is_grad_enabled);
  m.def("set_grad_enabled", &autograd::set_grad_enabled, py::arg("mode"));
  m.def(
      "register_grad_ready_hook",
      [](const Tensor& leaf, py::function fn) {
        return autograd::register_grad_ready_hook(leaf, [fn](const Tensor& t) {
          py::gil_scoped_acquire gil;
          fn(t);
        });
      },
      py::arg("leaf"), py::arg("hook"),
      "Calls hook(leaf) once per backward, as soon as leaf.grad holds every contribution");
  m.def(
      "register_hook",
      [](const Tensor& t, py::function fn) {
        return autograd::register_hook(t, [fn](const Tensor& g) {
          py::gil_scoped_acquire gil;
          py::object r = fn(g);
          return r.is_none() ? Tensor() : r.cast<Tensor>();
        });
      },
      py::arg("tensor"), py::arg("hook"));
  m.def(
      "backward",
      [](const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain) {
        py::gil_scoped_release release;
        runtime_call([&] { autograd::backward(roots, grads, retain); });
      },
      py::arg("tensors"), py::arg("grad_tensors") = std::vector<Tensor>{},
      py::arg("retain_graph") = false);
}

}  // namespace

void bind_tensor(py::module_& m) {
  bind_dtype_device_generator(m);
  py::class_<Tensor> cls(m, "Tensor", py::buffer_protocol());
  cls.def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape())); })
      .def(
          "size",
          [](const Tensor& t, py::object dim) -> py::object {
            if (dim.is_none()) return py::tuple(py::cast(t.shape()));
            return py::int_(t.size(dim.cast<int64_t>()));
          },
          py::arg("dim") = py::none())
      .def(
          "stride",
          [](const Tensor& t, py::object dim) -> py::object {
            if (dim.is_none()) return py::tuple(py::cast(t.strides()));
            return py::int_(t.stride(dim.cast<int64_t>()));
          },
          py::arg("dim") = py::none())
      .def_property_readonly("ndim", &Tensor::dim)
      .def("dim", &Tensor::dim)
      .def("numel", &Tensor::numel)
      .def("__len__",
           [](const Tensor& t) {
             if (t.dim() == 0) throw py::type_error("len() of a 0-d tensor");
             return t.size(0);
           })
      // The sub-tensors along dim 0, as PyTorch (without it Python would index until an
      // IndexError, and a 0-d tensor would give an empty list).
      .def("__iter__",
           [](const Tensor& t) {
             if (t.dim() == 0) throw py::type_error("iteration over a 0-d tensor");
             py::list rows;
             for (int64_t i = 0; i < t.size(0); ++i) rows.append(t.select(0, i));
             return py::iter(rows);
           })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("is_cuda", [](const Tensor& t) { return t.device().is_cuda(); })
      .def("element_size", &Tensor::element_size)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("storage_offset", &Tensor::offset)
      .def("data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()); })
      .def("shares_memory_with", &Tensor::shares_storage)
      .def("item",
           [](const Tensor& t) -> py::object {
             const double v = t.item();
             if (t.dtype() == DType::boolean) return py::bool_(v != 0);
             if (is_integral(t.dtype())) return py::int_(static_cast<int64_t>(v));
             return py::float_(v);
           })
      .def("__bool__",
           [](const Tensor& t) {
             TESSERA_CHECK(t.numel() == 1, "bool(): a tensor of ", t.numel(),
                           " elements is ambiguous; use .any() / .all() semantics explicitly");
             return t.item() != 0;
           })
      .def("__float__", [](const Tensor& t) { return t.item(); })
      .def("__int__", [](const Tensor& t) { return static_cast<int64_t>(t.item()); })
      .def("__index__",
           [](const Tensor& t) {
             TESSERA_CHECK(is_integral(t.dtype()) && t.numel() == 1,
                           "only one-element integer tensors can be used as an index, got ",
                           autograd::describe(t));
             return static_cast<int64_t>(t.item());
           })
      .def("__repr__", &Tensor::str);
  bind_views(cls);
  bind_autograd(m, cls);
  bind_factories(m);
  bind_ops(m, cls);
  bind_interop(m, cls);
}

}  // namespace tessera::python
