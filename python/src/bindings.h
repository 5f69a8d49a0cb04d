// What the binding files of tessera._tessera share: how Python values become shapes, dtypes
// and devices, and how C++ errors become Python exceptions.
//
// Error policy (module.cpp installs the translator): tessera::OutOfMemoryError ->
// MemoryError; tessera::Error -> ValueError (TESSERA_CHECK is how the library refuses a
// shape, dtype, key or value it was given); calls whose failures concern files, other
// processes or the state of a run rather than their arguments (loading and saving,
// collectives, backward, training) go through runtime_call, which turns tessera::Error into
// RuntimeError. The message is always the library's own.
#pragma once
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tessera/tessera.h"

namespace tessera::python {

namespace py = pybind11;

// A failure that is not about the caller's arguments (translated to RuntimeError).
class RuntimeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs fn, turning tessera::Error (but not OutOfMemoryError) into RuntimeFailure.
template <class Fn>
decltype(auto) runtime_call(Fn&& fn) {
  try {
    return fn();
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    throw RuntimeFailure(e.what());
  }
}

// A dtype given as tessera.dtype, a name ("float32", "bf16", ...), a NumPy dtype or a
// Python type (float, int, bool); `fallback` when None.
DType to_dtype(py::handle value, DType fallback);
// A device given as tessera.device or a string ("cpu", "cuda:1"); `fallback` when None.
Device to_device(py::handle value, Device fallback);
// Sizes given as separate integers or as one sequence: f(2, 3) or f((2, 3)).
Shape shape_from_args(const py::args& args, const char* op);
// Dimensions given as None (all), one integer or a sequence.
std::vector<int64_t> dims_from(py::handle dims);
// A Python object kept alive by C++ memory (released with the GIL held).
std::shared_ptr<void> hold_python_object(py::object owner);

void bind_tensor(py::module_& m);
void bind_ops(py::module_& m, py::class_<Tensor>& tensor);
void bind_interop(py::module_& m, py::class_<Tensor>& tensor);
void bind_nn(py::module_& m);
void bind_optim(py::module_& m);
void bind_data(py::module_& m);
void bind_dist(py::module_& m);
void bind_train(py::module_& m);
void bind_bench(py::module_& m);

}  // namespace tessera::python
