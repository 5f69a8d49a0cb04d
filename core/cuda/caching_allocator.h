// The per-device caching allocator behind CUDA tensors (internal to core/cuda).
//
// cudaMalloc and cudaFree synchronise the device and cost tens of microseconds,
// so freed blocks are kept in bins keyed by (stream, size class) and handed out
// again: a training loop that allocates the same sizes every step stops calling
// the driver after its first step. A block returns to the bin of the stream it
// was allocated on, where kernels are ordered after every earlier use; a block
// also used on another stream (record_stream) waits for an event on that stream
// before it can be reused.
//
// CUDA graphs: between begin_graph_pool and end_graph_pool every allocation comes from a
// pool private to the graph being captured, and so does every block freed meanwhile; the
// pool's blocks are handed out again only to that capture, never to other work, because
// each replay writes to the addresses the capture saw. Where the pool has no fitting block,
// a free block of the stream the capture was started from is moved into it before the
// driver is asked for new memory: every replay is ordered after that stream's earlier work,
// so the blocks an eager warm-up step left in the cache serve the graph (a recorded step
// then needs no second copy of the step's memory). release_graph_pool (when the graph is
// destroyed, its replays finished) returns the blocks to the ordinary bins of that stream.
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

  // `origin`: the stream the capture is ordered after (its free blocks may join the pool).
  void begin_graph_pool(uint64_t pool, cudaStream_t origin);
  void end_graph_pool();
  void release_graph_pool(uint64_t pool);

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;            // size class, as obtained from cudaMalloc
    uint64_t pool = 0;          // 0: ordinary; else the graph whose replays use it
    cudaStream_t stream = nullptr;  // the stream it was allocated on
    std::vector<cudaStream_t> other_streams;  // streams it was also used on
  };
  struct FreeKey {
    uint64_t pool;
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
  uint64_t capture_pool_ = 0;              // the pool allocations go to (0: none)
  cudaStream_t capture_origin_ = nullptr;  // whose free blocks the capture may take
  std::unordered_map<uint64_t, cudaStream_t> pool_origin_;  // where a pool's blocks go back
  std::vector<Block*> capture_retired_;    // freed during capture after use on other streams
  MemoryStats stats_;
};

// The allocator of device `index` (created on first use, lives for the whole process).
CachingAllocator& caching_allocator(int index);

}  // namespace tessera::cuda
