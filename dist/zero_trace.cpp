#include "tessera/dist/zero_trace.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include "tessera/core/file_io.h"
#include "tessera/core/settings.h"
#include "tessera/dist/env.h"

namespace tessera::dist {

namespace {

struct TraceEvent {
  const char* name;
  int unit, step, lane;
  double begin_us, end_us;
};

struct DeviceSpan {
  const char* name;
  int unit, step;
  Device device;
  std::shared_ptr<void> begin, end;
};

std::array<DeviceClock, kNumDeviceTypes>& device_clocks() {
  static std::array<DeviceClock, kNumDeviceTypes> clocks;
  return clocks;
}

struct TraceState {
  std::mutex mutex;
  std::string path = setting_text(Setting::ZeroTrace);
  int max_steps = static_cast<int>(setting_integer(Setting::ZeroTraceSteps));
  std::atomic<int> step{0};  // read without the lock by enabled()
  std::vector<TraceEvent> events;
  std::vector<DeviceSpan> device_spans;  // resolved into events at the step's end
};

TraceState& state() {
  static TraceState* s = new TraceState();  // never destroyed: worker threads may record late
  return *s;
}

thread_local int lane_of_thread = 0;

}  // namespace

bool ZeroTrace::enabled() {
  const TraceState& s = state();
  return !s.path.empty() && s.step <= s.max_steps;
}

int ZeroTrace::current_step() { return state().step; }

double ZeroTrace::now_us() {
  // The monotonic clock's own origin (the host's boot on Linux): the same for every process
  // of a host, so the ranks' files line up.
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void ZeroTrace::set_thread_lane(int lane) { lane_of_thread = lane; }

void ZeroTrace::record(const char* name, int unit, double begin_us, double end_us, int step) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (step < 0) step = s.step;
  if (s.path.empty() || step >= s.max_steps) return;
  s.events.push_back({name, unit, step, lane_of_thread, begin_us, end_us});
}

void register_device_clock(DeviceType type, DeviceClock clock) {
  device_clocks()[static_cast<int>(type)] = std::move(clock);
}

std::shared_ptr<void> ZeroTrace::device_event(Device device) {
  const DeviceClock& clock = device_clocks()[static_cast<int>(device.type)];
  if (!enabled() || device.is_cpu() || !clock.record) return nullptr;
  return clock.record(device);
}

void ZeroTrace::record_device(const char* name, int unit, Device device,
                              std::shared_ptr<void> begin, std::shared_ptr<void> end) {
  if (!begin || !end) return;
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.path.empty() || s.step >= s.max_steps) return;
  s.device_spans.push_back({name, unit, s.step, device, std::move(begin), std::move(end)});
}

void ZeroTrace::end_step(int rank) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.path.empty() || s.step > s.max_steps) return;
  for (const DeviceSpan& d : s.device_spans) {
    const DeviceClock& clock = device_clocks()[static_cast<int>(d.device.type)];
    s.events.push_back({d.name, d.unit, d.step, /*lane=*/2, clock.host_us(d.begin, d.device),
                        clock.host_us(d.end, d.device)});
  }
  s.device_spans.clear();
  ++s.step;
  std::string json = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  for (size_t i = 0; i < s.events.size(); ++i) {
    const TraceEvent& e = s.events[i];
    char line[320];
    std::snprintf(line, sizeof line,
                  "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, "
                  "\"dur\": %.3f, \"args\": {\"unit\": %d, \"step\": %d}}%s\n",
                  e.name, rank, e.lane, e.begin_us, e.end_us - e.begin_us, e.unit, e.step,
                  i + 1 < s.events.size() ? "," : "");
    json += line;
  }
  json += "]}\n";
  const std::string path = rank == 0 ? s.path : s.path + ".rank" + std::to_string(rank);
  write_file_atomically(path, json);
}

}  // namespace tessera::dist
