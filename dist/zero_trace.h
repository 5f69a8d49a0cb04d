// A timeline of ZeRO's work, for teaching and tuning: with TESSERA_ZERO_TRACE=FILE every
// rank records when each unit's all-gather was issued and completed, when its forward and
// backward ran, when each bucket's reduction was issued and seen complete, and the offload
// worker's copies, for the first TESSERA_ZERO_TRACE_STEPS optimizer steps (default 3).
//
// The file is Chrome's trace-event JSON (open it in chrome://tracing or Perfetto; or render
// it with scripts/zero_timeline.py as text or PNG); rank r > 0 writes FILE.rank<r>. It is
// rewritten (atomically) after every traced step. Times are host microseconds of the
// monotonic clock (shared by the processes of one host, so ranks line up): on a GPU a span
// shows when the host issued the work and when it saw it complete (a wait that returned),
// which is what reveals whether communication hides behind compute. Threads: 0 = the
// training thread, 1 = the offload worker, 2 = the device's compute stream: on a GPU each
// unit's forward and backward are also timed by events on the compute stream
// ("forward_gpu", "backward_gpu"), mapped onto the host clock, so the file shows when the
// device really computed and not only when the host issued the kernels.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "tessera/core/device.h"

namespace tessera::dist {

// Device timestamps for the trace, registered by a device backend (CUDA:
// dist/cuda/zero_trace_clock.cpp): `record` puts a timing event on the device's current
// stream; `host_us` waits for it and returns its time on the host's monotonic clock.
struct DeviceClock {
  std::function<std::shared_ptr<void>(Device device)> record;
  std::function<double(const std::shared_ptr<void>& event, Device device)> host_us;
};
void register_device_clock(DeviceType type, DeviceClock clock);

class ZeroTrace {
 public:
  // True when TESSERA_ZERO_TRACE names a file and the limit of steps was not passed.
  static bool enabled();
  // The optimizer step being traced (spans of work queued in one step and finished in the
  // next, as the offload worker's copies back, name the step that queued them).
  static int current_step();
  // Microseconds of the host's monotonic clock.
  static double now_us();
  // Records [begin_us, end_us) of `name` for stage-3 unit / bucket `unit` (-1: none), as part
  // of `step` (-1: the current one).
  static void record(const char* name, int unit, double begin_us, double end_us, int step = -1);
  // The lane the calling thread's spans are drawn in (0 unless set).
  static void set_thread_lane(int lane);
  // An event on `device`'s current stream now (null for the CPU or a device without a clock).
  static std::shared_ptr<void> device_event(Device device);
  // Records the device time between two such events (resolved when the step's file is
  // written, waiting for the device then).
  static void record_device(const char* name, int unit, Device device, std::shared_ptr<void> begin,
                            std::shared_ptr<void> end);
  // Called by the strategy at the end of an optimizer step: writes the file (once more after
  // the last traced step, for that step's late spans).
  static void end_step(int rank);

  // Records its own lifetime.
  class Span {
   public:
    Span(const char* name, int unit, int step = -1)
        : name_(name), unit_(unit), step_(step), begin_(enabled() ? now_us() : -1) {}
    ~Span() {
      if (begin_ >= 0) record(name_, unit_, begin_, now_us(), step_);
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    const char* name_;
    int unit_, step_;
    double begin_;
  };
};

}  // namespace tessera::dist
