#include "tessera/core/memory_stats.h"

#include <atomic>

namespace tessera {
namespace {

std::atomic<DeviceMemoryStatsReader> g_cuda_reader{nullptr};

}  // namespace

void register_device_memory_stats(DeviceType type, DeviceMemoryStatsReader reader) {
  if (type == DeviceType::CUDA) g_cuda_reader = reader;
}

std::optional<DeviceMemoryStats> device_memory_stats(Device device) {
  const DeviceMemoryStatsReader reader = device.is_cuda() ? g_cuda_reader.load() : nullptr;
  if (!reader) return std::nullopt;
  return reader(device.index);
}

}  // namespace tessera
