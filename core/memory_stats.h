// What the host (CPU) allocator holds: the bytes of tensor storages alive now and the most
// alive at once since the last reset. Tests and benchmarks read it to see what a graph
// keeps for backward (e.g. with and without activation checkpointing).
#pragma once
#include <cstddef>

namespace tessera {

struct HostMemoryStats {
  size_t in_use = 0;  // bytes allocated and not yet freed
  size_t peak = 0;    // the largest in_use since the last reset_host_peak_memory()
};

HostMemoryStats host_memory_stats();
// Starts a new peak window at the current in_use.
void reset_host_peak_memory();

}  // namespace tessera
