// What the allocators hold, for tests, logs and soak checks, without naming a backend.
//  - The host (CPU) allocator counts the bytes of tensor storages alive now and the most
//    alive at once since the last reset: tests and benchmarks read it to see what a graph
//    keeps for backward (e.g. with and without activation checkpointing).
//  - A device backend (core/cuda) registers a reader for its allocator's counters at
//    start-up; a device without one has none.
#pragma once
#include <cstddef>
#include <optional>

#include "tessera/core/device.h"

namespace tessera {

struct HostMemoryStats {
  size_t in_use = 0;  // bytes allocated and not yet freed
  size_t peak = 0;    // the largest in_use since the last reset_host_peak_memory()
};

HostMemoryStats host_memory_stats();
// Starts a new peak window at the current in_use.
void reset_host_peak_memory();

struct DeviceMemoryStats {
  size_t allocated_bytes = 0;  // held by live tensors
  size_t reserved_bytes = 0;   // obtained from the device (in use or cached)
  size_t peak_reserved_bytes = 0;
  size_t total_bytes = 0;  // the device's memory as its driver reports it (0: unknown)
};

using DeviceMemoryStatsReader = DeviceMemoryStats (*)(int index);
void register_device_memory_stats(DeviceType type, DeviceMemoryStatsReader reader);

// The allocator's counters of `device`, or nothing when its backend keeps none.
std::optional<DeviceMemoryStats> device_memory_stats(Device device);

}  // namespace tessera
