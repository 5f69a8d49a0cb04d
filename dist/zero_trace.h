// A timeline of ZeRO's work, for teaching and tuning: with TESSERA_ZERO_TRACE=FILE every
// rank records when each unit's all-gather was issued and completed, when its forward and
// backward ran, when each bucket's reduction was issued and seen complete, and the offload
// worker's copies, for the first TESSERA_ZERO_TRACE_STEPS optimizer steps (default 3).
//
// The file is Chrome's trace-event JSON (open it in chrome://tracing or Perfetto; or render
// it with scripts/zero_timeline.py as text or PNG); rank r > 0 writes FILE.rank<r>. It is
// rewritten (atomically) after every traced step. Times are host microseconds of the
// monotonic clock (shared by the processes of one host, so ranks line up): on a GPU a span shows
// when the host issued the work and when it saw it complete (a wait that returned), which is what
// reveals whether communication hides behind compute. Threads: 0 = the training thread, 1 = the
// offload worker.
#pragma once
#include <string>

namespace tessera::dist {

class ZeroTrace {
 public:
  // True when TESSERA_ZERO_TRACE names a file and fewer steps than the limit were traced.
  static bool enabled();
  // Microseconds of the host's monotonic clock.
  static double now_us();
  // Records [begin_us, end_us) of `name` for stage-3 unit / bucket `unit` (-1: none).
  static void record(const char* name, int unit, double begin_us, double end_us);
  // The lane the calling thread's spans are drawn in (0 unless set).
  static void set_thread_lane(int lane);
  // Called by the strategy at the end of an optimizer step: writes the file.
  static void end_step(int rank);

  // Records its own lifetime.
  class Span {
   public:
    Span(const char* name, int unit)
        : name_(name), unit_(unit), begin_(enabled() ? now_us() : -1) {}
    ~Span() {
      if (begin_ >= 0) record(name_, unit_, begin_, now_us());
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    const char* name_;
    int unit_;
    double begin_;
  };
};

}  // namespace tessera::dist
