// Memory comes from an allocator chosen by device. Core knows only the CPU one;
// a device backend (core/cuda, in libtessera_cuda.so) registers its own when it is
// loaded, so nothing here depends on CUDA. Asking for a device whose backend is not
// loaded yet loads it (core/backend_library.h).
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

#include "tessera/core/device.h"

namespace tessera {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Throws OutOfMemoryError when the memory cannot be had.
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr, size_t nbytes) = 0;
};

// What core needs from a device beyond memory: byte copies to and from it and
// a way to wait for it. Registered by the backend together with its allocator.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual Allocator* allocator(int index) = 0;
  // Copies n bytes; either side may be the host (DeviceType::CPU).
  virtual void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                          size_t n) = 0;
  virtual void synchronize(int index) = 0;
  virtual int device_count() = 0;
  // Page-locked host memory, for staging buffers that copy to and from this device at full
  // speed (dist stages device tensors through it); null when the device has none.
  virtual Allocator* pinned_host_allocator() { return nullptr; }
  // Queues a copy of n bytes of device memory into page-locked host memory (from
  // pinned_host_allocator) behind the work issued so far, and returns a function that blocks
  // until that copy alone is done (not work issued after it). An empty function: the copy
  // was made before returning (the default).
  virtual std::function<void()> copy_to_host_async(void* pinned_host, const void* src,
                                                   Device src_device, size_t n) {
    copy_bytes(pinned_host, Device::cpu(), src, src_device, n);
    return {};
  }
};

Allocator* cpu_allocator();
void register_device_backend(DeviceType type, DeviceBackend* backend);
// The backend for a device type (loading its library on first use), or an error saying why
// there is none.
DeviceBackend& device_backend(DeviceType type);
bool has_device_backend(DeviceType type);
Allocator* allocator_for(Device device);

// Number of CUDA devices usable now (0 in a CPU-only build or without a GPU).
int cuda_device_count();
inline bool cuda_is_available() { return cuda_device_count() > 0; }

// A block of memory on one device. Owns it unless built around external memory
// with a deleter (memory-mapped files, views of another framework's buffers).
class Storage {
 public:
  Storage(size_t nbytes, Device device);
  Storage(void* external, size_t nbytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  // Shared by every tensor viewing this memory (see VersionCounter in core/tensor.h).
  const std::shared_ptr<uint64_t>& version_counter() const { return version_counter_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;
  std::function<void(void*)> deleter_;
  std::shared_ptr<uint64_t> version_counter_ = std::make_shared<uint64_t>(0);
};

}  // namespace tessera
