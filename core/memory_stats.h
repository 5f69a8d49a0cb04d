// What a device's allocator holds, for logs and soak checks, without naming the backend:
// a device backend (core/cuda) registers a reader for its allocator's counters at
// start-up; a device without one (the CPU) has none.
#pragma once
#include <cstddef>
#include <optional>

#include "core/device.h"

namespace tessera {

struct DeviceMemoryStats {
  size_t allocated_bytes = 0;  // held by live tensors
  size_t reserved_bytes = 0;   // obtained from the device (in use or cached)
  size_t peak_reserved_bytes = 0;
};

using DeviceMemoryStatsReader = DeviceMemoryStats (*)(int index);
void register_device_memory_stats(DeviceType type, DeviceMemoryStatsReader reader);

// The allocator's counters of `device`, or nothing when its backend keeps none.
std::optional<DeviceMemoryStats> device_memory_stats(Device device);

}  // namespace tessera
