// CUDA runtime: device selection, streams, events, pinned memory, and the
// DeviceBackend (caching allocator + byte copies) registered for DeviceType::CUDA.
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/cuda/cuda_graph.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/cuda/caching_allocator.h"
#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/settings.h"

namespace tessera::cuda {

int device_count() {
  // Asked once: the answer does not change while the process runs, and without a driver the
  // query itself is slow and leaves an error behind that must not leak into later calls.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
}

static int resolve(int index) { return index < 0 ? current_device() : index; }

void set_device(int index) {
  TESSERA_CHECK(index >= 0 && index < device_count(), "cuda::set_device: device cuda:", index,
                " does not exist (", device_count(), " CUDA device(s) visible)");
  TESSERA_CUDA_CHECK(cudaSetDevice(index));
}

int current_device() {
  int d = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void synchronize(int index) {
  DeviceGuard guard(resolve(index));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

// ---- streams ----
namespace {
constexpr int kMaxDevices = 64;
thread_local std::array<cudaStream_t, kMaxDevices> tls_current_streams{};
}  // namespace

cudaStream_t current_stream(int device) {
  const int d = resolve(device);
  TESSERA_CHECK(d >= 0 && d < kMaxDevices, "cuda::current_stream: bad device index ", d);
  return tls_current_streams[d];
}

void set_current_stream(cudaStream_t stream, int device) {
  const int d = resolve(device);
  TESSERA_CHECK(d >= 0 && d < kMaxDevices, "cuda::set_current_stream: bad device index ", d);
  tls_current_streams[d] = stream;
}

Stream::Stream(int device) : device_(resolve(device)) {
  DeviceGuard guard(device_);
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);  // no throw from a destructor
}

void Stream::synchronize() const { TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

StreamGuard::StreamGuard(cudaStream_t stream, int device)
    : previous_(current_stream(device)), device_(resolve(device)) {
  set_current_stream(stream, device_);
}

StreamGuard::~StreamGuard() { tls_current_streams[device_] = previous_; }

DeviceGuard::DeviceGuard(int index) : previous_(current_device()) {
  if (index != previous_) set_device(index);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

Event::Event(bool timing) {
  TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault
                                                              : cudaEventDisableTiming));
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

void Event::record(cudaStream_t stream) { TESSERA_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void Event::synchronize() const { TESSERA_CUDA_CHECK(cudaEventSynchronize(event_)); }

bool Event::query() const {
  cudaError_t s = cudaEventQuery(event_);
  if (s == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  TESSERA_CUDA_CHECK(s);
  return true;
}

void Event::block(cudaStream_t stream) const {
  TESSERA_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

float Event::elapsed_ms(const Event& end) const {
  float ms = 0;
  TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
  return ms;
}

// ---- pinned memory ----
PinnedBuffer::PinnedBuffer(size_t nbytes) : nbytes_(nbytes) {
  if (nbytes == 0) return;
  cudaError_t s = cudaMallocHost(&data_, nbytes);
  if (s != cudaSuccess) {
    cudaGetLastError();
    throw OutOfMemoryError(::tessera::detail::concat("cudaMallocHost(", nbytes,
                                                     " bytes) failed: ", cudaGetErrorString(s)));
  }
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), nbytes_(o.nbytes_) {
  o.data_ = nullptr;
  o.nbytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFreeHost(data_);
    data_ = o.data_;
    nbytes_ = o.nbytes_;
    o.data_ = nullptr;
    o.nbytes_ = 0;
  }
  return *this;
}

void memcpy_async(void* dst, const void* src, size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) return;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault,
                                     stream ? stream : current_stream()));
}

// ---- determinism ----
namespace {
// Read at the first use, not while the backend loads (a bad value is then that call's error
// naming TESSERA_DETERMINISTIC, not the end of the program); -1: not read yet.
std::atomic<int> g_deterministic{-1};
}
void set_deterministic(bool on) {
  set_setting_option(Setting::Deterministic, on ? "1" : "0");
  g_deterministic = on ? 1 : 0;
}
bool deterministic() {
  if (g_deterministic.load() < 0) {
    int unread = -1;
    g_deterministic.compare_exchange_strong(unread, setting_enabled(Setting::Deterministic) ? 1 : 0);
  }
  return g_deterministic.load() == 1;
}

// ---- the backend ----
namespace {

// Page-locked host memory (cudaMallocHost): staging buffers copy at full DMA speed.
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes) override {
    void* p = nullptr;
    if (nbytes == 0) return p;
    const cudaError_t s = cudaMallocHost(&p, nbytes);
    if (s != cudaSuccess) {
      cudaGetLastError();
      throw OutOfMemoryError(::tessera::detail::concat("cudaMallocHost(", nbytes,
                                                       " bytes) failed: ", cudaGetErrorString(s)));
    }
    return p;
  }
  void deallocate(void* ptr, size_t) override {
    if (ptr) cudaFreeHost(ptr);
  }
};

// Small host-to-device copies (a batch of token ids, a scalar) return without waiting for the
// device: the bytes go first into a page-locked staging slot, which the asynchronous copy reads
// in stream order; a slot is reused only once the event recorded behind its last copy has
// completed. A blocking copy would drain the GPU's queue every training step and the host could
// never run ahead of it. Larger copies wait, as before (no unbounded pinned memory).
constexpr size_t kStagedCopyMaxBytes = size_t(4) << 20;

void copy_host_to_device_staged(void* dst, const void* src, size_t n, int gpu,
                                cudaStream_t stream) {
  struct Slot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t done = nullptr;
  };
  struct Ring {
    std::array<Slot, 8> slots;
    size_t next = 0;
  };
  static std::mutex mutex;
  static auto* rings = new std::map<int, Ring>;  // never freed: no CUDA calls at exit
  std::lock_guard<std::mutex> lock(mutex);
  Ring& ring = (*rings)[gpu];
  Slot& slot = ring.slots[ring.next];
  ring.next = (ring.next + 1) % ring.slots.size();
  if (slot.done) {
    TESSERA_CUDA_CHECK(cudaEventSynchronize(slot.done));  // its last copy has read it
  } else {
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  if (slot.capacity < n) {
    if (slot.host) TESSERA_CUDA_CHECK(cudaFreeHost(slot.host));
    slot.host = nullptr;
    slot.capacity = 0;
    const size_t capacity = std::max<size_t>(n, size_t(64) << 10);
    const cudaError_t status = cudaMallocHost(&slot.host, capacity);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw OutOfMemoryError(::tessera::detail::concat(
          "cudaMallocHost(", capacity, " bytes) for a staged host-to-device copy failed: ",
          cudaGetErrorString(status)));
    }
    slot.capacity = capacity;
  }
  std::memcpy(slot.host, src, n);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, n, cudaMemcpyHostToDevice, stream));
  TESSERA_CUDA_CHECK(cudaEventRecord(slot.done, stream));
}

class CudaBackend final : public DeviceBackend {
 public:
  Allocator* allocator(int index) override { return &caching_allocator(index); }

  void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device,
                  size_t n) override {
    if (n == 0) return;
    if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
      // Across GPUs: wait for both sides' queued work, then copy (peer or staged by the driver).
      synchronize(src_device.index);
      TESSERA_CUDA_CHECK(cudaMemcpyPeer(dst, dst_device.index, src, src_device.index, n));
      return;
    }
    const int gpu = dst_device.is_cuda() ? dst_device.index : src_device.index;
    DeviceGuard guard(gpu);
    cudaStream_t stream = current_stream(gpu);
    if (capturing(gpu)) {
      // A graph replays the copy: its source must outlive the call, and a host read would
      // see values the recorded kernels have not computed.
      TESSERA_CHECK(!dst_device.is_cpu(), "cuda:", gpu, ": a device-to-host copy (",
                    n, " bytes, e.g. .item() or .cpu()) cannot be recorded in a CUDA graph: "
                    "the host would read values the recorded kernels have not computed yet");
      if (src_device.is_cpu()) src = stage_for_capture(gpu, src, n);
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
      return;
    }
    if (src_device.is_cpu() && dst_device.is_cuda() && n <= kStagedCopyMaxBytes) {
      copy_host_to_device_staged(dst, src, n, gpu, stream);
      return;
    }
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
    // A host side must see (or may reuse) its bytes when this returns.
    if (dst_device.is_cpu() || src_device.is_cpu()) {
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }

  std::function<void()> copy_to_host_async(void* pinned_host, const void* src, Device src_device,
                                           size_t n) override {
    const int gpu = src_device.index;
    DeviceGuard guard(gpu);
    TESSERA_CHECK(!capturing(gpu), "cuda:", gpu, ": a device-to-host read (", n,
                  " bytes) cannot be recorded in a CUDA graph");
    cudaStream_t stream = current_stream(gpu);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(pinned_host, src, n, cudaMemcpyDeviceToHost, stream));
    cudaEvent_t event = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    std::shared_ptr<CUevent_st> copied(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
    TESSERA_CUDA_CHECK(cudaEventRecord(event, stream));
    return [copied] { TESSERA_CUDA_CHECK(cudaEventSynchronize(copied.get())); };
  }

  void synchronize(int index) override { cuda::synchronize(index); }
  int device_count() override { return cuda::device_count(); }
  Allocator* pinned_host_allocator() override {
    static PinnedHostAllocator pinned;
    return &pinned;
  }
};

const bool registered = [] {
  static CudaBackend backend;
  register_device_backend(DeviceType::CUDA, &backend);
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
