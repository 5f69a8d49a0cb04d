// The per-device caching allocator behind CUDA tensors (internal to core/cuda).
//
// cudaMalloc and cudaFree synchronise the device and cost tens of microseconds,
// so freed blocks are kept in bins keyed by (stream, size class) and handed out
// again: a training loop that allocates the same sizes every step stops calling
// the driver after its first step. A block returns to the bin of the stream it
// was allocated on, where kernels are ordered after every earlier use; a block
// also used on another stream (record_stream) waits for an event on that stream
// before it can be reused.
#pragma once
#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/cuda/cuda_runtime.h"

namespace tessera::cuda {

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}
  void* allocate(size_t nbytes) override;
  void deallocate(void* ptr, size_t nbytes) override;

  MemoryStats stats();
  void reset_peak_stats();
  void empty_cache();
  void record_stream(const void* ptr, cudaStream_t stream);
  bool owns(const void* ptr);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;            // size class, as obtained from cudaMalloc
    cudaStream_t stream = nullptr;  // the stream it was allocated on
    std::vector<cudaStream_t> other_streams;  // streams it was also used on
  };
  struct FreeKey {
    cudaStream_t stream;
    size_t size;
    void* ptr;
    bool operator<(const FreeKey& o) const;
  };
  struct PendingFree {
    std::vector<cudaEvent_t> events;
    Block* block;
  };

  void* device_malloc(size_t size);  // with one retry after emptying the cache
  void release_free_blocks();        // cudaFree of every cached block (lock held)
  void collect_pending(bool wait);   // move blocks whose events completed back to the bins
  void to_free_bins(Block* b);

  int device_;
  std::mutex mutex_;
  std::unordered_map<void*, Block*> active_;
  std::map<FreeKey, Block*> free_;
  std::vector<PendingFree> pending_;
  MemoryStats stats_;
};

// The allocator of device `index` (created on first use, lives for the whole process).
CachingAllocator& caching_allocator(int index);

}  // namespace tessera::cuda
