// The ZeRO trace's device clock on CUDA (dist/zero_trace.h): timing events on the compute
// stream, placed on the host's monotonic clock through one reference event per device whose
// host time is read right after the device reached it.
#include <map>
#include <memory>
#include <mutex>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/dist/zero_trace.h"

namespace tessera::dist {
namespace {

struct Reference {
  std::unique_ptr<cuda::Event> event;
  double host_us = 0;
};

const Reference& reference(int index) {
  static std::mutex mutex;
  static std::map<int, Reference> references;
  std::lock_guard<std::mutex> lock(mutex);
  Reference& r = references[index];
  if (!r.event) {
    cuda::DeviceGuard guard(index);
    r.event = std::make_unique<cuda::Event>(true);
    r.event->record(cuda::current_stream(index));
    r.event->synchronize();
    r.host_us = ZeroTrace::now_us();
  }
  return r;
}

const bool registered = [] {
  register_device_clock(
      DeviceType::CUDA,
      {.record = [](Device d) -> std::shared_ptr<void> {
         reference(d.index);  // first, so that every event's elapsed time is positive
         cuda::DeviceGuard guard(d.index);
         auto event = std::make_shared<cuda::Event>(true);
         event->record(cuda::current_stream(d.index));
         return event;
       },
       .host_us =
           [](const std::shared_ptr<void>& p, Device d) {
             const Reference& r = reference(d.index);
             const auto& event = *static_cast<const cuda::Event*>(p.get());
             event.synchronize();
             return r.host_us + 1000.0 * r.event->elapsed_ms(event);
           }});
  return true;
}();

}  // namespace
}  // namespace tessera::dist
