// tessera._tessera: the native half of the Python package (python/tessera/ is the other).
#include "bindings.h"

namespace tessera::python {
namespace {

void translate_errors(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const OutOfMemoryError& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const RuntimeFailure& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  }
}

}  // namespace

DType to_dtype(py::handle value, DType fallback) {
  if (value.is_none()) return fallback;
  if (py::isinstance<DType>(value)) return value.cast<DType>();
  if (py::isinstance<py::str>(value)) return dtype_from_name(value.cast<std::string>());
  if (value.ptr() == reinterpret_cast<PyObject*>(&PyFloat_Type)) return DType::f32;
  if (value.ptr() == reinterpret_cast<PyObject*>(&PyBool_Type)) return DType::boolean;
  if (value.ptr() == reinterpret_cast<PyObject*>(&PyLong_Type)) return DType::i64;
  // NumPy dtypes and scalar types ("float32", "int64", "bool" ...).
  py::object numpy_dtype = py::module_::import("numpy").attr("dtype")(value);
  std::string name = py::str(numpy_dtype.attr("name"));
  return dtype_from_name(name);
}

Device to_device(py::handle value, Device fallback) {
  if (value.is_none()) return fallback;
  if (py::isinstance<Device>(value)) return value.cast<Device>();
  if (py::isinstance<py::str>(value)) return Device::parse(value.cast<std::string>());
  throw py::type_error("expected a tessera.device or a string such as 'cpu' or 'cuda:0', got " +
                       std::string(py::str(py::type::of(value))));
}

Shape shape_from_args(const py::args& args, const char* op) {
  if (args.size() == 1 && !py::isinstance<py::int_>(args[0])) {
    try {
      return args[0].cast<Shape>();
    } catch (const py::cast_error&) {
      throw py::type_error(std::string(op) +
                           ": sizes must be integers or one sequence of integers");
    }
  }
  Shape shape;
  for (py::handle a : args) {
    if (!py::isinstance<py::int_>(a))
      throw py::type_error(std::string(op) + ": sizes must be integers, got " +
                           std::string(py::str(py::type::of(a))));
    shape.push_back(a.cast<int64_t>());
  }
  return shape;
}

std::vector<int64_t> dims_from(py::handle dims) {
  if (dims.is_none()) return {};
  if (py::isinstance<py::int_>(dims)) return {dims.cast<int64_t>()};
  return dims.cast<std::vector<int64_t>>();
}

std::shared_ptr<void> hold_python_object(py::object owner) {
  auto* held = new py::object(std::move(owner));
  return std::shared_ptr<void>(held, [](void* p) {
    if (!Py_IsInitialized()) return;  // interpreter gone: nothing left to release
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
}

}  // namespace tessera::python

PYBIND11_MODULE(_tessera, m) {
  using namespace tessera::python;
  m.doc() = "Tessera's C++ engine: tensors, autograd, nn, optim, data, dist and train";
  py::register_exception_translator(&translate_errors);
  bind_tensor(m);
  bind_nn(m);
  bind_optim(m);
  bind_data(m);
  bind_dist(m);
  bind_train(m);
  bind_bench(m);
}
