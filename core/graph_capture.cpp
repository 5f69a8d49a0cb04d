#include "tessera/core/graph_capture.h"

#include <array>
#include <atomic>

#include "tessera/core/allocator.h"

namespace tessera {
namespace {
thread_local bool capture_underway = false;

std::array<std::atomic<GraphBackend*>, kNumDeviceTypes>& graph_backends() {
  static std::array<std::atomic<GraphBackend*>, kNumDeviceTypes> table{};
  return table;
}
}  // namespace

bool graph_capture_underway() { return capture_underway; }

void detail::set_graph_capture_underway(bool on) { capture_underway = on; }

void register_graph_backend(DeviceType type, GraphBackend* backend) {
  graph_backends()[static_cast<int>(type)] = backend;
}

GraphBackend* graph_backend(DeviceType type) {
  if (type != DeviceType::CPU && !has_device_backend(type)) return nullptr;  // loads it
  return graph_backends()[static_cast<int>(type)].load();
}

}  // namespace tessera
