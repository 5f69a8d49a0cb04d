// Registers the caching allocator's counters with core/memory_stats, so code above core
// (the trainer's metrics) can report reserved bytes without naming CUDA.
#include <cuda_runtime_api.h>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/memory_stats.h"

namespace tessera::cuda {
namespace {

DeviceMemoryStats read_caching_allocator(int index) {
  const MemoryStats s = memory_stats(index);
  size_t free_bytes = 0, total_bytes = 0;
  {
    const DeviceGuard on(index);
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();
      total_bytes = 0;
    }
  }
  return {s.allocated_bytes, s.reserved_bytes, s.peak_reserved_bytes, total_bytes};
}

const bool registered = [] {
  register_device_memory_stats(DeviceType::CUDA, &read_caching_allocator);
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
