// Registers the caching allocator's counters with core/memory_stats, so code above core
// (the trainer's metrics) can report reserved bytes without naming CUDA.
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/memory_stats.h"

namespace tessera::cuda {
namespace {

DeviceMemoryStats read_caching_allocator(int index) {
  const MemoryStats s = memory_stats(index);
  return {s.allocated_bytes, s.reserved_bytes, s.peak_reserved_bytes};
}

const bool registered = [] {
  register_device_memory_stats(DeviceType::CUDA, &read_caching_allocator);
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
