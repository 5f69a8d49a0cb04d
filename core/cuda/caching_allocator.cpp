#include "tessera/core/cuda/caching_allocator.h"

#include <memory>
#include <tuple>

#include "tessera/core/cuda/cuda_check.h"

namespace tessera::cuda {

namespace {
constexpr size_t kSmallLimit = size_t{1} << 20;   // below 1 MiB: 512-byte classes
constexpr size_t kSmallQuantum = 512;
constexpr size_t kLargeQuantum = size_t{2} << 20; // above: 2 MiB classes
}  // namespace

size_t allocation_size_class(size_t nbytes) {
  const size_t q = nbytes < kSmallLimit ? kSmallQuantum : kLargeQuantum;
  return (nbytes + q - 1) / q * q;
}

bool CachingAllocator::FreeKey::operator<(const FreeKey& o) const {
  return std::tie(pool, stream, size, ptr) < std::tie(o.pool, o.stream, o.size, o.ptr);
}

void* CachingAllocator::device_malloc(size_t size) {
  DeviceGuard guard(device_);
  void* ptr = nullptr;
  cudaError_t s = cudaSuccess;
  {
    // cudaMalloc is not stream work: allowed while a graph is captured, in relaxed mode.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (capture_pool_ != 0) cudaThreadExchangeStreamCaptureMode(&mode);
    s = cudaMalloc(&ptr, size);
    if (capture_pool_ != 0) cudaThreadExchangeStreamCaptureMode(&mode);
  }
  // During a capture, waiting for events or freeing memory would break the recording.
  if (s == cudaErrorMemoryAllocation && capture_pool_ == 0) {
    // Cached blocks may be what is missing: give them back and try once more.
    cudaGetLastError();
    ++stats_.num_oom_retries;
    collect_pending(/*wait=*/true);
    release_free_blocks();
    s = cudaMalloc(&ptr, size);
  }
  if (s != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    cudaGetLastError();
    const std::string msg = ::tessera::detail::concat(
        "cuda:", device_, ": out of memory allocating ", size, " bytes (", cudaGetErrorString(s),
        "); Tessera holds ", stats_.allocated_bytes, " bytes in tensors and ",
        stats_.reserved_bytes, " reserved; the device reports ", free_b, " free of ", total_b);
    throw OutOfMemoryError(msg);
  }
  ++stats_.num_device_allocs;
  stats_.reserved_bytes += size;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  return ptr;
}

void* CachingAllocator::allocate(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (capture_pool_ == 0) collect_pending(/*wait=*/false);
  const size_t size = allocation_size_class(nbytes);
  cudaStream_t stream = current_stream(device_);

  Block* block = nullptr;
  // Best fit in this stream's bins (of the capture's pool while a graph is captured),
  // accepting at most a quarter of waste so a huge cached block is not tied up by a small
  // request.
  auto best_fit = [&](uint64_t pool, cudaStream_t s) -> Block* {
    auto it = free_.lower_bound(FreeKey{pool, s, size, nullptr});
    if (it == free_.end() || it->first.pool != pool || it->first.stream != s ||
        it->first.size > size + size / 4)
      return nullptr;
    Block* found = it->second;
    free_.erase(it);
    return found;
  };
  block = best_fit(capture_pool_, stream);
  if (!block && capture_pool_ != 0 && (block = best_fit(0, capture_origin_))) {
    block->pool = capture_pool_;  // the capture's from now on (see the header)
    block->stream = stream;
  }
  if (block) {
    ++stats_.num_cache_hits;
  } else {
    auto owned = std::make_unique<Block>();
    owned->ptr = device_malloc(size);
    owned->size = size;
    owned->stream = stream;
    owned->pool = capture_pool_;
    block = owned.release();
  }
  block->other_streams.clear();
  active_[block->ptr] = block;
  stats_.allocated_bytes += block->size;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return block->ptr;
}

void CachingAllocator::to_free_bins(Block* b) { free_[FreeKey{b->pool, b->stream, b->size, b->ptr}] = b; }

void CachingAllocator::deallocate(void* ptr, size_t) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(ptr);
  TESSERA_CHECK(it != active_.end(), "cuda:", device_,
                ": caching allocator asked to free a pointer it did not allocate");
  Block* b = it->second;
  active_.erase(it);
  stats_.allocated_bytes -= b->size;
  if (capture_pool_ != 0) {
    // Freed while a graph is captured: its replays may still use the memory (an input
    // allocated before the capture is read by every replay), so it joins the graph's pool.
    b->pool = capture_pool_;
    if (b->other_streams.empty()) {
      to_free_bins(b);
    } else {
      capture_retired_.push_back(b);  // not reused before the side streams join again
    }
    return;
  }
  if (b->other_streams.empty()) {
    to_free_bins(b);
    return;
  }
  // Used on other streams too: reusable only once their work so far is done.
  PendingFree pending{{}, b};
  DeviceGuard guard(device_);
  for (cudaStream_t s : b->other_streams) {
    cudaEvent_t e = nullptr;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventRecord(e, s));
    pending.events.push_back(e);
  }
  pending_.push_back(std::move(pending));
}

void CachingAllocator::collect_pending(bool wait) {
  for (size_t i = 0; i < pending_.size();) {
    PendingFree& p = pending_[i];
    bool done = true;
    for (cudaEvent_t e : p.events) {
      cudaError_t s = wait ? cudaEventSynchronize(e) : cudaEventQuery(e);
      if (s == cudaErrorNotReady) {
        cudaGetLastError();
        done = false;
        break;
      }
      TESSERA_CUDA_CHECK(s);
    }
    if (!done) {
      ++i;
      continue;
    }
    for (cudaEvent_t e : p.events) cudaEventDestroy(e);
    to_free_bins(p.block);
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

void CachingAllocator::release_free_blocks() {
  DeviceGuard guard(device_);
  for (auto it = free_.begin(); it != free_.end();) {
    Block* block = it->second;
    if (block->pool != 0) {  // reserved for a graph's replays
      ++it;
      continue;
    }
    TESSERA_CUDA_CHECK(cudaFree(block->ptr));
    ++stats_.num_device_frees;
    stats_.reserved_bytes -= block->size;
    delete block;
    it = free_.erase(it);
  }
}

void CachingAllocator::begin_graph_pool(uint64_t pool, cudaStream_t origin) {
  std::lock_guard<std::mutex> lock(mutex_);
  TESSERA_CHECK(pool != 0 && capture_pool_ == 0, "cuda:", device_,
                ": a CUDA graph capture is already under way");
  collect_pending(/*wait=*/false);  // blocks whose other-stream uses are done are free to take
  capture_pool_ = pool;
  capture_origin_ = origin;
  pool_origin_[pool] = origin;
}

void CachingAllocator::end_graph_pool() {
  std::lock_guard<std::mutex> lock(mutex_);
  // The capture has joined every side stream: its retired blocks are ordered now.
  for (Block* b : capture_retired_) {
    b->other_streams.clear();
    to_free_bins(b);
  }
  capture_retired_.clear();
  capture_pool_ = 0;
  capture_origin_ = nullptr;
}

void CachingAllocator::release_graph_pool(uint64_t pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [ptr, block] : active_)
    if (block->pool == pool) block->pool = 0;  // back to the ordinary bins when freed
  std::vector<Block*> released;
  for (auto it = free_.begin(); it != free_.end();) {
    if (it->first.pool == pool) {
      released.push_back(it->second);
      it = free_.erase(it);
    } else {
      ++it;
    }
  }
  // The graph's replays are finished (CudaGraph synchronises before its pool goes), so the
  // free blocks may serve the stream the capture came from again.
  const auto origin = pool_origin_.find(pool);
  for (Block* b : released) {
    b->pool = 0;
    if (origin != pool_origin_.end()) b->stream = origin->second;
    to_free_bins(b);
  }
  if (origin != pool_origin_.end()) pool_origin_.erase(origin);
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capture_pool_ != 0) return;  // nothing may be waited for or freed during a capture
  collect_pending(/*wait=*/true);
  release_free_blocks();
}

void CachingAllocator::record_stream(const void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = active_.find(const_cast<void*>(ptr));
  TESSERA_CHECK(it != active_.end(), "cuda::record_stream: pointer is not the start of a block "
                "allocated by cuda:", device_, "'s caching allocator");
  Block* b = it->second;
  if (stream == b->stream) return;
  for (cudaStream_t s : b->other_streams)
    if (s == stream) return;
  b->other_streams.push_back(stream);
}

bool CachingAllocator::owns(const void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  return active_.count(const_cast<void*>(ptr)) != 0;
}

MemoryStats CachingAllocator::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

CachingAllocator& caching_allocator(int index) {
  // Never destroyed: tensors held in static objects may be freed during process exit.
  static std::vector<CachingAllocator*>* allocators = [] {
    auto* v = new std::vector<CachingAllocator*>();
    for (int d = 0; d < device_count(); ++d) v->push_back(new CachingAllocator(d));
    return v;
  }();
  TESSERA_CHECK(index >= 0 && index < static_cast<int>(allocators->size()), "device cuda:", index,
                " does not exist (", allocators->size(), " CUDA device(s) visible)");
  return *(*allocators)[index];
}

static int resolve_device(int d) { return d < 0 ? current_device() : d; }

MemoryStats memory_stats(int device) { return caching_allocator(resolve_device(device)).stats(); }
void reset_peak_memory_stats(int device) {
  caching_allocator(resolve_device(device)).reset_peak_stats();
}
void empty_cache(int device) { caching_allocator(resolve_device(device)).empty_cache(); }

void record_stream(const void* ptr, cudaStream_t stream) {
  cudaPointerAttributes attr{};
  TESSERA_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  TESSERA_CHECK(attr.type == cudaMemoryTypeDevice, "cuda::record_stream: not device memory");
  caching_allocator(attr.device).record_stream(ptr, stream);
}

}  // namespace tessera::cuda
