#include "tessera/core/allocator.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

#include "tessera/core/backend_library.h"
#include "tessera/core/error.h"
#include "tessera/core/memory_category.h"
#include "tessera/core/memory_stats.h"
#include "tessera/core/size_only.h"

namespace tessera {
namespace {

std::atomic<size_t> host_bytes_in_use{0};
std::atomic<size_t> host_peak_bytes{0};

void raise_host_peak(size_t in_use) {
  size_t peak = host_peak_bytes.load(std::memory_order_relaxed);
  while (in_use > peak && !host_peak_bytes.compare_exchange_weak(peak, in_use, std::memory_order_relaxed)) {
  }
}

// 64-byte aligned host memory: full cache lines, and wide enough for any SIMD load.
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    size_t rounded = (nbytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw OutOfMemoryError(detail::concat("cpu: out of memory allocating ", nbytes, " bytes"));
    raise_host_peak(host_bytes_in_use.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes) override {
    if (!ptr) return;
    host_bytes_in_use.fetch_sub(nbytes, std::memory_order_relaxed);
    std::free(ptr);
  }
};

std::array<std::atomic<DeviceBackend*>, kNumDeviceTypes>& backends() {
  static std::array<std::atomic<DeviceBackend*>, kNumDeviceTypes> table{};
  return table;
}

// The library that registers a device type's backend when it loads.
const char* backend_library_of(DeviceType type) {
  return type == DeviceType::CUDA ? "cuda" : nullptr;
}

// The registered backend, after loading its library if needed; null (and why) if none.
DeviceBackend* find_backend(DeviceType type, std::string* why_not) {
  DeviceBackend* b = backends()[static_cast<int>(type)].load();
  if (b != nullptr) return b;
  const char* library = backend_library_of(type);
  if (library == nullptr) {
    if (why_not) *why_not = "no backend library for this device type";
    return nullptr;
  }
  if (!load_backend_library(library, why_not)) return nullptr;
  b = backends()[static_cast<int>(type)].load();
  if (b == nullptr && why_not)
    *why_not = std::string("the '") + library + "' backend library loaded but registered no device";
  return b;
}

}  // namespace

HostMemoryStats host_memory_stats() {
  return {host_bytes_in_use.load(std::memory_order_relaxed), host_peak_bytes.load(std::memory_order_relaxed)};
}

void reset_host_peak_memory() {
  host_peak_bytes.store(host_bytes_in_use.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::atomic<Allocator*> g_cpu_override{nullptr};

Allocator* cpu_allocator() {
  static CpuAllocator alloc;
  Allocator* override = g_cpu_override.load(std::memory_order_relaxed);
  return override ? override : &alloc;
}

void set_cpu_allocator_override(Allocator* allocator) { g_cpu_override = allocator; }

void register_device_backend(DeviceType type, DeviceBackend* backend) {
  backends()[static_cast<int>(type)] = backend;
}

bool has_device_backend(DeviceType type) { return find_backend(type, nullptr) != nullptr; }

DeviceBackend& device_backend(DeviceType type) {
  std::string why_not;
  DeviceBackend* b = find_backend(type, &why_not);
  TESSERA_CHECK(b != nullptr, "device backend for ", Device{type, 0}.str(), " is not available: ",
                why_not);
  return *b;
}

int cuda_device_count() {
  if (!has_device_backend(DeviceType::CUDA)) return 0;
  return device_backend(DeviceType::CUDA).device_count();
}

Allocator* allocator_for(Device device) {
  if (device.is_cpu()) return cpu_allocator();
  DeviceBackend& b = device_backend(device.type);
  TESSERA_CHECK(device.index >= 0 && device.index < b.device_count(), "device ", device.str(),
                " does not exist (", b.device_count(), " CUDA device(s) visible)");
  return b.allocator(device.index);
}

Storage::Storage(size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(allocator_for(device)) {
  data_ = allocator_->allocate(nbytes);
  detail::record_storage_allocated(this, nbytes, device.type);
}

Storage::Storage(void* external, size_t nbytes, Device device, std::function<void(void*)> deleter)
    : data_(external), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

Storage::~Storage() {
  if (allocator_) detail::record_storage_freed(this);
  if (deleter_) {
    deleter_(data_);
  } else if (allocator_ && data_) {
    allocator_->deallocate(data_, nbytes_);
  }
}

}  // namespace tessera
