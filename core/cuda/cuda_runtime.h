// The CUDA side of Tessera's runtime (namespace tessera::cuda): devices,
// streams, events, pinned host memory and the caching allocator's statistics.
//
// The backend registers itself for DeviceType::CUDA when the library loads
// (see core/allocator.h), so `empty({n}, {.device = Device::cuda()})` works
// with no set-up call. This header needs no CUDA headers: the stream and event
// handles are forward-declared exactly as the CUDA runtime declares them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "tessera/core/device.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace tessera::cuda {

// Number of visible CUDA devices; 0 without a driver or a GPU (never throws).
int device_count();
// Selects the device for this thread (cudaSetDevice); error naming the index if out of range.
void set_device(int index);
int current_device();
// Waits for all work on a device (index < 0: the current device).
void synchronize(int index = -1);
std::string device_name(int index);

// ---- streams ----
// The stream Tessera's kernels run on for `device` in this thread (default: the legacy
// default stream, so kernels order with plain cudaMemcpy and with each other).
cudaStream_t current_stream(int device = -1);
void set_current_stream(cudaStream_t stream, int device = -1);

// An owned non-blocking stream.
class Stream {
 public:
  explicit Stream(int device = -1);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t handle() const { return stream_; }
  int device() const { return device_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

// Makes `stream` current for its device until the guard goes out of scope.
class StreamGuard {
 public:
  StreamGuard(cudaStream_t stream, int device = -1);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t previous_;
  int device_;
};

// Selects a device until the guard goes out of scope (no-op when already current).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

class Event {
 public:
  // timing=false makes a lighter event for ordering only.
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  void synchronize() const;
  bool query() const;  // true when the recorded work has finished
  // Makes `stream` wait for this event without blocking the host.
  void block(cudaStream_t stream) const;
  // Milliseconds between two recorded timing events.
  float elapsed_ms(const Event& end) const;
  cudaEvent_t handle() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// ---- pinned (page-locked) host memory: fast, asynchronous host<->device copies ----
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t nbytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return nbytes_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

// Asynchronous copy on `stream` (or the current stream); the host side should be pinned for
// the copy to overlap. kind is inferred from the pointers (unified addressing).
void memcpy_async(void* dst, const void* src, size_t nbytes, cudaStream_t stream = nullptr);

// ---- the caching allocator ----
struct MemoryStats {
  size_t allocated_bytes = 0;       // held by live tensors (rounded to the size class)
  size_t peak_allocated_bytes = 0;
  size_t reserved_bytes = 0;        // obtained from cudaMalloc, cached or in use
  size_t peak_reserved_bytes = 0;
  uint64_t num_device_allocs = 0;   // cudaMalloc calls
  uint64_t num_device_frees = 0;    // cudaFree calls
  uint64_t num_cache_hits = 0;      // requests served from the cache
  uint64_t num_oom_retries = 0;     // times the cache was emptied to retry a failed cudaMalloc
};
MemoryStats memory_stats(int device = -1);
void reset_peak_memory_stats(int device = -1);
// Returns cached, unused blocks to the driver.
void empty_cache(int device = -1);
// Marks memory as used by `stream` (other than the one it was allocated on): when freed it is
// reused only after the work queued on `stream` so far has finished.
void record_stream(const void* ptr, cudaStream_t stream);

// The size class a request of n bytes is rounded to (exposed for tests and statistics).
size_t allocation_size_class(size_t nbytes);

// ---- determinism ----
// When on, kernels with a choice between atomics and a fixed-order reduction (index_add,
// embedding backward) take the fixed order, so results are bitwise reproducible. Starts on
// when the environment has TESSERA_DETERMINISTIC=1 (for whole programs: `tessera train`).
void set_deterministic(bool on);
bool deterministic();

}  // namespace tessera::cuda
