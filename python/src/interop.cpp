// Zero-copy exchange: the buffer protocol (NumPy's np.asarray(t), memoryview(t)),
// t.numpy(), tessera.from_numpy(array), and DLPack (t.__dlpack__(), t.__dlpack_device__(),
// tessera.from_dlpack(obj)) with PyTorch, JAX, CuPy and NumPy. Whoever receives memory keeps
// its owner alive: a buffer view or DLPack capsule holds the tensor's storage, and a tensor
// made from foreign memory holds the producer's array or managed tensor until its storage
// goes.
#include "bindings.h"
#include "dlpack.h"

namespace tessera::python {
namespace {

// ---- buffer protocol ----

const char* buffer_format(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f";
    case DType::f64:
      return "d";
    case DType::f16:
      return "e";
    case DType::i32:
      return "i";
    case DType::i64:
      return "q";
    case DType::u8:
      return "B";
    case DType::boolean:
      return "?";
    case DType::bf16:
      return nullptr;  // no buffer-protocol or NumPy type
  }
  return nullptr;
}

// What one exported buffer keeps: the storage (even if the tensor is later re-pointed) and
// the shape and byte strides the view points at.
struct ExportedBuffer {
  std::shared_ptr<Storage> storage;
  std::vector<Py_ssize_t> shape, strides;
};

std::string buffer_refusal(const Tensor& t) {
  if (!t.device().is_cpu())
    return "a " + t.device().str() +
           " tensor has no host buffer; call .cpu() first (or use DLPack)";
  if (!buffer_format(t.dtype()))
    return std::string("no NumPy type holds ") + dtype_name(t.dtype()) +
           "; convert with .float() first";
  return {};
}

int tensor_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  try {
    const Tensor& t = py::handle(self).cast<const Tensor&>();
    const std::string refusal = buffer_refusal(t);
    if (!refusal.empty()) {
      PyErr_SetString(PyExc_BufferError, refusal.c_str());
      return -1;
    }
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !t.is_contiguous()) {
      PyErr_SetString(
          PyExc_BufferError,
          "the tensor is not contiguous and the consumer asked for a contiguous buffer; "
          "call .contiguous() first");
      return -1;
    }
    auto* exported = new ExportedBuffer{t.storage(), {}, {}};
    for (int64_t d = 0; d < t.dim(); ++d) {
      exported->shape.push_back(t.size(d));
      exported->strides.push_back(t.stride(d) * static_cast<Py_ssize_t>(t.element_size()));
    }
    view->buf = t.raw_data();
    view->obj = py::handle(self).inc_ref().ptr();
    view->len = static_cast<Py_ssize_t>(t.nbytes());
    view->itemsize = static_cast<Py_ssize_t>(t.element_size());
    view->readonly = 0;
    view->ndim = static_cast<int>(t.dim());
    view->format = (flags & PyBUF_FORMAT) ? const_cast<char*>(buffer_format(t.dtype())) : nullptr;
    view->shape = (flags & PyBUF_ND) ? exported->shape.data() : nullptr;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? exported->strides.data() : nullptr;
    view->suboffsets = nullptr;
    view->internal = exported;
    return 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
    return -1;
  }
}

void tensor_releasebuffer(PyObject*, Py_buffer* view) {
  delete static_cast<ExportedBuffer*>(view->internal);
}

py::array numpy_view(py::handle self) {
  const Tensor& t = self.cast<const Tensor&>();
  const std::string refusal = buffer_refusal(t);
  if (!refusal.empty()) throw py::type_error("numpy(): " + refusal);
  // np.asarray over the buffer protocol: shares memory and keeps `self` alive.
  return py::module_::import("numpy").attr("asarray")(
      py::memoryview(py::reinterpret_borrow<py::object>(self)));
}

DType dtype_of_numpy(const py::array& a) {
  const std::string name = py::str(a.dtype().attr("name"));
  try {
    return dtype_from_name(name);
  } catch (const Error&) {
    throw py::type_error("tessera has no dtype for NumPy's " + name);
  }
}

// A tensor over `data` with the given element strides (possibly a view of a larger block);
// `owner` is released when the last tensor over this memory goes.
Tensor wrap_memory(char* data, const Shape& shape, const Shape& strides, DType dtype, Device device,
                   std::shared_ptr<void> owner) {
  int64_t extent = 0;  // last element touched, relative to data
  for (size_t d = 0; d < shape.size(); ++d) {
    TESSERA_CHECK(strides[d] >= 0,
                  "from_numpy/from_dlpack: negative strides are not supported (strides ",
                  shape_str(strides), "); make the array contiguous first");
    if (shape[d] == 0) extent = -1;
    if (extent >= 0) extent += strides[d] * (shape[d] - 1);
  }
  const size_t bytes = static_cast<size_t>(extent + 1) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>(data, bytes, device, [owner](void*) {});
  return ops::make(std::move(storage), shape, strides, 0, dtype);
}

Tensor from_numpy(py::array array) {
  const DType dtype = dtype_of_numpy(array);
  Shape shape, strides;
  for (py::ssize_t d = 0; d < array.ndim(); ++d) {
    shape.push_back(array.shape(d));
    if (array.strides(d) % array.itemsize() != 0)
      throw py::value_error("from_numpy: the array's stride " + std::to_string(array.strides(d)) +
                            " bytes in dimension " + std::to_string(d) +
                            " is not a whole number of elements");
    strides.push_back(array.strides(d) / array.itemsize());
  }
  if (!array.writeable())
    throw py::value_error("from_numpy: the array is read-only; pass a writable array");
  return wrap_memory(static_cast<char*>(array.mutable_data()), shape, strides, dtype, Device::cpu(),
                     hold_python_object(array));
}

// tessera.tensor(data): a copy of nested lists, numbers or an array, float32 for Python
// floats (as PyTorch), the array's own dtype for NumPy arrays, unless `dtype` says.
Tensor tensor_from_data(py::handle data, py::handle dtype, py::handle device, bool requires_grad) {
  py::module_ np = py::module_::import("numpy");
  if (py::isinstance<Tensor>(data)) {
    const Tensor& t = data.cast<const Tensor&>();
    Tensor out = t.detach().to(to_device(device, t.device()), to_dtype(dtype, t.dtype())).clone();
    if (requires_grad) out.requires_grad_(true);
    return out;
  }
  py::array array = np.attr("asarray")(data);
  if (!py::isinstance<py::array>(data) && dtype.is_none() && array.dtype().kind() == 'f')
    array = np.attr("asarray")(array, "float32");
  DType target = dtype.is_none() ? dtype_of_numpy(array) : to_dtype(dtype, DType::f32);
  if (target == DType::bf16 || target == DType::f16) {
    Tensor f = from_numpy(np.attr("ascontiguousarray")(array, "float32"));
    Tensor out = f.to(to_device(device, Device::cpu()), target);
    if (requires_grad) out.requires_grad_(true);
    return out;
  }
  py::object numpy_name = py::str(dtype_name(target));
  array = np.attr("array")(array, numpy_name, py::arg("copy") = true, py::arg("order") = "C");
  Tensor out = from_numpy(array).to(to_device(device, Device::cpu()));
  if (out.device().is_cpu()) out = out.clone();  // own memory rather than the temporary array's
  if (requires_grad) out.requires_grad_(true);
  return out;
}

// ---- DLPack ----

dlpack::DataType dlpack_dtype(DType d) {
  switch (d) {
    case DType::f32:
      return {dlpack::kFloat, 32, 1};
    case DType::f64:
      return {dlpack::kFloat, 64, 1};
    case DType::f16:
      return {dlpack::kFloat, 16, 1};
    case DType::bf16:
      return {dlpack::kBfloat, 16, 1};
    case DType::i32:
      return {dlpack::kInt, 32, 1};
    case DType::i64:
      return {dlpack::kInt, 64, 1};
    case DType::u8:
      return {dlpack::kUInt, 8, 1};
    case DType::boolean:
      return {dlpack::kBool, 8, 1};
  }
  return {dlpack::kFloat, 32, 1};
}

DType dtype_of_dlpack(const dlpack::DataType& t) {
  TESSERA_CHECK(t.lanes == 1, "from_dlpack: vector types (lanes = ", t.lanes,
                ") are not supported");
  switch (t.code) {
    case dlpack::kFloat:
      if (t.bits == 32) return DType::f32;
      if (t.bits == 64) return DType::f64;
      if (t.bits == 16) return DType::f16;
      break;
    case dlpack::kBfloat:
      if (t.bits == 16) return DType::bf16;
      break;
    case dlpack::kInt:
      if (t.bits == 32) return DType::i32;
      if (t.bits == 64) return DType::i64;
      break;
    case dlpack::kUInt:
      if (t.bits == 8) return DType::u8;
      break;
    case dlpack::kBool:
      if (t.bits == 8) return DType::boolean;
      break;
  }
  TESSERA_FAIL("from_dlpack: no tessera dtype for DLPack type code ", int(t.code), " with ",
               int(t.bits), " bits");
}

// The producer side's context: the tensor (and through it the TensorImpl and storage) plus
// the shape and strides the DLTensor points at.
struct ExportContext {
  Tensor tensor;
  std::shared_ptr<Storage> storage;
  std::vector<int64_t> shape, strides;
  dlpack::ManagedTensor managed{};
};

void delete_export(dlpack::ManagedTensor* managed) {
  delete static_cast<ExportContext*>(managed->manager_ctx);
}

void capsule_destructor(PyObject* capsule) {
  // Only a capsule nobody consumed still owns its tensor.
  if (!PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) return;
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
  if (managed && managed->deleter) managed->deleter(managed);
}

py::capsule to_dlpack(const Tensor& t, py::object stream) {
  (void)stream;  // every CUDA tensor is complete when exported: the device is synchronised below
  if (t.device().is_cuda()) device_backend(DeviceType::CUDA).synchronize(t.device().index);
  auto* ctx = new ExportContext{t, t.storage(), t.shape(), t.strides(), {}};
  dlpack::Tensor& dl = ctx->managed.dl_tensor;
  dl.data = t.raw_data();
  dl.device = {t.device().is_cuda() ? dlpack::kCUDA : dlpack::kCPU, t.device().index};
  dl.ndim = static_cast<int32_t>(t.dim());
  dl.dtype = dlpack_dtype(t.dtype());
  dl.shape = ctx->shape.data();
  dl.strides = ctx->strides.data();
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = &delete_export;
  return py::capsule(&ctx->managed, dlpack::kCapsuleName, &capsule_destructor);
}

py::tuple dlpack_device(const Tensor& t) {
  return py::make_tuple(t.device().is_cuda() ? int(dlpack::kCUDA) : int(dlpack::kCPU),
                        t.device().index);
}

Tensor from_dlpack(py::object source) {
  py::object capsule = source;
  if (py::hasattr(source, "__dlpack__")) {
    py::object device = source.attr("__dlpack_device__")();
    const int type = device.cast<py::tuple>()[0].cast<int>();
    // A CUDA consumer names its stream; Tessera reads on the legacy default stream (1).
    capsule = type == dlpack::kCUDA ? source.attr("__dlpack__")(py::arg("stream") = 1)
                                    : source.attr("__dlpack__")();
  }
  PyObject* raw = capsule.ptr();
  if (!PyCapsule_IsValid(raw, dlpack::kCapsuleName))
    throw py::type_error(
        "from_dlpack: expected an object with __dlpack__ or an unconsumed 'dltensor' capsule");
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(raw, dlpack::kCapsuleName));
  const dlpack::Tensor& dl = managed->dl_tensor;
  Device device = Device::cpu();
  if (dl.device.device_type == dlpack::kCUDA)
    device = Device::cuda(dl.device.device_id);
  else if (dl.device.device_type != dlpack::kCPU && dl.device.device_type != dlpack::kCUDAHost)
    throw py::value_error("from_dlpack: DLPack device type " +
                          std::to_string(dl.device.device_type) +
                          " is not supported (CPU and CUDA are)");
  const DType dtype = dtype_of_dlpack(dl.dtype);
  Shape shape(dl.shape, dl.shape + dl.ndim);
  Shape strides = dl.strides ? Shape(dl.strides, dl.strides + dl.ndim) : contiguous_strides(shape);
  // From here the tensor owns the managed tensor: the producer's deleter runs when the
  // storage goes (with the GIL held: producers such as NumPy release Python objects).
  PyCapsule_SetName(raw, dlpack::kUsedCapsuleName);
  std::shared_ptr<void> owner(managed, [](void* p) {
    auto* m = static_cast<dlpack::ManagedTensor*>(p);
    if (!m->deleter) return;
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    m->deleter(m);
  });
  return wrap_memory(static_cast<char*>(dl.data) + dl.byte_offset, shape, strides, dtype, device,
                     owner);
}

}  // namespace

void bind_interop(py::module_& m, py::class_<Tensor>& cls) {
  auto* heap_type = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
  heap_type->as_buffer.bf_getbuffer = &tensor_getbuffer;
  heap_type->as_buffer.bf_releasebuffer = &tensor_releasebuffer;
  cls.def(
         "numpy", [](py::handle self) { return numpy_view(self); },
         "A NumPy array over the same memory (CPU tensors; the array keeps the tensor alive)")
      .def(
          "__array__",
          [](py::handle self, py::object dtype, py::object copy) {
            py::object array = numpy_view(self);
            if (!dtype.is_none()) array = array.attr("astype")(dtype, py::arg("copy") = false);
            if (!copy.is_none() && copy.cast<bool>()) array = array.attr("copy")();
            return array;
          },
          py::arg("dtype") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack__", &to_dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &dlpack_device);
  m.def("from_numpy", &from_numpy, py::arg("array"),
        "A tensor over the array's memory (no copy); the tensor keeps the array alive");
  m.def("from_dlpack", &from_dlpack, py::arg("ext_tensor"),
        "A tensor over another framework's memory (no copy); keeps the producer's tensor alive");
  m.def(
      "to_dlpack", [](const Tensor& t) { return to_dlpack(t, py::none()); }, py::arg("tensor"));
  m.def("tensor", &tensor_from_data, py::arg("data"), py::kw_only(), py::arg("dtype") = py::none(),
        py::arg("device") = py::none(), py::arg("requires_grad") = false);
}

}  // namespace tessera::python
