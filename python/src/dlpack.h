// The DLPack exchange structures (the ABI of the DLPack specification, version 0.8 and
// the unversioned capsule protocol `__dlpack__` / `__dlpack_device__`), written out here so
// the binding needs no extra header. Only the fields and codes Tessera uses are named.
#pragma once
#include <cstdint>

namespace tessera::python::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kBool = 6 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

// Capsule names: a producer's capsule is "dltensor"; a consumer renames it once it owns it.
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

}  // namespace tessera::python::dlpack
